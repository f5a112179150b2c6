"""A decoding cache that can be rolled back to a prefix, for any layer kind transformers caches.

Speculative decoding feeds tokens that may be rejected, so every decode loop (the eval loop's target,
a draft model's own) must put its cache back to the accepted prefix. What a layer keeps per position
(keys and values; a sparse-attention layer's indexer keys too, DeepSeek-V3.2) is cut, moved or gathered
position by position. A recurrent state (the linear attention of hybrid targets: Qwen3.5,
Qwen3-Next) folds all its tokens into one tensor that cannot be cut. Where the family's transformers code keeps
that state at every position of a forward (`RecordedStates`: transformers' own past recording, as an engine keeps
a state per draft position), the states of the rejected positions are dropped and nothing is fed again. Elsewhere
the states are copied before tokens that may be rejected (`RecurrentCheckpoint`) and put back after, and the
accepted tokens are fed again. So is a cache whose attention pools several positions into one entry
(DeepSeek-V4's compressed attention): there every layer is put back whole, as the family's own cache layers keep
them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from draftsmith.families import COMPRESSED

if TYPE_CHECKING:  # transformers is imported where a cache is made: a recipe's check needs none of it
    from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    """The family's own cache layers (transformers' mapping of `layer_types`: keys and values for
    attention, a state for linear attention), except that a sliding-window layer keeps every key as a
    full-length layer: the caller's mask hides the keys out of the window, and rejected tokens can be
    cut off like any other layer's. A cache that pools positions keeps the family's layers as they are: its
    sliding-window layers keep their window only, as the family's mask expects, and are put back whole."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if not pooled_layers(cache):
        cache.layers = [full_length(layer) if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def full_length(layer):
    """A sliding-window cache layer's full-length kind: keys only, or keys beside convolution windows (Inkling's)."""
    from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer, LinearAttentionLayer

    if isinstance(layer, LinearAttentionLayer):
        return LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    return DynamicLayer()


def pooled_layers(cache: DynamicCache) -> list:
    """Every layer of a cache with compressed attention (DeepSeek-V4), none otherwise: these are put back
    whole after a rejected draft, never cut per position."""
    if any(getattr(layer, "_layer_type", None) in COMPRESSED for layer in cache.layers):
        return list(cache.layers)
    return []


# What a cache layer may keep per position: (attribute, batch dimension, position dimension). Keys and
# values [B, heads, positions, d]; a sparse-attention layer's indexer keys [B, positions, d] and their
# positions [position dims, B, positions] (transformers' DynamicIndexedLayer); a block-sparse layer's indexer keys
# [B, 1, positions, d] (MiniMax-M3's).
PER_POSITION = (
    ("keys", 0, 2),
    ("values", 0, 2),
    ("indexer_keys", 0, 1),
    ("indexer_position_ids", 1, 2),
    ("idx_keys", 0, 2),
)


def cached_length(cache: DynamicCache) -> int:
    """How many positions `cache` holds: the count of its layers that keep keys, else the cache's own. Not
    `cache.get_seq_length()` alone: since transformers 5.25 a cache whose first layer is linear attention answers
    with that layer's token count, a tensor the next forward adds to in place."""
    keyed = key_layers(cache)
    return int((keyed[0] if keyed else cache).get_seq_length())


def key_layers(cache: DynamicCache) -> list:
    """The cache layers holding keys and values that can be cut per position (a linear-attention layer holds a
    state instead; a cache that pools positions is put back whole)."""
    if pooled_layers(cache):
        return []
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


def per_position(layer) -> list[tuple[str, int, int]]:
    """(attribute, batch dimension, position dimension) of every tensor `layer` keeps per position."""
    return [
        (name, batch, position)
        for name, batch, position in PER_POSITION
        if isinstance(getattr(layer, name, None), torch.Tensor) and getattr(layer, name).dim() > position
    ]


def cut_keys(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every layer that keeps keys."""
    for layer in key_layers(cache):
        for name, _, position in per_position(layer):
            setattr(layer, name, getattr(layer, name).narrow(position, 0, length))


def move_positions(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """One row: the positions `start + keep` (in order) written to `start`, `start + 1`, ... in every
    layer that keeps keys (the right-hand side is gathered first, so an overlap is safe)."""
    for layer in key_layers(cache):
        for name, _, position in per_position(layer):
            tensor = getattr(layer, name)
            tensor.narrow(position, start, len(keep)).copy_(tensor.index_select(position, keep + start))


def gather_positions(cache: DynamicCache, index: torch.Tensor) -> None:
    """Several rows: row b keeps the positions `index[b]` [B, W], in that order, in every layer that
    keeps keys (each tensor gathered on its own: keys and values may differ in heads and width, as in
    multi-head latent attention)."""
    for layer in key_layers(cache):
        for name, batch, position in per_position(layer):
            tensor = getattr(layer, name)
            shape = [1] * tensor.dim()
            shape[batch], shape[position] = index.shape
            wide = list(tensor.shape)
            wide[position] = index.shape[1]
            setattr(layer, name, tensor.gather(position, index.view(shape).expand(wide)))


def select_rows(cache: DynamicCache, rows: torch.Tensor, width: int) -> None:
    """Keep the batch rows `rows` and the last `width` positions of every layer that keeps keys."""
    for layer in key_layers(cache):
        for name, batch, position in per_position(layer):
            tensor = getattr(layer, name).index_select(batch, rows)
            setattr(layer, name, tensor.narrow(position, tensor.shape[position] - width, width))


def recurrent_states(cache: DynamicCache) -> list[torch.Tensor]:
    """Every recurrent (linear-attention) state of the cache: convolution windows, recurrent states, and the count
    of tokens folded into them (transformers 5.25 and later: the positions a forward without position ids takes
    its own from, when the cache's first layer is linear attention)."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    states = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            count = getattr(layer, "cumulative_length_linear", None)
            for state in (*layer.conv_states.values(), *layer.recurrent_states.values(), count):
                if state is not None:
                    states.append(state)
    return states


def recordable_layers(cache: DynamicCache) -> list:
    """The linear-attention layers of `cache`, where they are its only layers that read tokens in order and each holds
    one state: transformers 5.25 keeps one history list for all of a layer's states (`dict.fromkeys(..., [])`), and
    its `crop` slices a convolution window for states without one (Qwen4-Exp's, Inkling's). Empty otherwise."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    layers = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
    if pooled_layers(cache) or any(layer.number_of_states != 1 for layer in layers):
        return []
    return layers


class RecordedStates:
    """transformers keeps the states of `layers` (`recordable_layers`) at each of the next forward's last `width`
    positions; `put_back(dropped)` keeps those of all but the last `dropped` (none: it drops the history alone, which
    must follow every such forward). The accepted tokens need not be fed again."""

    def __init__(self, layers: list, width: int):
        self.layers = layers
        for layer in layers:
            layer.activate_past_recording(recurrent_states_to_keep=width)

    def put_back(self, dropped: int) -> bool:
        """Whether the accepted tokens must be fed again: never."""
        for layer in self.layers:
            layer.crop(-dropped)
        return False


class RecurrentCheckpoint:
    """What a cache's in-order layers hold, taken before tokens that may be rejected; `restore` puts it back.
    Linear attention updates its states in place: they are copied, and written back in place (the layers
    keep their tensors, as transformers' in-place updates expect). Compressed attention's layers rebind
    their tensors (concatenations, slices), never write them: their attributes are kept by reference and
    rebound, once torch's version counters show nothing wrote to them in place. Empty, and free, for a
    cache without such layers."""

    def __init__(self, cache: DynamicCache):
        self.states = recurrent_states(cache)
        self.copies = [state.clone() for state in self.states]
        self.pooled = [(layer, layer_attributes(layer)) for layer in pooled_layers(cache)]
        self.versions = [tensor._version for _, attributes in self.pooled for tensor in tensors_of(attributes)]

    def __bool__(self) -> bool:
        return bool(self.states or self.pooled)

    def put_back(self, dropped: int) -> bool:
        """After a forward whose last `dropped` tokens were rejected: whether the accepted ones must be fed again (the
        states put back to before the forward), else nothing to do."""
        if not (dropped and self):
            return False
        self.restore()
        return True

    def restore(self) -> None:
        for state, copy in zip(self.states, self.copies):
            state.copy_(copy)
        kept = [tensor for _, attributes in self.pooled for tensor in tensors_of(attributes)]
        if [tensor._version for tensor in kept] != self.versions:
            raise RuntimeError("a compressed-attention cache layer wrote a kept tensor in place: it cannot be put back")
        for layer, attributes in self.pooled:
            vars(layer).update(layer_attributes(attributes))


def layer_attributes(holder) -> dict:
    """A cache layer's attributes (or a kept copy of them), dictionaries copied one level down: the layer
    rebinds their entries."""
    attributes = holder if isinstance(holder, dict) else vars(holder)
    return {name: dict(value) if isinstance(value, dict) else value for name, value in attributes.items()}


def tensors_of(attributes: dict) -> list[torch.Tensor]:
    values = [v for value in attributes.values() for v in (value.values() if isinstance(value, dict) else [value])]
    return [value for value in values if isinstance(value, torch.Tensor)]
