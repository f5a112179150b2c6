"""What the training loop (trainer/loop.py's `train`) starts from, built by `set_up`: accelerator, data,
target, drafter, optimizer, schedule and the resumed state, each input checked before anything is written.
Apart from the loop so the loop reads top to bottom; benchmarks/train_throughput.py builds its runs from
these same pieces.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf

from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.data_prep.dataset import load_tokenized, require_context
from draftsmith.data_prep.features import expected_features, open_features, require_captured_settings
from draftsmith.data_prep.local_files import source_files
from draftsmith.data_prep.overlap import PromptCount, eval_in_train, prompts_in_train, warn_of_prompts_in_train
from draftsmith.errors import OutOfMemory, UserError, one_line, out_of_memory
from draftsmith.eval.methods import EVAL_ONLY, serving
from draftsmith.eval.prompts import prompt_conversations, prompt_sources, render_prompts
from draftsmith.eval.report import check_eval_stage
from draftsmith.eval.target_checks import check_finite_logits, check_target
from draftsmith.families import largest_eval_batch
from draftsmith.formats.folder import load_warm_start, require_recipes_drafter, require_recipes_kind, start_kind
from draftsmith.heads import drafter_class
from draftsmith.heads.base import DRAFTER_DIR, architecture, check_same_target, saved_drafter
from draftsmith.heads.packing import causal_lm_inputs, require_packed_attention
from draftsmith.outputs import RECIPE_NAME
from draftsmith.recipe import check_chain, require_draft_vocab_use, save_recipe
from draftsmith.recipe_checks import resolve_bool_or_path
from draftsmith.sharding import built_whole
from draftsmith.streams import not_captured
from draftsmith.target import TargetOutput, TargetShape, load_target, load_tokenizer, run_target
from draftsmith.trainer.checkpoint import (
    TrainerState,
    keep_log_to,
    load_checkpoint,
    resplit,
    resume_checkpoint,
    saved_state,
    set_newer_checkpoints_aside,
)
from draftsmith.trainer.heldout import check_best_on_resume, split_heldout
from draftsmith.trainer.launcher import (
    make_accelerator,
    require_precision_as_begun,
    require_resumable_split,
    with_precision_used,
)
from draftsmith.trainer.optim import build_optimizer
from draftsmith.trainer.resume_checks import (
    record_data_content,
    require_resumed_as_begun,
    require_same_commit,
    require_trained_as_begun,
    resumed_start,
)

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
    # the start's count of the eval report's prompts in data.train, which the report after training reuses
    prompt_count: Optional[PromptCount] = None
    gradients_checked: bool = False  # the loop's require_every_parameter_trained, at this process's first step

    @cached_property
    def module(self) -> torch.nn.Module:
        """The Drafter itself, unwrapped once: accelerate's `unwrap_model` reads installed packages' metadata on
        every call (0.6 ms of the host's time with accelerate 1.16, twice a step in the loop: time a small target's
        step on a GPU waits for)."""
        return self.accelerator.unwrap_model(self.drafter)


class Trained(NamedTuple):
    """What `train` (trainer/loop.py) returns."""

    final: Path  # the final checkpoint directory
    prompt_count: Optional[PromptCount]  # Run.prompt_count


def set_up(cfg: DictConfig, output_dir: Path) -> Run:
    """Accelerator, data, target, drafter, optimizer, schedule and the resumed state, every input
    checked before anything is written; the loop reads them from the returned `Run`."""
    if cfg.eval.enabled:  # the eval stage after training: what it cannot run refused now, not after the run
        check_eval_stage(cfg)
    accelerator = make_accelerator(cfg, output_dir)
    given_precision = cfg.train.mixed_precision
    cfg = with_precision_used(cfg, accelerator)
    set_seed(cfg.train.seed)
    # train.resume: the checkpoint, verified against its checksums before anything is loaded or written
    resume_from = resume_checkpoint(output_dir, cfg.train.resume, accelerator)
    if resume_from is not None:  # the checkpoint holds the weights: the run's start is not loaded again
        cfg = resumed_start(cfg, output_dir)
        resumed_what = f"train.resume's {resume_from}"
        saved_kind, saved_config, saved_target, saved_file = saved_drafter(resume_from / DRAFTER_DIR)
        require_recipes_kind(saved_kind.type, cfg.drafter.type, resumed_what)  # said first
        require_resumed_as_begun(cfg, output_dir)
        require_trained_as_begun(saved_config, OmegaConf.to_object(cfg.drafter), resumed_what)
        require_precision_as_begun(cfg.train.mixed_precision, given_precision, output_dir)
        saved, split = saved_state(resume_from), split_of(cfg, accelerator)
        require_resumable_split(saved.split or split, split, accelerator.state.deepspeed_plugin is not None)
        resumed = resplit(saved, split)  # another step size: before any load
    elif cfg.train.init_from:  # its kind is known before any data or model loads
        start = Path(cfg.train.init_from)
        require_recipes_kind(start_kind(start), cfg.drafter.type, f"train.init_from={start}")
    tokenizer = load_tokenizer(cfg.target)
    # the data's settings that need no data read, refused before the target loads: a capture's rows are what trains
    # (a recipe whose data settings differ from data.features's), and no row may outrun the target's context
    if cfg.data.features is not None:
        require_captured_settings(cfg)
    require_context(cfg.target, cfg.data.max_length)
    require_local_sources(cfg)
    # the target before the data, which its load reads none of: one that cannot be a target (a wrapper whose language
    # model is proven on a few tokens not to compute its logits, weights that do not load) is refused before minutes
    # of tokenizing, and the cache is not written for it. Every rank loads it at once; rank 0 then
    # tokenizes (one process, on the host) beside it, as training holds both. target.shard=fsdp: each rank holds
    # pieces of the decoder layers (draftsmith/sharding.py); the loop needs nothing else, since every rank runs every
    # step's target forward together.
    target = load_target(cfg.target, accelerator.device, shard=cfg.target.shard)
    if resume_from is not None:  # the run's target: another of its shape would train on from the run's weights
        loaded = TargetShape.of(target, cfg.target.name_or_path)
        check_same_target(saved_target, loaded, resumed_what)
        require_same_commit(saved_target, loaded, resumed_what)
    if cfg.target.shard == "none":  # a target whose own forward fails or whose logits are not finite: bad input
        check_finite_logits(target)
        if cfg.eval.enabled:  # what the eval stage's loop cannot decode, refused now
            longest = int(cfg.data.max_length) + int(cfg.eval.max_new_tokens)  # a prompt of data.max_length, its answer
            check_target(target, tree=int(cfg.eval.tree) > 0, batch=largest_eval_batch(cfg.eval) > 1, length=longest)
    # the drafter, and the weights it starts from, before the data: a start of another shape (a warm start's, a
    # resumed checkpoint's), or a drafter the target cannot hold, is refused before minutes of tokenizing. No draw of
    # the RNG is between set_seed and this build, so its initial weights are as before.
    drafter = build_drafter(cfg, target, accelerator.device)
    if cfg.eval.enabled:  # the chain the eval stage asks, against the built drafter's (an MTP release's depth count)
        check_chain(cfg, type(drafter), drafter.config)
    if resume_from is not None:  # its weights must be of the drafter the recipe builds
        require_recipes_drafter(saved_kind.type, saved_config, drafter.type, drafter.config, resumed_what, resume_from)
        drafter.learned = dict(saved_file.get("learned") or {})
    elif cfg.train.init_from:  # warm start: a checkpoint, an export's folder or speculators'
        load_warm_start(cfg.train.init_from, drafter, target)
        for key in drafter.config.STARTS:
            if getattr(drafter.config, key) is not None:
                log.warning("drafter.%s is not read: train.init_from's weights are the start", key)
        log.info("warm start from %s", cfg.train.init_from)
    else:  # a kind's own released start (a draft model, a released assistant), said as a warm start is
        for key in drafter.config.STARTS:
            if getattr(drafter.config, key) is not None:
                log.info("starting from drafter.%s=%s", key, getattr(drafter.config, key))
    # each data file's sha256 as this start's load reads it, for its later reads (the prompts' count, the record)
    digests: dict[str, str] = {}
    train_data, vocab_data, heldout, prompt_count = load_data(cfg, accelerator, tokenizer, digests)
    train_data, collate, target_features = training_inputs(cfg, tokenizer, target, drafter, train_data)
    # what the drafter fits to the data (EAGLE-3's draft vocabulary), on every rank, at a fresh start: a resume's
    # checkpoint holds it and what it learned, a warm start keeps its start's (load_warm_start; fitted again, a
    # resumed warm start recorded the coverage of a vocabulary it never trained)
    if resume_from is None and not cfg.train.init_from:
        drafter.prepare(train_data, vocab_from=vocab_data)
    warn_if_no_engine_serves(cfg, drafter, target, accelerator.is_main_process)
    run = prepare_run(cfg, accelerator, target, drafter, train_data, collate, target_features, heldout)
    run.prompt_count = prompt_count
    if resume_from is not None:
        load_checkpoint(accelerator, resume_from)
        # accelerate restores its count of micro-batches and steps the optimizer at each multiple of grad_accum: a
        # count saved under another grad_accum (3 after 3 steps of grad_accum 1) can fall mid-step in this split
        # (grad_accum 2), and every later optimizer step would span two of the run's. This split's count at the step:
        accelerator.step = resumed.step * cfg.train.grad_accum
        run.state = resumed
        log.info("resumed from %s at step %d", resume_from, run.state.step)
        if run.state.step > run.max_steps:
            raise UserError(
                f"train.max_steps={run.max_steps} is below the step {run.state.step} the run resumes at: give a larger "
                f"train.max_steps to train on, or read {resume_from}'s drafter (eval, export: checkpoint=)"
            )
        check_best_on_resume(output_dir, run.state)
    resuming = resolve_bool_or_path(cfg.train.resume) is not None
    if accelerator.is_main_process:  # after the checkpoint loaded: a refused resume leaves the run's recipe as it was
        # the run begins here (or its first recipe.yaml here, resumed from a checkpoint given by path): what its
        # data reads, for its resumes to compare with; written first, so that no recipe.yaml is without its record
        if resume_from is None or not (output_dir / RECIPE_NAME).is_file():
            record_data_content(cfg, output_dir, digests)
        save_recipe(cfg, output_dir)
        if resume_from is not None:
            set_newer_checkpoints_aside(output_dir, resume_from)
        if resuming:
            keep_log_to(output_dir, run.state.step)
    accelerator.wait_for_everyone()
    # TensorBoard drops what an earlier attempt logged past the step the run resumes at (SummaryWriter's purge_step)
    accelerator.init_trackers("tb", init_kwargs={"tensorboard": {"purge_step": run.state.step + 1}} if resuming else {})
    return run


def require_local_sources(cfg: DictConfig) -> None:
    """Every data source `load_data` reads resolved to its files (local_files.source_files): a path that does not
    exist or a file of a suffix not read is one line before the target loads (minutes for a large one), not after."""
    settings = [cfg.data.draft_vocab, cfg.data.eval, prompt_sources(cfg)[0] if cfg.eval.enabled else None]
    if cfg.data.features is None:
        settings.append(cfg.data.train)
    for sources in settings:
        for source in [sources] if isinstance(sources, str) else sources or []:
            source_files(str(source))


def load_data(cfg: DictConfig, accelerator: Accelerator, tokenizer, digests: dict[str, str]):
    """(data.train tokenized, or None when training from captured features; data.draft_vocab tokenized, or
    None; the train.heldout conversations, or None; the main process's count of the eval report's prompts in
    data.train, or None). data.eval is read too, so that a bad file fails now. Each file's sha256 is added to
    `digests` as it is read, and not read again. data.features's settings are `set_up`'s to check, before the
    target loads."""
    offline = cfg.data.features is not None  # train from captured shards instead of running the target
    with accelerator.main_process_first():  # rank 0 tokenizes and caches, the others read the cache
        train_data = None if offline else load_tokenized(cfg, cfg.data.train, tokenizer, "data.train", digests)
        vocab_data = (
            load_tokenized(cfg, cfg.data.draft_vocab, tokenizer, "data.draft_vocab", digests)
            if cfg.data.draft_vocab
            else None
        )
        if cfg.data.eval:  # the eval stage reads it after training: a bad file must fail now, not then
            eval_split = load_tokenized(cfg, cfg.data.eval, tokenizer, "data.eval", digests)
            if train_data is not None:  # a capture's rows (data.features) carry no conversation digests
                eval_in_train(train_data, eval_split, cfg)
        sources, per_file = prompt_sources(cfg)
        prompt_count = None
        if cfg.eval.enabled and sources:  # the report's prompts: a bad file must fail now; trained-on ones are said
            chosen = prompt_conversations(sources, int(cfg.eval.max_prompts), cfg.data.skip_invalid_utf8, per_file)
            render_prompts(chosen, tokenizer, int(cfg.data.max_length))
            if accelerator.is_main_process and not offline:
                counted, prompt_count = prompts_in_train(chosen, cfg, digests=digests)
                warn_of_prompts_in_train(counted, sources, cfg)
    heldout = None  # train.heldout: the last conversations of data.train, in file order, never trained on
    if cfg.train.heldout > 0:
        train_data, heldout = split_heldout(
            train_data, cfg.train.heldout, accelerator.num_processes * cfg.train.micro_batch_size * cfg.train.grad_accum
        )
    return train_data, vocab_data, heldout, prompt_count


def build_drafter(cfg: DictConfig, target, device: torch.device):
    """The recipe's drafter for `target`, freshly initialised on `device`; one its settings make larger than the
    memory is OutOfMemory naming them (the generic line would advise a smaller step, and a resume of nothing)."""
    kind = drafter_class(cfg.drafter.type)
    try:
        with built_whole():  # whole under ZeRO-3 too: accelerator.prepare() partitions the drafter itself
            drafter = kind.from_target(OmegaConf.to_object(cfg.drafter), target, cfg.target.name_or_path)
    except Exception as err:  # noqa: BLE001 - memory exhausted is worded here, anything else raised as it was
        if not out_of_memory(err):
            raise
        # the counts of its architecture (not how it trains or decodes: SETTINGS); none named (a size its release's
        # layer fixes): the generic line
        sizes = architecture(OmegaConf.to_object(cfg.drafter))  # the recipe's section, a kind's Config
        counts = ", ".join(f"drafter.{key}={value}" for key, value in sizes.items() if type(value) is int and value > 1)
        if not counts:
            raise
        raise OutOfMemory(
            f"building the drafter ({one_line(err) or type(err).__name__}): its settings ({counts}) make a drafter "
            "larger than this machine's memory; choose smaller ones"
        ) from err
    drafter = drafter.to(device)  # out of memory here: the target took the device (the generic line's advice)
    if (untrainable := drafter.untrainable_on(device)) is not None:  # before the run writes anything
        raise UserError(untrainable)
    drafter.loss_chunk_bytes = cfg.train.vocab_chunk_mb << 20
    # again with the loaded target's shape (a Hub or GGUF target's is known only now)
    require_draft_vocab_use(cfg, drafter.config, drafter.target)
    return drafter


def warn_if_no_engine_serves(cfg: DictConfig, drafter, target, main_process: bool) -> None:
    """Said as training starts (by the main process), not after it: every engine the drafter's kind names would refuse
    to export it for this target (the eval's rows then say draftsmith's eval only), each engine's reason. It still
    trains, for draftsmith's eval; a kind that names no engine says nothing. Its exports' refusals alone, at T=0 (an
    engine drafting greedily still serves the folder at T=0)."""
    if not main_process:
        return
    said = serving(drafter, target, cfg.export.vllm_format, 0.0, int(cfg.eval.num_speculative_tokens))
    # no method served, and one an engine would have served but refuses (trees no engine serves say no reason)
    if all(row["served_by"] == EVAL_ONLY for row in said.values()) and any("not_served_by" in r for r in said.values()):
        reasons = {engine: why for row in said.values() for engine, why in row.get("not_served_by", {}).items()}
        log.warning(
            "no engine serves this drafter as it will train (its export refuses it): %s",
            "; ".join(f"{engine}: {why}" for engine, why in reasons.items()),
        )


def training_inputs(cfg: DictConfig, tokenizer, target, drafter, train_data):
    """(what the loop draws micro-batches from, the collator, a batch -> the target's features): the
    tokenized conversations and the target run on each batch, or with data.features the captured store."""
    request = drafter.request
    pack = packing_collator(cfg, tokenizer, target)
    if cfg.data.features is None:
        features = online_features(target, request, cfg.train.compile_target)
        return train_data, pack or Collator(tokenizer.pad_token_id), features
    if request.streams:
        raise not_captured(cfg.drafter.type, "data.features")
    store = open_features(cfg.data.features, expect=expected_features(drafter.target, request))
    longest = max(store.lengths())  # captured under the capture's data.max_length, which may be longer
    if pack is not None and longest > pack.pack_length:
        raise UserError(
            f"{cfg.data.features} holds a conversation of {longest} tokens, "
            f"more than data.pack_length={pack.pack_length}; raise it"
        )
    return store, pack or Collator(tokenizer.pad_token_id), store.to_target_output


def online_features(target, request, compiled: bool = False) -> Callable[[dict], TargetOutput]:
    """A batch -> the frozen target's features the drafter's `request` names, from its forward on the batch; with
    `compiled` (train.compile_target) its decoder layers compiled (draftsmith/compiled_layers.py)."""
    if not compiled:
        return lambda batch: run_target(target, batch["input_ids"], request=request, **causal_lm_inputs(batch))
    from draftsmith import compiled_layers

    log.info("the target's %d decoder layers compiled (train.compile_target)", compiled_layers.compile_layers(target))

    def target_features(batch: dict) -> TargetOutput:
        with compiled_layers.limits():
            return run_target(target, batch["input_ids"], request=request, **causal_lm_inputs(batch))

    return target_features


def optimization(cfg: DictConfig, accelerator: Accelerator, drafter, conversations: int):
    """(optimizer, learning-rate schedule, optimizer steps of the run) for `conversations` training
    conversations: train.max_steps, or train.epochs epochs of full steps."""
    optimizer = build_optimizer(cfg.train, drafter, deepspeed=accelerator.state.deepspeed_plugin is not None)
    world, micro, accumulated = accelerator.num_processes, cfg.train.micro_batch_size, cfg.train.grad_accum
    step = world * micro * accumulated
    steps_per_epoch = conversations // step  # an epoch is whole steps (micro_batches)
    if steps_per_epoch == 0:
        raise UserError(
            f"{conversations} training conversations cannot fill one step of {world} process(es) "
            f"x micro_batch_size {micro} x grad_accum {accumulated}"
        )
    max_steps = cfg.train.max_steps
    if max_steps < 0:
        max_steps = cfg.train.epochs * steps_per_epoch
    if conversations % step and max_steps >= steps_per_epoch:  # the reshuffled order leaves out others each epoch
        log.info(
            "an epoch is %d steps of %d conversations: %d of the %d training conversations are left out of each one",
            steps_per_epoch,
            step,
            conversations % step,
            conversations,
        )
    if cfg.train.warmup_steps >= max_steps:  # a short run of a recipe's warm-up: said, as it trains below train.lr
        log.warning(
            "train.warmup_steps=%d is not shorter than the run's %d steps: it never trains at train.lr=%g (it ends at "
            "%.0f%% of it); set train.warmup_steps below %d for the schedule to reach it",
            cfg.train.warmup_steps,
            max_steps,
            cfg.train.lr,
            100 * (max_steps - 1) / max(1, cfg.train.warmup_steps),
            max_steps,
        )
    rate = partial(cosine_with_warmup, warmup_steps=cfg.train.warmup_steps, total_steps=max_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, rate), max_steps


def cosine_with_warmup(step: int, *, warmup_steps: int, total_steps: int) -> float:
    """The fraction of train.lr that optimizer step `step` (from 0) trains at: linear warm-up from 0 over
    `warmup_steps`, then half a cosine down to 0 at `total_steps`. transformers' get_cosine_schedule_with_warmup to
    the float (as HF Trainer's), written here because importing it imports transformers.trainer_utils and with it
    peft, seconds of every start; a partial of it, as there, so a checkpoint's scheduler state is the same."""
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def prepare_run(
    cfg: DictConfig, accelerator: Accelerator, target, drafter, train_data, collate, target_features, heldout=None
) -> Run:
    """The Run of `drafter` at step 0: its optimizer and schedule over `train_data` (`optimization`), and
    the three wrapped by `accelerator.prepare` for the run's backend."""
    optimizer, scheduler, max_steps = optimization(cfg, accelerator, drafter, len(train_data))
    if cfg.train.compile_drafter:  # before any wrapper holds the drafter
        from draftsmith import compiled_layers

        compiled_layers.compile_drafter(drafter, accelerator.state.deepspeed_plugin)
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    data = (train_data, collate, target_features, heldout)
    state = TrainerState(split=split_of(cfg, accelerator))
    return Run(cfg, accelerator, target, drafter, optimizer, scheduler, *data, max_steps, state)


def split_of(cfg: DictConfig, accelerator: Accelerator) -> dict[str, int]:
    """How this launch splits a step (TrainerState.split)."""
    return {
        "processes": accelerator.num_processes,
        "micro_batch_size": int(cfg.train.micro_batch_size),
        "grad_accum": int(cfg.train.grad_accum),
    }


def packing_collator(cfg: DictConfig, tokenizer, target) -> PackingCollator | None:
    """`data.pack`: the collator that packs each micro-batch's conversations into rows, once the
    target is known to keep packed documents apart (heads/packing.py); None when off."""
    if not cfg.data.pack:
        return None
    require_packed_attention(target, f"the target {cfg.target.name_or_path}")
    return PackingCollator(tokenizer.pad_token_id, cfg.data.pack_length or cfg.data.max_length)
