"""A non-finite loss or gradient: where it first appeared (the target's outputs, a drafter module, the
loss, a gradient), logged with the batch's samples; the run stops after `train.max_nonfinite` skipped steps."""

from __future__ import annotations

import logging
import math

import torch
from omegaconf import DictConfig

from draftsmith import compiled_layers
from draftsmith.errors import TrainingDiverged
from draftsmith.heads.base import Drafter
from draftsmith.heads.vocab_loss import compiled_chunk_math
from draftsmith.target import TargetOutput
from draftsmith.trainer.checkpoint import TrainerState

log = logging.getLogger("draftsmith.train")


def report_nonfinite(
    accelerator,
    cfg: DictConfig,
    drafter,
    batch: dict,
    target_out: TargetOutput,
    loss: torch.Tensor,
    state: TrainerState,
) -> None:
    """Log where a non-finite loss or gradient first appeared, with the batch's samples; raise a
    TrainingDiverged (exit 4) once more than `train.max_nonfinite` steps have been skipped. Collective:
    every rank calls it."""
    with (  # the forward run again as training ran it: a bf16 overflow may not show in float32
        accelerator.autocast(),
        compiled_chunk_math(cfg.train.compile_vocab_loss),
        compiled_layers.drafter_limits(cfg.train.compile_drafter),
    ):
        where = locate_nonfinite(accelerator.unwrap_model(drafter), batch, target_out, loss)
    found = accelerator.gather_for_metrics(
        [{"rank": accelerator.process_index, "where": where, "samples": batch.get("sample", [])}],
        use_gather_object=True,
    )
    bad = [item for item in found if item["where"]] or found
    description = "; ".join(
        f"rank {item['rank']}: {item['where'] or 'non-finite gradient after reduction'} (samples "
        f"{', '.join(map(str, item['samples'][:8]))})"
        for item in bad
    )
    skipped = f"step skipped ({state.skipped_steps} so far)"
    message = f"non-finite loss or gradient at step {state.step + 1}, {skipped}: {description}"
    if state.skipped_steps > cfg.train.max_nonfinite:
        raise TrainingDiverged(
            f"stopping: more than train.max_nonfinite={cfg.train.max_nonfinite} steps skipped; last {message}"
        )
    log.warning(message)


@torch.no_grad()
def locate_nonfinite(drafter: Drafter, batch: dict, target_out: TargetOutput, loss: torch.Tensor) -> str:
    """The first place a NaN/inf shows: the target's outputs (or captured features), else the first
    drafter module whose output is non-finite when the forward is re-run, else the loss, else the
    first parameter with a non-finite gradient. Empty when this rank's side is finite. Every rank runs the forward,
    whatever its target's outputs: under ZeRO-3 it gathers each module's weights, collectives the ranks make in step."""
    inputs = {"target final hidden state": target_out.final, "target logits": target_out.logits}
    inputs |= {f"target layer {layer} hidden state": hidden for layer, hidden in target_out.layers.items()}
    in_target = [
        name
        for name, tensor in inputs.items()
        if tensor is not None
        and tensor.is_floating_point()
        and not torch.isfinite(tensor[batch["attention_mask"].bool()]).all()
    ]
    first: list[str] = []

    def hook(name):
        def check(module, args, output):
            tensors = output if isinstance(output, (tuple, list)) else (output,)
            if not first and any(
                torch.is_tensor(t) and t.is_floating_point() and not torch.isfinite(t).all() for t in tensors
            ):
                first.append(name)

        return check

    handles = [module.register_forward_hook(hook(name)) for name, module in drafter.named_modules() if name]
    try:
        drafter(batch, target_out)
    finally:
        for handle in handles:
            handle.remove()
    if in_target:
        return in_target[0]
    if first:
        return f"drafter module {first[0]}"
    if not math.isfinite(float(loss)):
        return "the loss"
    for name, parameter in drafter.named_parameters():
        if parameter.grad is not None and not torch.isfinite(parameter.grad).all():
            return f"gradient of {name}"
    return ""
