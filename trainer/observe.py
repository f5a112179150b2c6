"""What the training loop reports about its own speed and size (issue #37): parameter counts, the model
FLOP count per token behind MFU, peak memory, the torch profiler over `train.profile_steps`, and
run_summary.json (per-rank checksums for checking a distributed run).

One place for the FLOP count: `flops_per_token` (its docstring states the formula), fed by
`matmul_parameters` and `attention_width` of the target and the drafter. trainer/loop.py logs
`train/mfu` at `log_every` when the user gives the device's peak (`train.peak_tflops`), and
benchmarks/train_throughput.py reports the same figure.
"""

from __future__ import annotations

import json
import logging
import resource
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from draftsmith.files import write_text_atomic
from draftsmith.heads.base import Drafter
from draftsmith.outputs import RUN_SUMMARY_NAME
from draftsmith.sharding import local_bytes
from draftsmith.trainer.checkpoint import TrainerState

log = logging.getLogger("draftsmith.train")


def numel(param: torch.Tensor) -> int:
    """A parameter's full size: DeepSpeed ZeRO-3 leaves an empty local tensor and the size in ds_numel;
    a DTensor (FSDP2) reports its global size."""
    return int(getattr(param, "ds_numel", param.numel()))


def parameter_counts(target: nn.Module, drafter: nn.Module) -> dict[str, int]:
    """`trainable`: the drafter's parameters that train; `frozen`: every other parameter the run holds,
    the target's and the drafter's frozen ones (a drafter may re-attach the target's embedding or lm_head:
    each tensor is counted once); `target`: the target's own."""
    seen: set[int] = set()
    trainable = frozen = 0
    for param in [*drafter.parameters(), *target.parameters()]:
        if id(param) in seen:
            continue
        seen.add(id(param))
        if param.requires_grad:
            trainable += numel(param)
        else:
            frozen += numel(param)
    return {"trainable": trainable, "frozen": frozen, "target": sum(numel(p) for p in target.parameters())}


def matmul_parameters(
    model: nn.Module, trainable_only: bool = False, prefixes: Optional[tuple[str, ...]] = None
) -> int:
    """The parameters a token's forward multiplies by once each: every >= 2-D weight but embedding tables
    (a lookup, no FLOPs); an lm_head counts even when it shares the embedding's tensor (it is a matmul).
    Mixture-of-experts weights (parameter names containing `.experts.`) count at the routed share,
    num_experts_per_tok / num_experts of the model's config: the active parameters. `prefixes`: only the
    parameters whose names start with one of them."""
    config = getattr(model, "config", None)
    routed = getattr(config, "num_experts_per_tok", None)
    experts = next(
        (
            getattr(config, k)
            for k in ("num_experts", "num_local_experts", "n_routed_experts")
            if getattr(config, k, None)
        ),
        None,
    )
    share = routed / experts if routed and experts else 1.0
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = id(output.weight) if isinstance(output, nn.Linear) else None
    total, counted = 0.0, set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.dim() < 2 or (trainable_only and not param.requires_grad) or id(param) in counted:
            continue
        if prefixes is not None and not name.startswith(prefixes):
            continue
        if id(param) in embeddings and id(param) != head:  # a lookup; a tied lm_head is counted once
            continue
        counted.add(id(param))
        total += numel(param) * (share if ".experts." in f".{name}" else 1.0)
    return int(total)


def attention_width(model: nn.Module) -> int:
    """Sum over the model's attention modules of query heads x head dim (num_attention_heads x head_dim
    of each module's config, of its layer's where the config sets heads per layer: Step-3.5's sliding
    layers have more), the width the attention term of `flops_per_token` multiplies."""
    width = 0
    for module in model.modules():
        config, head_dim = getattr(module, "config", None), getattr(module, "head_dim", None)
        layer = getattr(module, "layer_idx", None)
        if getattr(config, "is_heterogeneous", False) and isinstance(layer, int) and layer < config.num_hidden_layers:
            config = config.per_layer_config[layer]
        if type(module).__name__.endswith("Attention") and head_dim and hasattr(config, "num_attention_heads"):
            width += int(config.num_attention_heads) * int(head_dim)
    return width


def flops_per_token(
    target_params: int,
    target_attention: int,
    drafter_params: int,
    drafter_attention: int,
    seq_len: float,
    drafter_passes: int = 1,
    drafter_params_once: int = 0,
) -> dict[str, float]:
    """Model FLOPs per trained token of one training step (the numerator of MFU), as PaLM counts them
    (Chowdhery et al. 2022, appendix B), for a frozen target and a trained drafter:

        target forward    = 2 * N_t + 4 * A_t * T
        drafter fwd + bwd = 6 * N_once + passes * (6 * (N_d - N_once) + 12 * A_d * T)

    N_t: the target's matmul parameters, active ones for a mixture of experts (`matmul_parameters`: no
    embedding table, the lm_head counted); A_t: its attention width, sum over layers of query heads x head
    dim (`attention_width`); T: the row length the attention runs over (the whole row, as PaLM: the
    causal mask's skipped half and packed documents' blocks are counted, padding is not a token);
    N_d: the drafter's trainable matmul parameters, N_once those of them that run once per token
    whatever the passes; A_d its attention width; `passes`: draft forwards per token (both from the
    kind's `Drafter.flop_profile`: by default one pass, nothing apart).
    A forward costs 2 FLOPs per parameter per token (multiply and add), its backward twice that; the
    target runs no backward. Not counted: norms, activations, softmaxes, the loss, the optimizer.
    MFU = FLOPs per token x tokens/s / (peak FLOP/s x devices); the peak is the user's
    (`train.peak_tflops`: e.g. 989 for an H100 SXM's dense bf16 tensor cores), never guessed here."""
    target = 2.0 * target_params + 4.0 * target_attention * seq_len
    per_pass = 6.0 * (drafter_params - drafter_params_once) + 12.0 * drafter_attention * seq_len
    drafter = 6.0 * drafter_params_once + drafter_passes * per_pass
    return {"target_forward": target, "drafter_train": drafter, "total": target + drafter}


class FlopCounter:
    """`flops_per_token` for a run's target and drafter, counted once; `per_token(seq_len)` per log line."""

    def __init__(self, target: nn.Module, drafter: Drafter):
        profile = type(drafter).flop_profile(drafter.config)
        self.passes = profile.passes
        self.sizes = {
            "target_params": matmul_parameters(target),
            "target_attention": attention_width(target),
            "drafter_params": matmul_parameters(drafter, trainable_only=True),
            "drafter_attention": attention_width(drafter),
            # one pass: every parameter runs once, wherever the profile splits them
            "drafter_params_once": matmul_parameters(drafter, trainable_only=True, prefixes=profile.once)
            if self.passes > 1
            else 0,
        }

    def per_token(self, seq_len: float) -> dict[str, float]:
        return flops_per_token(**self.sizes, seq_len=seq_len, drafter_passes=self.passes)


def mfu(flops_per_token_total: float, tokens_per_s: float, peak_tflops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    return flops_per_token_total * tokens_per_s / (peak_tflops * 1e12 * devices)


def peak_memory_mb(device: torch.device | str) -> float:
    """The peak memory of this process, MiB: on a CUDA device what torch allocated there at most
    (torch.cuda.max_memory_allocated), elsewhere the process's maximum resident set (getrusage)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class StepProfiler:
    """`train.profile_steps=[first, last]`: torch.profiler over optimizer steps first..last (1-based, as
    log.jsonl numbers them), a Chrome trace (chrome://tracing, Perfetto, TensorBoard's profiler plugin)
    written to OUTPUT_DIR/profile/trace_rank{rank}_steps{first}-{last}.json when the last step ends, or
    when the run ends before it."""

    def __init__(self, steps: Optional[list[int]], output_dir: Path, rank: int):
        self.steps = tuple(steps) if steps else None
        self.output_dir, self.rank = Path(output_dir), rank
        self.profiler = None
        self.started: Optional[int] = None  # the step the profiler started before
        self.done = False

    def before_step(self, step: int) -> None:
        """Called before optimizer step `step` (1-based) runs."""
        if self.steps is None or self.done or self.profiler is not None:
            return
        first, last = self.steps
        if first <= step <= last:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.started = step
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False)
            self.profiler.__enter__()

    def after_step(self, step: int, final: bool = False) -> Optional[Path]:
        """Called after optimizer step `step`; writes the trace at the range's last step (or `final`)."""
        if self.profiler is None or not (final or step >= self.steps[1]):
            return None
        self.profiler.__exit__(None, None, None)
        directory = self.output_dir / "profile"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"trace_rank{self.rank}_steps{self.started}-{step}.json"
        self.profiler.export_chrome_trace(str(path))
        self.profiler, self.done = None, True
        log.info("profiler trace of steps %d-%d: %s", self.started, step, path)
        return path


def write_run_summary(
    accelerator,
    output_dir: Path,
    checksum: float,
    state: TrainerState,
    data_checksum: int,
    target,
    parameters: dict[str, int],
    ended: str,
) -> None:
    """Per-rank facts for checking a distributed run: identical weights (`checksum`: this rank's
    trainer/loop.py `finite_weights_checksum`), different data (`data_checksum`: the token ids this rank trained
    on since this process started, so a resumed run's covers the steps after its checkpoint only), and the bytes
    of target parameters each rank holds (all of them, or its pieces under target.shard=fsdp); `parameters`: the
    run's trainable and frozen parameter counts (`parameter_counts`); `ended`: why training ended (max_steps: every
    step it was given; patience: train.patience stopped it)."""
    mine = {
        "rank": accelerator.process_index,
        "param_checksum": checksum,
        "data_checksum": data_checksum,
        "target_param_bytes": local_bytes(target),
    }
    ranks = accelerator.gather_for_metrics([mine], use_gather_object=True)
    if accelerator.is_main_process:
        summary = {
            "world_size": accelerator.num_processes,
            "steps": state.step,
            "ended": ended,
            "ranks": ranks,
            "parameters": parameters,
        }
        write_text_atomic(output_dir / RUN_SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
