"""The frozen target sharded across the ranks of a run (`target.shard=fsdp`), so that a target too
big for one device (Llama-3.1-70B in bf16 is 141 GB) still trains drafters online, and captures and
regenerates data.

Engine: torch's FSDP2 (`fully_shard`) over all ranks of the run's process group. The drafter is not
touched: accelerate prepares it as before (DDP, or whatever the launch config says).

What is sharded and what is not:

- every child of a decoder layer that holds a matrix (attention, MLP, an MoE block) is its own FSDP
  unit: its weights live in 1/world pieces, are all-gathered just before it runs and freed right
  after, so a rank holds one or two blocks whole at a time;
- the root unit (the model) shards what is left inside the decoder layers (their norms);
- the token embedding, the final norm and the lm_head stay whole on every rank (replicated).

Why not shard those too: drafters call the target's embedding and lm_head outside the target's
forward (EAGLE, EAGLE-3 and DFlash embed tokens and score features with them in their loss and at
decode time; EAGLE-3 copies lm_head rows for its draft vocabulary, Medusa copies the lm_head at
start, EAGLE-3/DFlash the final norm). As plain tensors they work unchanged and cost no collective;
sharded, every such call would have to be a collective that all ranks make in step. The price is
their memory on every rank: 2 x vocab x hidden, for Llama-3.1-70B 2 x 128256 x 8192 x 2 bytes =
4.2 GB of the 141 GB. Decoder layers are not themselves units because `fully_shard` swaps a module's
class for an FSDP subclass, and EAGLE-family drafters rebuild the target's layers from the class
name of `get_decoder().layers[0]`; sharding the blocks inside keeps that class the target's own.

Loading: every rank builds the model with its parameters on the meta device (no memory), shards it,
then only rank 0 reads the weights (into host memory) and torch's `set_model_state_dict` with
`broadcast_from_rank0` sends them tensor by tensor; each rank keeps its pieces. No device ever holds
the whole target; rank 0's host memory holds it once, while loading.

Every rank must run every forward of the target (each unit's all-gather is a collective): training
does (all ranks step together); a job whose ranks have different amounts of work (capture,
regenerate) runs its forwards through `Lockstep`.

Not supported (a one-line error at recipe validation, `unshardable`): Medusa-2, which trains LoRA
inside the target's layers, a draft model built from copies of the target's first layers, and Gemma-4's
assistant, which runs two target layers' norms and key and value projections outside the target's forward.
Loading a target has one home, `draftsmith.target.load_target`: the stages that train, capture or
regenerate pass it the recipe's `target.shard`, and for `fsdp` it calls `load_sharded` here with the
target's config and a reader of its weights; this module imports nothing from it. The eval stage and
the export always load the target whole on one device.
"""

from __future__ import annotations

import atexit
import logging
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, TypeVar

import torch
from torch import nn

from draftsmith.causal_lm import register_misfiled_causal_lms, text_model_of_a_wrapper, wraps_a_text_model
from draftsmith.errors import UserError

log = logging.getLogger("draftsmith.sharding")


def unshardable(drafter_config) -> Optional[str]:
    """Why a drafter cannot train against a sharded target, or None when it can: its kind says
    (`Drafter.unshardable`)."""
    from draftsmith.heads import drafter_class

    return drafter_class(drafter_config.type).unshardable(drafter_config)


def check_shard(cfg) -> None:
    """Recipe validation: target.shard=fsdp with a drafter that cannot work with it, or with the target's layers
    compiled, is a one-line error."""
    if cfg.target.shard == "none":
        return
    if cfg.train.compile_target:  # FSDP2's hooks around each layer, compiled with it: never run
        raise UserError(
            f"train.compile_target=true with target.shard={cfg.target.shard}: compiling a sharded target's layers is "
            "not supported yet; drop one"
        )
    reason = unshardable(cfg.drafter)
    if reason:
        raise UserError(f"target.shard={cfg.target.shard} does not work with drafter.type={cfg.drafter.type}: {reason}")


# What a rank waits in a collective before torch ends the job (its default: 10 minutes for NCCL, 30 for gloo). Rank 0
# works alone longer than that where the others wait in a barrier or broadcast: tokenizing a large data set into the
# cache (main_process_first), reading a whole target to shard it (load_sharded). A hang is a bug, not a rank's work.
RANKS_TIMEOUT_S = 4 * 3600


def ranks_state():
    """accelerate's PartialState of a train, capture or regenerate command: its ranks' process group, formed here with
    RANKS_TIMEOUT_S. Without a GPU accelerate forms a (gloo) group only when told the run is on CPU."""
    from datetime import timedelta

    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available(), timeout=timedelta(seconds=RANKS_TIMEOUT_S))


def end_process_group() -> None:
    """At the end of a multi-process job: every rank past its last collective, then the group
    destroyed while the interpreter is still whole (gloo's worker threads outliving it can abort a
    rank at exit with SIGABRT, after its work is done)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def release_device_mesh() -> None:
    """Free a sharded target's device mesh, and with it the mesh's process group, while the
    interpreter is still whole. DTensor caches sharding decisions in module-level caches that hold
    the mesh, so without this the group outlives `destroy_process_group` and is torn down with the
    interpreter, where its gloo threads could abort a finished rank with SIGABRT (seen as one rank of
    a 2-rank sharded regeneration dying after its work). Runs at exit once a sharded target is loaded."""
    import gc

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # both caches: Python and C++

    _clear_sharding_prop_cache()
    gc.collect()  # the target's modules hold the mesh in reference cycles (FSDP's hooks)


def built_empty(config, dtype: torch.dtype, trust_remote_code: bool):
    """The model of `config` as draftsmith.target_loading.read_model builds it, its parameters on the meta device and
    its buffers real (the rotary frequencies are computed here, not stored in the checkpoint): no weight is read. No
    random initialisation runs on meta, but the RNG is kept as it was anyway, so a sharded run draws the same drafter
    initialisation as an unsharded one."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from draftsmith.wrapped_text import built_language_causal_lm

    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        if text_model_of_a_wrapper(config.to_dict()):
            from draftsmith.text_model_lm import built_text_model_lm

            return built_text_model_lm(config, dtype=dtype)
        if wraps_a_text_model(config.to_dict()):
            return built_language_causal_lm(config, dtype=dtype)
        register_misfiled_causal_lms()
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)


def load_sharded(
    config, dtype: torch.dtype, device: torch.device | str, read_weights: Callable[[], dict], trust_remote_code: bool
):
    """The model of `config` with its decoder layers sharded over every rank of the run (see the
    module docstring), its weights from `read_weights()`, called on rank 0 only (the whole state dict,
    in host memory, in `dtype`); draftsmith.target.load_target calls this for `target.shard=fsdp`.
    Collective: every rank calls it. Without a process group (plain `python`), a one-process group is
    formed, so a single process runs the same code."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    atexit.unregister(release_device_mesh)  # once per process, however many targets it loads
    atexit.register(release_device_mesh)

    model = built_empty(config, dtype, trust_remote_code)
    model.requires_grad_(False)
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    shard_target(model, init_device_mesh(device.type, (world,)))
    model.to_empty(device=device)
    with torch.no_grad():
        for name, buffer in model.named_buffers():  # to_empty left them uninitialised
            buffer.copy_(buffers[name])
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()

    full, error = {}, [None]
    if rank == 0:
        try:
            full = read_weights()
        except UserError as err:
            error = [str(err)]
    dist.broadcast_object_list(error, src=0)  # a bad checkpoint is one error on every rank, not a hang
    if error[0] is not None:
        raise UserError(error[0])
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    log.info(
        "target %s sharded over %d rank(s): %.2f GB of %.2f GB on this rank",
        config.name_or_path,
        world,
        local_bytes(model) / 1e9,
        whole_bytes(model) / 1e9,
    )
    return model


def shard_target(model: nn.Module, mesh) -> nn.Module:
    """Apply FSDP2 to a target in place: each matrix-holding child of each decoder layer is a unit,
    the root holds the rest of the layers; embedding, final norm and lm_head are left whole."""
    from torch.distributed.fsdp import fully_shard

    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise UserError(f"target.shard=fsdp needs a decoder with `layers`; {type(model).__name__} has none")
    # Frozen: nothing is all-gathered again for a backward, so every unit (the root too) frees its
    # gathered weights as soon as its forward is done.
    for layer in layers:
        for block in layer.children():
            if any(p.dim() >= 2 for p in block.parameters()):
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, ignored_params=set(replicated_parameters(model)))
    return model


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The target's parameters that stay whole on every rank: embedding, final norm, lm_head."""
    decoder = model.get_decoder()
    modules = [model.get_input_embeddings(), model.get_output_embeddings(), getattr(decoder, "norm", None)]
    return [p for module in modules if module is not None for p in module.parameters()]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def local_bytes(model: nn.Module) -> int:
    """Bytes of the target's parameters held on this rank (a sharded parameter's local piece)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def whole_bytes(model: nn.Module) -> int:
    """Bytes of all the target's parameters, sharded or not (what one unsharded copy takes)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


T = TypeVar("T")


class Lockstep:
    """Runs a sharded target's forwards in step on every rank when ranks have different amounts of
    work (capture and regenerate: each rank its own slice of the data, some of it done by an earlier run).

    Before each of its forwards a rank with work votes 1 (`run`); a rank out of work (`finish`) votes
    0 and, while any rank voted 1, runs a one-token forward alongside, so every rank makes the same
    collectives in the same order. Does nothing for an unsharded target."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.active = is_sharded(model)

    def run(self, forward: Callable[..., T], *args, **kwargs) -> T:
        """`forward(*args, **kwargs)`, which runs the target once."""
        if self.active:
            self._any_busy(1)
        return forward(*args, **kwargs)

    def finish(self, idle: Optional[Callable[[], object]] = None) -> None:
        """Run `idle` (default: a one-token forward) alongside each forward the other ranks still
        make; returns when every rank has called `finish`. `idle` must make the same collectives as
        one `run` call (for `generate` with `synced_gpus`: a one-token generate)."""
        if not self.active:
            return
        if idle is None:
            device = self.model.get_output_embeddings().weight.device
            token = torch.zeros((1, 1), dtype=torch.long, device=device)

            def idle():
                return self.model(input_ids=token, use_cache=False)

        while self._any_busy(0):
            with torch.no_grad():
                idle()

    def _any_busy(self, busy: int) -> bool:
        import torch.distributed as dist

        vote = torch.tensor([busy], device=self.model.get_output_embeddings().weight.device)
        dist.all_reduce(vote)
        return bool(vote.item() > 0)


@contextmanager
def built_whole() -> Iterator[None]:
    """Models built inside are whole, also in a process launched with DeepSpeed ZeRO-3. accelerate keeps
    transformers' DeepSpeed config alive whatever `zero3_init_flag` says, and transformers then builds
    every model partitioned (each weight of shape [0]): the frozen target, which DeepSpeed's engine
    never holds, and the drafter, which `accelerator.prepare` partitions itself. Seen on a GPU: a ZeRO-3
    launch read the target's vocabulary as 0. transformers has no public way to set that config aside
    and put it back, so its module-level reference is swapped out for the block."""
    from transformers.integrations import deepspeed as hf_deepspeed

    kept = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = kept  # accelerator.prepare reads it
