"""The training loop, top to bottom: frozen target in, trained drafter out.

Runs unchanged under `python train.py`, `accelerate launch train.py` (DDP, FSDP, DeepSpeed) and
`torchrun train.py`. Each rank reads its own slice of a seeded per-epoch shuffle, so the data
position is two integers and resume is exact.

Nothing is lost: the output directory is locked and checked for an earlier run before anything is
written (trainer/checkpoint.py's `claim_output_dir`, on draftsmith/outputs.py's lock); SIGTERM (a
scheduler's preemption) stops the loop at the next step boundary with a checkpoint and exit code 75; a
non-finite loss or gradient skips the step, names where it first appeared, and stops the run after
`train.max_nonfinite` such steps.

Held-out evaluation and the best checkpoint: trainer/heldout.py. Locating a non-finite value:
trainer/nonfinite.py.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from torch.profiler import record_function
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from draftsmith.data_prep import Collator, PackingCollator, load_tokenized
from draftsmith.data_prep.features import FeatureCollator, expected_features, open_features
from draftsmith.errors import Preempted, StopRequest, UserError
from draftsmith.families import check_eval_settings
from draftsmith.formats.folder import warm_start
from draftsmith.heads import drafter_class
from draftsmith.heads.packing import causal_lm_inputs, require_packed_attention
from draftsmith.recipe import derived, require_draft_vocab_use, save_recipe
from draftsmith.sharding import built_whole, local_bytes
from draftsmith.target import TargetOutput, load_config, load_target, load_tokenizer, run_target
from draftsmith.trainer.checkpoint import TrainerState, load_checkpoint, resume_checkpoint, save_checkpoint, save_final
from draftsmith.trainer.curve import write_curve
from draftsmith.trainer.heldout import (
    BEST_DIR,
    check_best_on_resume,
    curve_row,
    evaluate_heldout,
    keep_best,
    patience_spent,
    reduce_means,
    split_heldout,
)
from draftsmith.trainer.nonfinite import report_nonfinite
from draftsmith.trainer.observe import FlopCounter, StepProfiler, mfu, parameter_counts, peak_memory_mb
from draftsmith.trainer.optim import build_optimizer

log = logging.getLogger("draftsmith.train")


@dataclass
class Run:
    """What the loop works with, built and checked by `set_up` before the first step (`prepare_run`
    assembles it from its parts)."""

    cfg: DictConfig
    accelerator: Accelerator
    target: torch.nn.Module
    drafter: torch.nn.Module  # the Drafter, wrapped by accelerate (DDP, FSDP, DeepSpeed)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_data: Any  # tokenized conversations, or a store of captured features
    collate: Callable[[list], dict]
    target_features: Callable[[dict], TargetOutput]  # a batch -> the target's features the loss reads
    heldout: Any  # train.heldout conversations never trained on, or None
    max_steps: int
    state: TrainerState  # fresh, or the resumed checkpoint's


def train(cfg: DictConfig) -> Path:
    """Train the recipe's drafter; returns the final checkpoint directory. The caller holds the
    output directory (`claim_output_dir`). Each pass of the loop is one `train_step`, then the periodic
    work: the log line, the held-out evaluation, the SIGTERM checkpoint, the periodic checkpoint."""
    output_dir = Path(cfg.output_dir)
    run = set_up(cfg, output_dir)
    accelerator, state, max_steps = run.accelerator, run.state, run.max_steps
    world, rank = accelerator.num_processes, accelerator.process_index
    stream = micro_batches(run.train_data, run.collate, cfg, world, rank, state)
    module = accelerator.unwrap_model(run.drafter)
    # Observability (trainer/observe.py): parameter counts once, MFU and peak memory at log_every, the profiler
    parameters = parameter_counts(run.target, module)
    log.info("parameters: %s trainable, %s frozen", f"{parameters['trainable']:,}", f"{parameters['frozen']:,}")
    counts_row = {f"params/{k}": v for k, v in parameters.items()}  # in this run's first logged row
    flops, meters = FlopCounter(run.target, module), Meters(accelerator.device)
    profiler = StepProfiler(cfg.train.profile_steps, output_dir, rank)
    progress = tqdm(total=max_steps, initial=state.step, desc="train", disable=not accelerator.is_main_process)
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
                preempted = checkpoint_on_sigterm(run, output_dir)
                progress.close()
                del run  # see end_run
                end_run(accelerator)
                raise preempted
            save_if_due(run, output_dir)
    progress.close()
    profiler.after_step(state.step, final=True)  # a range past the run's end: what was profiled
    final_dir = finish(run, output_dir, data_checksum, parameters)
    del run  # see end_run
    end_run(accelerator)
    return final_dir


@dataclass
class StepResult:
    """What `train_step` did: its micro-batches' host counts, all ranks' tokens of the step, the drafter's
    (sum, count) statistics summed over the micro-batches (device tensors), and what the next step starts
    from: its micro-batches, collated (None after the last step), and what the step's all-reduce agreed."""

    data: StepData
    tokens: int
    stats: dict[str, torch.Tensor]
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
    step_loss = torch.zeros((), device=accelerator.device)
    stats: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(2, device=accelerator.device))
    for epoch, batch_index, batch in step.batches:
        with accelerator.accumulate(drafter):
            batch, target_out, (loss, count, batch_stats) = forward_backward(
                accelerator, drafter, batch, run.target_features, scale
            )
            step_loss += loss.detach().float()
            stats["loss"] += torch.stack([loss.detach().float(), torch.as_tensor(count).to(step_loss)])
            for name, values in batch_stats.items():
                stats[name] += values.detach().float().sum(0)
            if accelerator.sync_gradients:
                with record_function("clip_grad_norm"):
                    grad_norm = accelerator.clip_grad_norm_(drafter.parameters(), cfg.train.max_grad_norm)
                module = accelerator.unwrap_model(drafter)
                upcoming = next_step(stream, module, cfg.train.grad_accum) if state.step + 1 < run.max_steps else None
                agreement = agree(accelerator, not_finite(step_loss, grad_norm), stop.requested, upcoming)
                with record_function("optimizer_step"):
                    if agreement.nonfinite and accelerator.scaler is None:
                        state.skipped_steps += 1
                        report_nonfinite(accelerator, cfg, drafter, batch, target_out, loss, state)
                    else:  # an fp16 GradScaler skips non-finite steps itself and lowers its scale
                        run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        state.epoch, state.batch_in_epoch = epoch, batch_index + 1
    run.scheduler.step()
    state.step += 1
    state.tokens += agreed.tokens
    return StepResult(step, agreed.tokens, stats, upcoming, agreement)


class Meters:
    """What the loop sums between two log lines: the drafter's (sum, count) statistics of the steps that
    were not skipped, this rank's tokens, positions (tokens plus padding) and rows, all ranks' tokens, and
    when the interval began."""

    def __init__(self, device: torch.device):
        self.stats: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(2, device=device))
        self.reset()

    def reset(self) -> None:
        self.stats.clear()
        self.tokens, self.positions, self.global_tokens, self.rows = 0, 0, 0, 0
        self.start = time.perf_counter()

    def add(self, done: StepResult) -> None:
        if not done.agreed.nonfinite:
            for name, values in done.stats.items():
                self.stats[name] += values
        self.tokens += done.data.tokens
        self.positions += done.data.positions
        self.global_tokens += done.tokens
        self.rows += done.data.rows


def due(step: int, every: int, last: int) -> bool:
    """Whether periodic work of period `every` runs after `step`: at its multiples and at the last step."""
    return step % every == 0 or step == last


def log_interval(run: Run, meters: Meters, flops: FlopCounter, progress) -> dict[str, float]:
    """The log line's train/ metrics over the interval since the last one (statistics averaged over ranks,
    throughput, padding, MFU, peak memory); starts the next interval."""
    cfg, accelerator = run.cfg, run.accelerator
    elapsed = time.perf_counter() - meters.start
    metrics = reduce_means(accelerator, meters.stats)
    metrics["lr"] = run.scheduler.get_last_lr()[0]
    metrics["tokens_per_s"] = meters.global_tokens / max(elapsed, 1e-9)
    metrics["padding_fraction"] = 1 - meters.tokens / max(meters.positions, 1)  # this rank's
    metrics["skipped_steps"] = run.state.skipped_steps
    per_token = flops.per_token(meters.positions / max(meters.rows, 1))["total"]
    metrics["model_tflops_per_s"] = per_token * metrics["tokens_per_s"] / 1e12  # all ranks together
    if cfg.train.peak_tflops:
        metrics["mfu"] = mfu(per_token, metrics["tokens_per_s"], cfg.train.peak_tflops, accelerator.num_processes)
    metrics["peak_memory_mb"] = peak_memory_mb(accelerator.device)  # this rank's
    if "loss" in metrics:
        progress.set_postfix(loss=f"{metrics['loss']:.3f}")
    meters.reset()
    return {f"train/{k}": v for k, v in metrics.items()}


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


def resumed_start(cfg: DictConfig, output_dir: Path) -> DictConfig:
    """A resumed run keeps the start it began from (its recipe.yaml's train.init_from), and the
    recipe.yaml it writes again names that start: the resumed weights are the checkpoint's, so another
    train.init_from is not read, and says so (the monitor's retraining may name its start anew)."""
    saved = output_dir / "recipe.yaml"
    began = OmegaConf.load(saved).train.get("init_from") if saved.is_file() else None
    if cfg.train.init_from and str(cfg.train.init_from) != str(began):
        log.warning(
            "train.init_from=%s is not read: this run began from %s (its recipe.yaml) and resumes from its checkpoint",
            cfg.train.init_from,
            began or "scratch",
        )
    return derived(cfg, {"train.init_from": began}) if str(cfg.train.init_from) != str(began) else cfg


def checkpoint_on_sigterm(run: Run, output_dir: Path) -> Preempted:
    """The checkpoint of a run stopped by SIGTERM, and the error (exit 75) that says how to continue."""
    cfg, state = run.cfg, run.state
    path = save_checkpoint(run.accelerator, run.drafter, state, output_dir, cfg.train.keep_checkpoints)
    return Preempted(
        f"stopped on SIGTERM after step {state.step} of {run.max_steps}; checkpoint {path}; "
        "run the same command with train.resume=true to continue"
    )


def save_if_due(run: Run, output_dir: Path) -> None:
    """Every train.save_every steps but the last (whose checkpoint `finish` writes): a checkpoint."""
    cfg, state = run.cfg, run.state
    if cfg.train.save_every > 0 and state.step % cfg.train.save_every == 0 and state.step < run.max_steps:
        save_checkpoint(run.accelerator, run.drafter, state, output_dir, cfg.train.keep_checkpoints)


def finish(run: Run, output_dir: Path, data_checksum: int, parameters: dict[str, int]) -> Path:
    """The end of a run that was not stopped: why it ended, the final checkpoint, the trained drafter in
    `final/` (returned), curve.json and run_summary.json."""
    cfg, accelerator, state = run.cfg, run.accelerator, run.state
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
    save_checkpoint(accelerator, run.drafter, state, output_dir, cfg.train.keep_checkpoints)
    final_dir = output_dir / "final"
    save_final(accelerator, run.drafter, final_dir)
    if accelerator.is_main_process and state.curve:
        write_curve(output_dir, state.curve, state.best)
    write_run_summary(accelerator, output_dir, run.drafter, state, data_checksum, run.target, parameters, ended)
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


def set_up(cfg: DictConfig, output_dir: Path) -> Run:
    """Accelerator, data, target, drafter, optimizer, schedule and the resumed state, every input
    checked before anything is written; the loop reads them from the returned `Run`."""
    if cfg.eval.enabled:  # the eval stage after training: settings it cannot run refused now, not after the run
        check_eval_settings(load_config(cfg.target), cfg.eval)
    accelerator = make_accelerator(cfg, output_dir)
    set_seed(cfg.train.seed)
    # train.resume: the checkpoint, verified against its checksums before anything is loaded or written
    resume_from = resume_checkpoint(output_dir, cfg.train.resume, accelerator)
    tokenizer = load_tokenizer(cfg.target)
    train_data, vocab_data, heldout = load_data(cfg, accelerator, tokenizer)
    # target.shard=fsdp: each rank holds pieces of the decoder layers (draftsmith/sharding.py); the
    # loop needs nothing else, since every rank runs every step's target forward together.
    target = load_target(cfg.target, accelerator.device, shard=cfg.target.shard)
    drafter = build_drafter(cfg, target, accelerator.device)
    train_data, collate, target_features = training_inputs(cfg, tokenizer, target, drafter, train_data)
    # what the drafter fits to the data (EAGLE-3's draft vocabulary), on every rank
    drafter.prepare(train_data if vocab_data is None else vocab_data)
    if resume_from is not None:  # the checkpoint holds the weights: the run's start is not loaded again
        cfg = resumed_start(cfg, output_dir)
    elif cfg.train.init_from:  # warm start: its weights and data-fitted state (draft vocabulary kept, not re-fitted)
        start = warm_start(cfg.train.init_from, drafter, target)  # a checkpoint, an export's folder or speculators'
        drafter.load_state_dict(start.state_dict())
        drafter.learned = dict(start.learned)
        log.info("warm start from %s", cfg.train.init_from)
    run = prepare_run(cfg, accelerator, target, drafter, train_data, collate, target_features, heldout)
    if accelerator.is_main_process:
        save_recipe(cfg, output_dir)
    if resume_from is not None:
        run.state = load_checkpoint(accelerator, resume_from)
        log.info("resumed from %s at step %d", resume_from, run.state.step)
        check_best_on_resume(output_dir, run.state)
    accelerator.wait_for_everyone()
    accelerator.init_trackers("tb")
    return run


def make_accelerator(cfg: DictConfig, output_dir: Path) -> Accelerator:
    """The run's Accelerator: train.grad_accum, train.mixed_precision, TensorBoard under the output directory."""
    return Accelerator(
        gradient_accumulation_steps=cfg.train.grad_accum,
        mixed_precision=mixed_precision(cfg.train.mixed_precision),
        log_with="tensorboard",
        project_dir=str(output_dir),
        # The schedule counts optimizer steps; we step it ourselves once per optimizer step.
        step_scheduler_with_optimizer=False,
        # Without a GPU, accelerate only forms a process group (gloo) when told the run is on CPU;
        # this makes `torchrun`/`accelerate launch --multi_gpu` with N processes real DDP on CPU.
        cpu=not torch.cuda.is_available(),
    )


def load_data(cfg: DictConfig, accelerator: Accelerator, tokenizer):
    """(data.train tokenized, or None when training from captured features; data.draft_vocab tokenized, or
    None; the train.heldout conversations, or None). data.eval is read too, so that a bad file fails now."""
    offline = cfg.data.features is not None  # train from captured shards instead of running the target
    with accelerator.main_process_first():  # rank 0 tokenizes and caches, the others read the cache
        train_data = None if offline else load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
        vocab_data = (
            load_tokenized(cfg, cfg.data.draft_vocab, tokenizer, "data.draft_vocab") if cfg.data.draft_vocab else None
        )
        if cfg.data.eval:  # the eval stage reads it after training: a bad file must fail now, not then
            load_tokenized(cfg, cfg.data.eval, tokenizer, "data.eval")
    heldout = None  # train.heldout: the last conversations of data.train, in file order, never trained on
    if cfg.train.heldout > 0:
        train_data, heldout = split_heldout(
            train_data, cfg.train.heldout, accelerator.num_processes * cfg.train.micro_batch_size
        )
    return train_data, vocab_data, heldout


def build_drafter(cfg: DictConfig, target, device: torch.device):
    """The recipe's drafter for `target`, freshly initialised on `device`."""
    with built_whole():  # whole under ZeRO-3 too: accelerator.prepare() partitions the drafter itself
        drafter = drafter_class(cfg.drafter.type).from_target(
            OmegaConf.to_object(cfg.drafter), target, cfg.target.name_or_path
        )
    drafter = drafter.to(device)
    drafter.loss_chunk_bytes = cfg.train.vocab_chunk_mb << 20
    # again with the loaded target's shape (a Hub or GGUF target's is known only now)
    require_draft_vocab_use(cfg, drafter.config, drafter.target)
    return drafter


def training_inputs(cfg: DictConfig, tokenizer, target, drafter, train_data):
    """(what the loop draws micro-batches from, the collator, a batch -> the target's features): the
    tokenized conversations and the target run on each batch, or with data.features the captured store."""
    request = drafter.request
    pack = packing_collator(cfg, tokenizer, target)
    if cfg.data.features is None:
        return train_data, pack or Collator(tokenizer.pad_token_id), online_features(target, request)
    store = open_features(cfg.data.features, expect=expected_features(drafter.target, request))
    longest = max(store.lengths())  # captured under the capture's data.max_length, which may be longer
    if pack is not None and longest > pack.pack_length:
        raise UserError(
            f"{cfg.data.features} holds a conversation of {longest} tokens, "
            f"more than data.pack_length={pack.pack_length}; raise it"
        )
    return store, pack or FeatureCollator(tokenizer.pad_token_id), store.to_target_output


def online_features(target, request) -> Callable[[dict], TargetOutput]:
    """A batch -> the frozen target's features the drafter's `request` names, from its forward on the batch."""

    def target_features(batch: dict) -> TargetOutput:
        return run_target(target, batch["input_ids"], request=request, **causal_lm_inputs(batch))

    return target_features


def optimization(cfg: DictConfig, accelerator: Accelerator, drafter, conversations: int):
    """(optimizer, learning-rate schedule, optimizer steps of the run) for `conversations` training
    conversations: train.max_steps, or train.epochs epochs of full steps."""
    optimizer = build_optimizer(cfg.train, drafter, deepspeed=accelerator.state.deepspeed_plugin is not None)
    world, micro = accelerator.num_processes, cfg.train.micro_batch_size
    batches_per_epoch = conversations // (world * micro)
    if batches_per_epoch == 0:
        raise UserError(
            f"{conversations} training conversations cannot fill one step of {world} process(es) "
            f"x micro_batch_size {micro}"
        )
    max_steps = cfg.train.max_steps
    if max_steps < 0:
        max_steps = max(1, cfg.train.epochs * batches_per_epoch // cfg.train.grad_accum)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, cfg.train.warmup_steps, max_steps), max_steps


def prepare_run(
    cfg: DictConfig, accelerator: Accelerator, target, drafter, train_data, collate, target_features, heldout=None
) -> Run:
    """The Run of `drafter` at step 0: its optimizer and schedule over `train_data` (`optimization`), and
    the three wrapped by `accelerator.prepare` for the run's backend."""
    optimizer, scheduler, max_steps = optimization(cfg, accelerator, drafter, len(train_data))
    if accelerator.state.deepspeed_plugin is not None:
        # DeepSpeed wants its micro-batch size up front; accelerate reads it off a prepared DataLoader,
        # and ours is not prepared (each rank streams its own micro-batches): without this, prepare() fails
        accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = (
            cfg.train.micro_batch_size
        )
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    return Run(
        cfg,
        accelerator,
        target,
        drafter,
        optimizer,
        scheduler,
        train_data,
        collate,
        target_features,
        heldout,
        max_steps,
        TrainerState(),
    )


def mixed_precision(setting: str):
    """`auto`: whatever `accelerate launch` was told, else bf16 on a GPU that has it, else none."""
    import os

    if setting != "auto":
        return setting
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return None
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def packing_collator(cfg: DictConfig, tokenizer, target) -> PackingCollator | None:
    """`data.pack`: the collator that packs each micro-batch's conversations into rows, once the
    target is known to keep packed documents apart (heads/packing.py); None when off."""
    if not cfg.data.pack:
        return None
    require_packed_attention(target, f"the target {cfg.target.name_or_path}")
    return PackingCollator(tokenizer.pad_token_id, cfg.data.pack_length or cfg.data.max_length)


def micro_batches(dataset, collate, cfg: DictConfig, world: int, rank: int, state: TrainerState):
    """Yield (epoch, index in epoch, batch) forever, starting at the state's data position.

    Every rank draws the same seeded permutation and takes every world-th example, cut so all
    ranks have the same number of batches (DDP needs them in lockstep). A batch is always
    `micro_batch_size` conversations; with `data.pack` the collator lays them into fewer rows.
    """
    micro = cfg.train.micro_batch_size
    per_rank = len(dataset) // (world * micro) * micro
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
            collate_fn=collate,
            num_workers=cfg.train.num_workers,
            generator=torch.Generator().manual_seed(cfg.train.seed + epoch),
            pin_memory=torch.cuda.is_available(),  # the trainer runs on CUDA where there is one (make_accelerator)
        )
        for offset, batch in enumerate(loader):
            yield epoch, skip + offset, batch
        epoch, skip = epoch + 1, 0


def forward_backward(accelerator, drafter, batch: dict, target_features, scale: float):
    """One micro-batch, inside `accelerator.accumulate`: the batch to the device, the target's
    features, the drafter's (loss_sum, count, stats), and the backward of loss_sum x `scale`
    (`loss_scale`). Returns (the batch on the device, the target's features, the drafter's output)."""
    with record_function("target_forward"):  # ranges a profiler trace names (benchmarks/train_throughput.py)
        # pinned by the loader on CUDA (micro_batches), so the copy does not block the host
        batch = {k: v.to(accelerator.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        with torch.no_grad():
            target_out = target_features(batch)
    with record_function("drafter_forward_backward"):
        with accelerator.autocast():
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
    """The next `grad_accum` micro-batches of `stream`, counted on the host. `drafter` is the unwrapped
    Drafter (its `loss_tokens`)."""
    batches = [next(stream) for _ in range(grad_accum)]
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
    host counts, and the step's one host sync. `nonfinite`: this rank's flag, a device tensor (or None)."""
    device = accelerator.device
    counts = (upcoming.loss_tokens, upcoming.tokens) if upcoming is not None else (0, 0)
    host = torch.tensor([int(stop), *counts], dtype=torch.long)
    flag = torch.zeros(1, dtype=torch.long, device=device) if nonfinite is None else nonfinite.reshape(1).long()
    packed = torch.cat([flag, host.to(device)])
    if accelerator.num_processes > 1:
        packed = accelerator.reduce(packed, reduction="sum")
    bad, stopping, loss_tokens, tokens = packed.tolist()
    return Agreed(nonfinite=bad > 0, stop=stopping > 0, loss_tokens=loss_tokens, tokens=tokens)


def not_finite(step_loss: torch.Tensor, grad_norm) -> torch.Tensor:
    """This rank's non-finite flag as a device tensor (no sync): the step's summed loss or the
    gradient norm (None or a float under DeepSpeed)."""
    norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, device=step_loss.device, dtype=torch.float32)
    return ~(torch.isfinite(step_loss) & torch.isfinite(norm))


def loss_scale(accelerator, global_loss_tokens: int) -> float:
    """What a micro-batch's loss sum is multiplied by before `accelerator.backward`, so that the step's
    gradient is d(sum of the step's token losses over all micro-batches and ranks)/d(params) divided
    by the step's global count: accelerate divides each backward by grad_accum (DeepSpeed's engine
    does it itself) and DDP, DeepSpeed and FSDP average gradients over ranks, which this undoes."""
    return accelerator.gradient_accumulation_steps * accelerator.num_processes / max(global_loss_tokens, 1)


def log_step(accelerator, output_dir: Path, step: int, metrics: dict[str, float]) -> None:
    """TensorBoard scalars plus one JSON line per logged step (log.jsonl), from the main process."""
    accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        with open(output_dir / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in metrics.items()}}) + "\n")


def write_run_summary(
    accelerator,
    output_dir: Path,
    drafter,
    state: TrainerState,
    data_checksum: int,
    target,
    parameters: dict[str, int],
    ended: str,
) -> None:
    """Per-rank facts for checking a distributed run: identical weights, different data, and the
    bytes of target parameters each rank holds (all of them, or its pieces under target.shard=fsdp);
    `parameters`: the run's trainable and frozen parameter counts (trainer/observe.py); `ended`: why
    training ended (max_steps: every step it was given; patience: train.patience stopped it)."""
    module = accelerator.unwrap_model(drafter)
    checksum = float(sum(p.detach().double().sum() for p in module.parameters()))
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
        (output_dir / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not math.isfinite(checksum):
            raise RuntimeError("drafter weights are not finite after training")
