"""The frozen target's decoder layers (train.compile_target) and the drafter's blocks (train.compile_drafter) under
torch.compile.

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

The drafter's blocks (`Drafter.COMPILED_BLOCKS`: EAGLE-3's draft layer) run once per training-time-test step, forward
and backward: compiled, each step's layer is one graph each way, its attention included (flex attention traced into
it on a GPU). A step's keys differ in kind from the step before's (step 0's alone, then one, two, more earlier
steps' beside them), so the first four steps compile a graph each and the later ones share one; with the static,
then dynamic widths and both grad modes (the held-out evaluation's forward) that is at most 16 graphs: 9 at 3
steps on the demo recipe's padded micro-batches, 16 at 7 on its packed ones. Past DRAFTER_RECOMPILE_LIMIT it
raises (`drafter_limits`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager, nullcontext
from typing import Iterator, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.target_weights import decoder_of

log = logging.getLogger("draftsmith.compiled_layers")

# graphs of one layer class: (static, then dynamic) x grad mode x the mask kinds a family builds, with room
RECOMPILE_LIMIT = 16
# graphs of a drafter's block: 4 step kinds x (static, then dynamic) x grad mode, twice over for batches of one row
# (torch specializes a size of 1)
DRAFTER_RECOMPILE_LIMIT = 32
BACKEND = "inductor"  # torch.compile's: fused Triton kernels on a GPU, C++ on a CPU


def compile_layers(model) -> int:
    """Each of `model`'s decoder layers compiled in place (the first call of each class compiles); returns how many."""
    layers = getattr(decoder_of(model), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise UserError(
            f"train.compile_target=true compiles a target's decoder layers; {type(model).__name__} has no `layers`"
        )
    for layer in layers:
        layer.compile(backend=BACKEND)
    return len(layers)


def compile_drafter(drafter, deepspeed_plugin=None) -> int:
    """Each of `drafter`'s blocks (its kind's COMPILED_BLOCKS) compiled in place; returns how many. Their parameters
    stay where they are (nn.Module.compile): the checkpoint's names do not change. `deepspeed_plugin`: accelerate's,
    of a DeepSpeed launch."""
    if deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3:
        raise UserError(
            "train.compile_drafter=true under DeepSpeed ZeRO-3 (whose hooks gather a block's weights as it runs) was "
            "never run compiled; drop it, or launch with ZeRO-2 or without DeepSpeed"
        )
    blocks = getattr(drafter, type(drafter).COMPILED_BLOCKS)
    for block in blocks:
        block.compile(backend=BACKEND)
    log.info("the drafter's %d blocks compiled (train.compile_drafter)", len(blocks))
    return len(blocks)


@contextmanager
def limits(limit: Optional[int] = None) -> Iterator[None]:
    """The compiled layers within `limit` graphs per function (RECOMPILE_LIMIT by default), an error past it (not
    torch's eager fallback)."""
    limit = RECOMPILE_LIMIT if limit is None else limit
    with torch._dynamo.config.patch(recompile_limit=limit, fail_on_recompile_limit_hit=True):
        yield


def drafter_limits(enabled: bool = True):
    """`limits` of the drafter's compiled blocks around a call of the drafter, where `enabled` (train.compile_drafter):
    nothing to enter otherwise (the patch costs ~75 us a call)."""
    return limits(DRAFTER_RECOMPILE_LIMIT) if enabled else nullcontext()
