"""The frozen target's decoder layers under torch.compile (train.compile_target).

Why layers and not the whole model: transformers records the hidden states the drafters read at the layers'
boundaries (output_hidden_states), and a decoder's forward around them builds masks and positions once; a layer
is the code that runs over and over. Compiled with nn.Module.compile, every layer of one class runs one graph (a
layer's parameters are inputs of the graph, not constants of it), which fuses a layer's norms, rotary embedding,
activations and residual additions: the kernel launches that bound the step of a small target on a GPU.

A batch of another width recompiles once with dynamic shapes (torch's automatic dynamic), another number of rows
once more, a single row once (torch specializes a size of 1); the layers of another class (a hybrid target's
linear-attention and attention layers) compile their own. transformers records outputs with hooks that read a
ContextVar, which torch.compile cannot trace (transformers 5.25): each layer runs as a few graphs, split where its
attention's hook runs. Past RECOMPILE_LIMIT graphs of one function torch would run it uncompiled without a word;
here it raises instead (`limits`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from draftsmith.errors import UserError
from draftsmith.target_weights import decoder_of

# graphs of one layer class: (static, then dynamic) x grad mode x the mask kinds a family builds, with room
RECOMPILE_LIMIT = 16


def compile_layers(model) -> int:
    """Each of `model`'s decoder layers compiled in place (the first call of each class compiles); returns how many."""
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UserError(
            f"train.compile_target=true compiles a target's decoder layers; {type(model).__name__} has no `layers`"
        )
    for layer in layers:
        layer.compile()
    return len(layers)


@contextmanager
def limits() -> Iterator[None]:
    """The compiled layers within RECOMPILE_LIMIT graphs per function, an error past it (not torch's eager fallback)."""
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        yield
