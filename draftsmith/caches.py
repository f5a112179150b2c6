"""A decoding cache that can be rolled back to a prefix, for any layer kind transformers caches.

Speculative decoding feeds tokens that may be rejected, so every decode loop (the eval loop's target,
a draft model's own) must put its cache back to the accepted prefix. What a layer keeps per position
(keys and values; a sparse-attention layer's indexer keys too, DeepSeek-V3.2) is cut, moved or gathered
position by position. A recurrent state (the linear attention of hybrid targets: Qwen3.5,
Qwen3-Next) folds all its tokens into one tensor that cannot be cut, so it is copied before tokens that
may be rejected (`RecurrentCheckpoint`) and put back after, and the accepted tokens are fed again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported where a cache is made: a recipe's check needs none of it
    from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    """The family's own cache layers (transformers' mapping of `layer_types`: keys and values for
    attention, a state for linear attention), except that a sliding-window layer keeps every key as a
    full-length layer: the caller's mask hides the keys out of the window, and rejected tokens can be
    cut off like any other layer's."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


# What a cache layer may keep per position: (attribute, batch dimension, position dimension). Keys and
# values [B, heads, positions, d]; a sparse-attention layer's indexer keys [B, positions, d] and their
# positions [position dims, B, positions] (transformers' DynamicIndexedLayer).
PER_POSITION = (("keys", 0, 2), ("values", 0, 2), ("indexer_keys", 0, 1), ("indexer_position_ids", 1, 2))


def key_layers(cache: DynamicCache) -> list:
    """The cache layers holding keys and values (a linear-attention layer holds a state instead)."""
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
    """Every recurrent (linear-attention) state of the cache: convolution windows and recurrent states."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    states = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for state in (*layer.conv_states.values(), *layer.recurrent_states.values()):
                if state is not None:
                    states.append(state)
    return states


class RecurrentCheckpoint:
    """A copy of a cache's recurrent states, taken before tokens that may be rejected; `restore` writes
    it back in place (the layers keep their tensors, as transformers' in-place updates expect). Empty,
    and free, for a cache without recurrent layers."""

    def __init__(self, cache: DynamicCache):
        self.states = recurrent_states(cache)
        self.copies = [state.clone() for state in self.states]

    def __bool__(self) -> bool:
        return bool(self.states)

    def restore(self) -> None:
        for state, copy in zip(self.states, self.copies):
            state.copy_(copy)
