"""A decoding cache that can be rolled back to a prefix, for any layer kind transformers caches.

Speculative decoding feeds tokens that may be rejected, so every decode loop (the eval loop's target,
a draft model's own) must put its cache back to the accepted prefix. Keys and values are cut or
gathered position by position. A recurrent state (the linear attention of hybrid targets: Qwen3.5,
Qwen3-Next) folds all its tokens into one tensor that cannot be cut, so it is copied before tokens that
may be rejected (`RecurrentCheckpoint`) and put back after, and the accepted tokens are fed again.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin


def new_cache(model) -> DynamicCache:
    """The family's own cache layers (transformers' mapping of `layer_types`: keys and values for
    attention, a state for linear attention), except that a sliding-window layer keeps every key as a
    full-length layer: the caller's mask hides the keys out of the window, and rejected tokens can be
    cut off like any other layer's."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def key_layers(cache: DynamicCache) -> list:
    """The cache layers holding keys and values (a linear-attention layer holds a state instead)."""
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None]


def cut_keys(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` positions of every key/value layer."""
    for layer in key_layers(cache):
        layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def recurrent_states(cache: DynamicCache) -> list[torch.Tensor]:
    """Every recurrent (linear-attention) state of the cache: convolution windows and recurrent states."""
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
