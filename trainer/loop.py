"""The training loop, top to bottom: frozen target in, trained drafter out.

Runs unchanged under `python train.py`, `accelerate launch train.py` (DDP, FSDP, DeepSpeed) and
`torchrun train.py`. Each rank reads its own slice of a seeded per-epoch shuffle, so the data
position is two integers and resume is exact.

Nothing is lost: the output directory is locked and checked for an earlier run before anything is
written (trainer/checkpoint.py's `claim_output_dir`, on draftsmith/outputs.py's lock); SIGTERM (a
scheduler's preemption) stops the loop at the next step boundary with a checkpoint and exit code 75; a
non-finite loss or gradient skips the step, names where it first appeared, and stops the run after
`train.max_nonfinite` such steps.

The set-up the loop starts from (data, target, drafter, optimizer, resume): trainer/setup.py. Held-out
evaluation and the best checkpoint: trainer/heldout.py. Locating a non-finite value:
trainer/nonfinite.py. What is logged: trainer/step_log.py.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import DictConfig
from torch.profiler import record_function
from torch.utils.data import DataLoader

from draftsmith import compiled_layers
from draftsmith.errors import Preempted, StopRequest, TrainingDiverged
from draftsmith.heads.vocab_loss import compiled_chunk_math
from draftsmith.outputs import FINAL_DIR
from draftsmith.progress import progress_bar
from draftsmith.trainer.checkpoint import TrainerState, follows_training, save_checkpoint, save_final
from draftsmith.trainer.curve import write_curve
from draftsmith.trainer.heldout import BEST_DIR, curve_row, evaluate_heldout, keep_best, patience_spent
from draftsmith.trainer.nonfinite import report_nonfinite
from draftsmith.trainer.observe import FlopCounter, StepProfiler, parameter_counts, write_run_summary
from draftsmith.trainer.setup import Run, Trained, set_up
from draftsmith.trainer.step_log import Meters, log_interval, log_step

log = logging.getLogger("draftsmith.train")


def train(cfg: DictConfig) -> Trained:
    """Train the recipe's drafter; returns the final checkpoint directory (and the start's count the report
    reuses: `Trained`). The caller holds the output directory (`claim_output_dir`). Each pass of the loop is one
    `train_step`, then the periodic work: the log line, the held-out evaluation, the SIGTERM checkpoint, the
    periodic checkpoint."""
    output_dir = Path(cfg.output_dir)
    run = set_up(cfg, output_dir)
    accelerator, state, max_steps = run.accelerator, run.state, run.max_steps
    world, rank = accelerator.num_processes, accelerator.process_index
    stream = micro_batches(run.train_data, run.collate, cfg, world, rank, state)
    module = run.module
    # Observability (trainer/observe.py): parameter counts once, MFU and peak memory at log_every, the profiler
    parameters = parameter_counts(run.target, module)
    log.info("parameters: %s trainable, %s frozen", f"{parameters['trainable']:,}", f"{parameters['frozen']:,}")
    counts_row = {f"params/{k}": v for k, v in parameters.items()}  # in this run's first logged row
    flops, meters = FlopCounter(run.target, module), Meters(accelerator.device)
    if state.interval:  # resumed inside a log interval: its first line averages the whole interval
        meters.resume(state.interval, accelerator.is_main_process)
    profiler = StepProfiler(cfg.train.profile_steps, output_dir, rank)
    progress = progress_bar(total=max_steps, initial=state.step, desc="train", disable=not accelerator.is_main_process)
    stop = StopRequest("SIGTERM: saving a checkpoint at the end of this step, then stopping")
    data_checksum = 0  # the token ids this rank trained on (distributed checks)
    upcoming = next_step(stream, module, cfg.train.grad_accum)
    agreed = agree(accelerator, upcoming=upcoming)  # the first step's counts; later ones come with each step's
    run.drafter.train()
    with stop.on_sigterm():
        while state.step < max_steps and not patience_spent(state, cfg.train.patience):
            profiler.before_step(state.step + 1)
            done = train_step(run, upcoming, agreed, stream, stop)
            upcoming, agreed = done.upcoming, done.agreed
            meters.add(done)
            data_checksum += done.data.checksum
            progress.update(1)
            profiler.after_step(state.step)

            row = log_interval(run, meters, flops, progress) if due(state.step, cfg.train.log_every, max_steps) else {}
            row |= evaluate_if_due(run, output_dir)
            if row:
                log_step(accelerator, output_dir, state.step, {**row, **counts_row, "train/tokens": state.tokens})
                counts_row = {}
            if state.step < max_steps and agreed.stop:  # SIGTERM on any rank, agreed in this step's all-reduce
                preempted = checkpoint_on_sigterm(run, output_dir, meters)
                progress.close()
                del run  # see end_run
                end_run(accelerator)
                raise preempted
            save_if_due(run, output_dir, meters)
        stopping = agree(accelerator, stop=stop.requested).stop  # SIGTERM in the last step, or after its all-reduce
    progress.close()
    profiler.after_step(state.step, final=True)  # a range past the run's end: what was profiled
    trained = Trained(finish(run, output_dir, data_checksum, parameters, meters), run.prompt_count)
    del run  # see end_run
    end_run(accelerator)
    if stopping:  # once final/ is saved, before what follows training (the eval stage, a monitor's evaluation)
        raise Preempted(
            f"stopped on SIGTERM at the end of training (step {state.step} of {max_steps}): {trained.final} is written;"
            f" run the same command with train.resume=true to run what follows training ({follows_training(cfg)})"
        )
    return trained


@dataclass
class StepResult:
    """What `train_step` did: its micro-batches' host counts, all ranks' tokens of the step, the drafter's
    (sum, count) statistics summed over the micro-batches (device tensors), and what the next step starts
    from: its micro-batches, collated (None after the last step), and what the step's all-reduce agreed."""

    data: StepData
    tokens: int
    stats: dict[str, torch.Tensor]
    lr: float  # the learning rate the step trained at (the schedule's, read before it stepped: a host float)
    upcoming: StepData | None
    agreed: Agreed  # this step's non-finite flag and SIGTERM, the upcoming step's counts


def train_step(run: Run, step: StepData, agreed: Agreed, stream, stop: StopRequest) -> StepResult:
    """One optimizer step, as the loop takes it and benchmarks/train_throughput.py times it: each
    micro-batch's target forward, drafter forward and backward under `accelerator.accumulate`, then
    gradient clipping, the next step's micro-batches from `stream` (`next_step`), the step's one
    all-reduce (`agree`), the optimizer step (or the skip of a non-finite step), zero_grad and the
    schedule's step. `agreed`: what the previous step's all-reduce agreed (this step's counts).
    Advances `run.state` (step, tokens, data position, skipped steps).

    Split-invariant loss (heads/base.py, "The loss contract"): each micro-batch's backward is of its
    loss *sum* times `loss_scale`, so the step's gradient is d(sum of every token loss of the step,
    all micro-batches, all ranks) / d(params) / (the step's global loss_tokens), however the step is
    split. That count must be known before the step's first backward: each step's micro-batches are
    collated and counted on the host one step ahead, and the counts ride on the previous step's one
    all-reduce (`agree`), with the decisions every rank must share (non-finite, SIGTERM)."""
    cfg, accelerator, drafter, state = run.cfg, run.accelerator, run.drafter, run.state
    scale = loss_scale(accelerator, agreed.loss_tokens)
    run.module.optimizer_step = state.step
    step_loss = torch.zeros((), device=accelerator.device)
    stats: dict[str, torch.Tensor] = {}  # name -> (sum, count) over the step's micro-batches
    compiled = cfg.train.compile_vocab_loss, cfg.train.compile_drafter
    for epoch, batch_index, batch in step.batches:
        with accelerator.accumulate(drafter):
            batch, target_out, (loss, count, batch_stats) = forward_backward(
                accelerator, drafter, batch, run.target_features, scale, *compiled
            )
            step_loss += loss.detach().float()
            pairs = {"loss": torch.stack([loss.detach().float(), torch.as_tensor(count).to(step_loss)])}
            pairs |= {name: values.detach().float().sum(0) for name, values in batch_stats.items()}
            for name, pair in pairs.items():
                stats[name] = stats[name] + pair if name in stats else pair  # the first needs no zeros to add to
            if accelerator.sync_gradients:
                if not run.gradients_checked:
                    require_every_parameter_trained(run)
                with record_function("clip_grad_norm"):
                    grad_norm = clipped_norm(accelerator, drafter, cfg.train.max_grad_norm)
                upcoming = (
                    next_step(stream, run.module, cfg.train.grad_accum) if state.step + 1 < run.max_steps else None
                )
                agreement = agree(accelerator, not_finite(step_loss, grad_norm), stop.requested, upcoming)
                with record_function("optimizer_step"):
                    if agreement.nonfinite and accelerator.scaler is None:
                        state.skipped_steps += 1
                        report_nonfinite(accelerator, cfg, drafter, batch, target_out, loss, state)
                    else:  # an fp16 GradScaler skips non-finite steps itself and lowers its scale
                        run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        # the micro-batch's target features (a draft model's [B, T, V] logits too) not held through the next one's
        del batch, target_out, loss, batch_stats
        state.epoch, state.batch_in_epoch = epoch, batch_index + 1
    lr = run.scheduler.get_last_lr()[0]  # this step's lr: read before scheduler.step() moves on to the next's
    run.scheduler.step()
    state.step += 1
    state.tokens += agreed.tokens
    return StepResult(step, agreed.tokens, stats, lr, upcoming, agreement)


def require_every_parameter_trained(run: Run) -> None:
    """At this process's first step: a trainable parameter of the drafter that got no gradient takes part in no loss,
    which DDP refuses on a multi-process launch at its next step, after the run's start (minutes on a large target).
    The recipe checks refuse such settings (P-EAGLE at one training-time-test step was one): reaching here is a bug."""
    run.gradients_checked = True
    if run.accelerator.state.deepspeed_plugin is not None:  # its gradients live in its engine's buffers, not .grad
        return
    unused = [name for name, p in run.module.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise RuntimeError(f"the drafter's trainable parameters {', '.join(unused)} got no gradient: in no loss")


def due(step: int, every: int, last: int) -> bool:
    """Whether periodic work of period `every` runs after `step`: at its multiples and at the last step."""
    return step % every == 0 or step == last


def evaluate_if_due(run: Run, output_dir: Path) -> dict[str, float]:
    """Every train.eval_every steps and at the last: the held-out evaluation (trainer/heldout.py), its
    curve row and the best drafter so far; returns the log line's heldout/ metrics (none when not due)."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    if run.heldout is None or cfg.train.eval_every == 0 or not due(state.step, cfg.train.eval_every, run.max_steps):
        return {}
    measured = evaluate_heldout(accelerator, run.drafter, run.heldout, run.collate, run.target_features, cfg)
    samples_per_step = accelerator.num_processes * cfg.train.micro_batch_size * cfg.train.grad_accum
    state.curve.append(curve_row(state, measured, cfg, samples_per_step))
    if keep_best(accelerator, run.drafter, state, output_dir, measured):
        best = output_dir / BEST_DIR
        log.info("step %d: heldout tau_est %.4f, the best so far: %s", state.step, measured["tau_est"], best)
    if accelerator.is_main_process:
        write_curve(output_dir, state.curve, state.best, png=False)
    return {f"heldout/{k}": v for k, v in measured.items()}


def checkpoint_on_sigterm(run: Run, output_dir: Path, meters: Meters) -> Preempted:
    """The checkpoint of a run stopped by SIGTERM, and the error (exit 75) that says how to continue."""
    cfg, state = run.cfg, run.state
    finite_weights_checksum(run.accelerator, run.drafter, state)
    state.interval = meters.carried(run.accelerator)
    path = save_checkpoint(run.accelerator, run.drafter, state, output_dir, cfg.train.keep_checkpoints)
    return Preempted(
        f"stopped on SIGTERM after step {state.step} of {run.max_steps}; checkpoint {path}; "
        "run the same command with train.resume=true to continue"
    )


def save_if_due(run: Run, output_dir: Path, meters: Meters) -> None:
    """Every train.save_every steps but the last (whose checkpoint `finish` writes): a checkpoint, of finite
    weights only, so that train.keep_checkpoints never rotates the last finite one out."""
    cfg, state = run.cfg, run.state
    if cfg.train.save_every > 0 and state.step % cfg.train.save_every == 0 and state.step < run.max_steps:
        finite_weights_checksum(run.accelerator, run.drafter, state)
        state.interval = meters.carried(run.accelerator)
        save_checkpoint(run.accelerator, run.drafter, state, output_dir, cfg.train.keep_checkpoints)


def finish(run: Run, output_dir: Path, data_checksum: int, parameters: dict[str, int], meters: Meters) -> Path:
    """The end of a run that was not stopped: why it ended, the final checkpoint, the trained drafter in
    `final/` (returned), curve.json and run_summary.json."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
    checksum = finite_weights_checksum(accelerator, run.drafter, state)  # before anything of the run's end is saved
    if state.step and state.skipped_steps >= state.step:  # fewer than train.max_nonfinite, but no update ever made
        raise TrainingDiverged(
            f"every one of the run's {state.step} step(s) was skipped for a non-finite loss or gradient (the warnings "
            "above name where each appeared): no step updated the drafter, so no final/ was written; fix the input "
            "they name (a target or features whose values are not finite)"
        )
    ended = "max_steps" if state.step >= run.max_steps else "patience"
    if ended == "patience":
        log.info(
            "stopped at step %d of %d: %d held-out evaluations in a row without beating step %s's tau_est %.4f "
            "(train.patience); the best drafter is %s",
            state.step,
            run.max_steps,
            cfg.train.patience,
            state.best["step"] if state.best else None,
            state.best["tau_est"] if state.best else float("nan"),
            output_dir / BEST_DIR,
        )
    state.interval = meters.carried(accelerator)  # empty where the last step's log line closed it
    save_checkpoint(accelerator, run.drafter, state, output_dir, cfg.train.keep_checkpoints)
    final_dir = output_dir / FINAL_DIR
    save_final(accelerator, run.drafter, final_dir)
    if accelerator.is_main_process and state.curve:
        write_curve(output_dir, state.curve, state.best)
    write_run_summary(accelerator, output_dir, checksum, state, data_checksum, run.target, parameters, ended)
    accelerator.wait_for_everyone()
    return final_dir


def end_run(accelerator: Accelerator) -> None:
    """Trackers finished and the process group ended: nothing collective after this. The caller
    drops its own references to the wrapped drafter first. DDP's reducer holds the process group, so a
    wrapper that outlives `end_training` keeps the group to interpreter exit, where tearing gloo down
    can abort a finished rank with SIGABRT (seen once in ~12 CI runs: rank 1 of a 2-process CPU run,
    after its work, while rank 0 evaluated)."""
    accelerator.free_memory()  # the accelerator's references, then gc: the wrapper's hooks form cycles
    accelerator.end_training()


def micro_batches(dataset, collate, cfg: DictConfig, world: int, rank: int, state: TrainerState):
    """Yield (epoch, index in epoch, batch) forever, starting at the state's data position.

    Every rank draws the same seeded permutation and takes every world-th example, the epoch cut to whole
    optimizer steps of micro_batch_size x world x grad_accum conversations: step s trains conversations
    s·G .. (s+1)·G - 1 of the permutation however a step of G is split over ranks and accumulation, so a run
    resumes on another equal split where it stopped (trainer/setup.py). A batch is always `micro_batch_size`
    conversations; with `data.pack` the collator lays them into fewer rows.
    """
    micro = cfg.train.micro_batch_size
    per_rank = len(dataset) // (world * micro * cfg.train.grad_accum) * micro * cfg.train.grad_accum
    epoch, skip = state.epoch, state.batch_in_epoch
    while True:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.train.seed + epoch)).tolist()
        mine = order[rank::world][:per_rank]
        batches = [mine[i : i + micro] for i in range(0, per_rank, micro)][skip:]
        # Its own generator (worker seeds): a loader drawn from the global RNG would shift the drafter's
        # random streams by when the loop starts one, which differs between a resumed and a straight run.
        loader = DataLoader(
            dataset,
            batch_sampler=batches,
            collate_fn=replace(collate, draw_seed=cfg.train.seed),  # a drafter's draws (heads/packing.py)
            num_workers=cfg.train.num_workers,
            generator=torch.Generator().manual_seed(cfg.train.seed + epoch),
            pin_memory=torch.cuda.is_available(),  # the run is on CUDA where there is one (setup.py make_accelerator)
        )
        for offset, batch in enumerate(loader):
            yield epoch, skip + offset, batch
        epoch, skip = epoch + 1, 0


def forward_backward(
    accelerator,
    drafter,
    batch: dict,
    target_features,
    scale: float,
    compiled_loss: bool,
    compiled_drafter: bool = False,
):
    """One micro-batch, inside `accelerator.accumulate`: the batch to the device, the target's
    features, the drafter's (loss_sum, count, stats), and the backward of loss_sum x `scale`
    (`loss_scale`); `compiled_loss`: train.compile_vocab_loss, `compiled_drafter`: train.compile_drafter.
    Returns (the batch on the device, the target's features, the drafter's output)."""
    with record_function("target_forward"):  # ranges a profiler trace names (benchmarks/train_throughput.py)
        # pinned by the loader on CUDA (micro_batches), so the copy does not block the host
        batch = {k: v.to(accelerator.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.no_grad():
            target_out = target_features(batch)
    with record_function("drafter_forward_backward"):
        limits = compiled_layers.drafter_limits(compiled_drafter)
        with accelerator.autocast(), compiled_chunk_math(compiled_loss), limits:
            out = drafter(batch, target_out)
        accelerator.backward(out[0] * scale)
    return batch, target_out, out


@dataclass
class StepData:
    """One optimizer step's micro-batches of this rank, collated on the host, and what the loop counts
    of them there (no device sync): the loss's normaliser, tokens, positions and a checksum."""

    batches: list  # (epoch, index in epoch, batch) per micro-batch
    loss_tokens: int  # sum of the drafter's loss_tokens (heads/base.py)
    tokens: int  # attention-mask tokens
    positions: int  # tokens plus padding: what the forward pays for
    rows: int  # rows of the micro-batches (positions / rows: the row length the attention runs over)
    checksum: int  # sum of the token ids


def next_step(stream, drafter, grad_accum: int) -> StepData:
    """The next `grad_accum` micro-batches of `stream`, with the drafter's host fields (what its loss reads
    of a batch as host values), counted on the host. `drafter` is the unwrapped Drafter (its `host_fields`,
    `loss_tokens`)."""
    batches = [next(stream) for _ in range(grad_accum)]
    batches = [(epoch, index, batch | drafter.host_fields(batch)) for epoch, index, batch in batches]
    counted = [batch for _, _, batch in batches]
    return StepData(
        batches,
        loss_tokens=sum(int(drafter.loss_tokens(batch)) for batch in counted),
        tokens=sum(int(batch["attention_mask"].sum()) for batch in counted),
        positions=sum(batch["input_ids"].numel() for batch in counted),
        rows=sum(batch["input_ids"].shape[0] for batch in counted),
        checksum=sum(int(batch["input_ids"].sum()) for batch in counted),
    )


@dataclass
class Agreed:
    """What every rank knows after a step's all-reduce: whether the step was non-finite on any rank,
    whether any rank was asked to stop, and the next step's counts summed over ranks."""

    nonfinite: bool
    stop: bool
    loss_tokens: int
    tokens: int


def agree(accelerator, nonfinite=None, stop: bool = False, upcoming: StepData | None = None) -> Agreed:
    """One all-reduce (a sum over ranks) of the decisions every rank must share and the next step's
    host counts: this loop's one host sync a step. The drafters' loss code adds none: what a shape needs of
    the data is counted on the host with the batch (Drafter.host_fields, `next_step`; tests/test_no_host_sync.py),
    though a transformers model inside a loss (Medusa-2's, the draft model's) may read values to build its
    masks. `nonfinite`: this rank's flag, a device tensor (or None)."""
    device = accelerator.device
    counts = (upcoming.loss_tokens, upcoming.tokens) if upcoming is not None else (0, 0)
    host = torch.tensor([int(stop), *counts], dtype=torch.long)
    if device.type == "cuda":  # a copy from pageable memory waits for the stream: a second sync a step
        host = host.pin_memory()
    flag = torch.zeros(1, dtype=torch.long, device=device) if nonfinite is None else nonfinite.reshape(1).long()
    packed = torch.cat([flag, host.to(device, non_blocking=True)])
    if accelerator.num_processes > 1:
        packed = accelerator.reduce(packed, reduction="sum")
    bad, stopping, loss_tokens, tokens = packed.tolist()
    return Agreed(nonfinite=bad > 0, stop=stopping > 0, loss_tokens=loss_tokens, tokens=tokens)


def clipped_norm(accelerator, drafter, max_norm: float):
    """The step's gradients clipped to `max_norm`, and their norm before clipping (a device tensor; None where none
    was computed). DeepSpeed clips in its engine's step, within the step's last backward: its norm is read from the
    engine as it keeps it, where accelerate's reading of it waits for the device (`.item()`)."""
    if accelerator.state.deepspeed_plugin is not None:
        return accelerator.deepspeed_engine_wrapped.engine.get_global_grad_norm()
    return accelerator.clip_grad_norm_(drafter.parameters(), max_norm)


def not_finite(step_loss: torch.Tensor, grad_norm) -> torch.Tensor:
    """This rank's non-finite flag as a device tensor (no sync): the step's summed loss or the
    gradient norm (None, a float or a tensor under DeepSpeed)."""
    norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, device=step_loss.device, dtype=torch.float32)
    return ~(torch.isfinite(step_loss) & torch.isfinite(norm))


def loss_scale(accelerator, global_loss_tokens: int) -> float:
    """What a micro-batch's loss sum is multiplied by before `accelerator.backward`, so that the step's
    gradient is d(sum of the step's token losses over all micro-batches and ranks)/d(params) divided
    by the step's global count: accelerate divides each backward by grad_accum (DeepSpeed's engine
    does it itself) and DDP, DeepSpeed and FSDP average gradients over ranks, which this undoes."""
    return accelerator.gradient_accumulation_steps * accelerator.num_processes / max(global_loss_tokens, 1)


def finite_weights_checksum(accelerator, drafter, state: TrainerState) -> float:
    """This rank's sum of the drafter's weights (run_summary.json's `param_checksum`), taken before every
    checkpoint. Weights an update made non-finite (an update too large for float32 passes the step's finite loss
    and gradient, and every later step is skipped) stop the run as diverged on every rank, before a checkpoint
    (or final/) of them is written: the checkpoints kept hold finite weights."""
    module = accelerator.unwrap_model(drafter)
    # DeepSpeed ZeRO-3 leaves each parameter's local tensor empty and holds this rank's partition in `ds_tensor`:
    # its sum, where the empty one sums to 0 on every rank and passes weights of any value
    checksum = float(sum(getattr(p, "ds_tensor", p).detach().double().sum() for p in module.parameters()))
    if agree(accelerator, torch.tensor(not math.isfinite(checksum), device=accelerator.device)).nonfinite:
        raise TrainingDiverged(
            f"the drafter's weights are not finite after step {state.step} ({state.skipped_steps} step(s) skipped "
            "for a non-finite loss or gradient): no checkpoint of them was written; lower train.lr and run again "
            "(train.resume=true continues from the last checkpoint)"
        )
    return checksum
