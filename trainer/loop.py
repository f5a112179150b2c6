"""The training loop, top to bottom: frozen target in, trained drafter out.

Runs unchanged under `python train.py`, `accelerate launch train.py` (DDP, FSDP, DeepSpeed) and
`torchrun train.py`. Each rank reads its own slice of a seeded per-epoch shuffle, so the data
position is two integers and resume is exact.
"""
from __future__ import annotations

import json
import logging
import math
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_cosine_schedule_with_warmup

from data_prep import Collator, load_conversations, tokenize_conversations
from data_prep.features import FeatureCollator, expected_features, open_features
from draftsmith.errors import UserError
from draftsmith.recipe import resolve_bool_or_path, save_recipe
from draftsmith.target import load_target, load_tokenizer, run_target
from heads import Drafter, drafter_class
from trainer.checkpoint import TrainerState, find_resume_checkpoint, load_checkpoint, save_checkpoint, save_drafter

log = logging.getLogger("draftsmith.train")


def train(cfg: DictConfig) -> Path:
    output_dir = Path(cfg.output_dir)
    accelerator = Accelerator(
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
    set_seed(cfg.train.seed)

    # -- data, target, drafter (inputs are checked before anything is written) -----------------
    tokenizer = load_tokenizer(cfg.target.name_or_path, cfg.target.revision, cfg.target.trust_remote_code)
    offline = cfg.data.features is not None  # train from captured shards instead of running the target
    with accelerator.main_process_first():  # rank 0 tokenizes and caches, the others read the cache
        train_data = None if offline else tokenized(cfg, cfg.data.train, tokenizer, "data.train")
        eval_data = tokenized(cfg, cfg.data.eval, tokenizer, "data.eval") if cfg.data.eval else None
    collate = Collator(tokenizer.pad_token_id)
    target = load_target(
        cfg.target.name_or_path, cfg.target.revision, cfg.target.dtype, accelerator.device, cfg.target.trust_remote_code
    )

    drafter_cls = drafter_class(cfg.drafter.type)
    drafter_config = OmegaConf.to_object(cfg.drafter)
    drafter = drafter_cls.from_target(drafter_config, target, cfg.target.name_or_path).to(accelerator.device)
    if offline:
        store = open_features(
            cfg.data.features, expect=expected_features(target, cfg.target.name_or_path, drafter.features)
        )
        train_data, train_collate, target_features = store, FeatureCollator(tokenizer.pad_token_id), store.to_target_output
    else:
        request = drafter.features
        train_collate = collate

        def target_features(batch: dict):
            return run_target(target, batch["input_ids"], batch["attention_mask"], request)
    drafter.prepare(train_data)  # what the drafter fits to the data (EAGLE-3's draft vocabulary), on every rank
    groups = [{"params": params, "lr": cfg.train.lr * scale} for params, scale in drafter.param_groups()]
    optimizer = torch.optim.AdamW(groups, lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay)

    world, rank, micro = accelerator.num_processes, accelerator.process_index, cfg.train.micro_batch_size
    batches_per_epoch = len(train_data) // (world * micro)
    if batches_per_epoch == 0:
        raise UserError(
            f"{len(train_data)} training conversations cannot fill one step of {world} process(es) x micro_batch_size {micro}"
        )
    max_steps = cfg.train.max_steps
    if max_steps < 0:
        max_steps = max(1, cfg.train.epochs * batches_per_epoch // cfg.train.grad_accum)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.train.warmup_steps, max_steps)
    drafter, optimizer, scheduler = accelerator.prepare(drafter, optimizer, scheduler)
    if accelerator.is_main_process:
        save_recipe(cfg, output_dir)

    state = TrainerState()
    resume_from = find_resume_checkpoint(output_dir, resolve_bool_or_path(cfg.train.resume))
    if resume_from is not None:
        state = load_checkpoint(accelerator, resume_from)
        log.info("resumed from %s at step %d", resume_from, state.step)
    elif accelerator.is_main_process:
        clear_earlier_run(output_dir)
    accelerator.wait_for_everyone()
    accelerator.init_trackers("tb")

    # -- the loop -------------------------------------------------------------------------------
    stream = micro_batches(train_data, train_collate, cfg, world, rank, state)
    progress = tqdm(total=max_steps, initial=state.step, desc="train", disable=not accelerator.is_main_process)
    interval_stats: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(2, device=accelerator.device))
    interval_tokens, interval_start = 0, time.perf_counter()
    data_checksum = 0  # fingerprint of the token ids this rank trained on (for distributed checks)
    drafter.train()
    while state.step < max_steps:
        for _ in range(cfg.train.grad_accum):
            epoch, batch_index, batch = next(stream)
            batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with accelerator.accumulate(drafter):
                with torch.no_grad():
                    target_out = target_features(batch)
                with accelerator.autocast():
                    loss, stats = drafter(batch, target_out)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(drafter.parameters(), cfg.train.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            interval_stats["loss"] += torch.stack([loss.detach().float(), torch.ones((), device=loss.device)])
            for name, values in stats.items():
                interval_stats[name] += values.sum(0)
            interval_tokens += int(batch["attention_mask"].sum())
            data_checksum += int(batch["input_ids"].sum())
            state.epoch, state.batch_in_epoch = epoch, batch_index + 1
        scheduler.step()
        state.step += 1
        progress.update(1)

        if state.step % cfg.train.log_every == 0 or state.step == max_steps:
            elapsed = time.perf_counter() - interval_start
            metrics = reduce_means(accelerator, interval_stats)
            metrics["lr"] = scheduler.get_last_lr()[0]
            metrics["tokens_per_s"] = interval_tokens * world / max(elapsed, 1e-9)
            log_step(accelerator, output_dir, state.step, {f"train/{k}": v for k, v in metrics.items()})
            progress.set_postfix(loss=f"{metrics['loss']:.3f}")
            interval_stats.clear()
            interval_tokens, interval_start = 0, time.perf_counter()
        if cfg.train.save_every > 0 and state.step % cfg.train.save_every == 0 and state.step < max_steps:
            save_checkpoint(accelerator, drafter, state, output_dir, cfg.train.keep_checkpoints)
    progress.close()

    # -- the end: final checkpoint, per-domain accuracy, speculative eval ------------------------
    save_checkpoint(accelerator, drafter, state, output_dir, cfg.train.keep_checkpoints)
    final_dir = output_dir / "final"
    if eval_data is not None:
        untrained = drafter_cls.from_target(OmegaConf.to_object(cfg.drafter), target, cfg.target.name_or_path)
        untrained.prepare(train_data)
        table = {
            "trained": evaluate_split(accelerator, drafter, target, eval_data, collate, cfg),
            "untrained": evaluate_split(accelerator, untrained.to(accelerator.device), target, eval_data, collate, cfg),
        }
        accelerator.unwrap_model(drafter).calibrate(table["trained"]["all"])
        log_step(accelerator, output_dir, state.step, {f"eval/{k}": v for k, v in table["trained"]["all"].items()})
        if accelerator.is_main_process:
            (output_dir / "eval_accuracy.json").write_text(json.dumps(table, indent=2) + "\n")
            print(accuracy_table(table))
    save_drafter(accelerator, drafter, final_dir)
    write_run_summary(accelerator, output_dir, drafter, state, data_checksum)

    if cfg.eval.enabled and accelerator.is_main_process:
        from eval.report import render_markdown, run_eval  # eval never imports trainer; the reverse is fine

        print(render_markdown(run_eval(cfg, drafter_path=final_dir, target=target, tokenizer=tokenizer)))
    accelerator.wait_for_everyone()
    accelerator.end_training()  # also ends the process group: nothing collective after this
    return final_dir


def clear_earlier_run(output_dir: Path) -> None:
    """A new run (no train.resume) in the directory of an earlier one starts clean: its checkpoints
    would be resumed or pruned as if they were this run's, and its log rows mixed with this run's."""
    stale = [output_dir / name for name in ("checkpoints", "log.jsonl", "tb") if (output_dir / name).exists()]
    if stale:
        log.warning("new run in %s: removing the earlier run's %s (train.resume=true continues a run instead)",
                    output_dir, ", ".join(p.name for p in stale))
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


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


def tokenized(cfg: DictConfig, sources, tokenizer, key: str):
    if not sources:
        raise UserError(f"{key} is empty: give at least one conversation file or Hub data set id")
    conversations = load_conversations(list(sources), cfg.data.max_conversations)
    return tokenize_conversations(conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.cache_dir)


def micro_batches(dataset, collate, cfg: DictConfig, world: int, rank: int, state: TrainerState):
    """Yield (epoch, index in epoch, batch) forever, starting at the state's data position.

    Every rank draws the same seeded permutation and takes every world-th example, cut so all
    ranks have the same number of batches (DDP needs them in lockstep).
    """
    micro = cfg.train.micro_batch_size
    per_rank = len(dataset) // (world * micro) * micro
    epoch, skip = state.epoch, state.batch_in_epoch
    while True:
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(cfg.train.seed + epoch)).tolist()
        mine = order[rank::world][:per_rank]
        batches = [mine[i : i + micro] for i in range(0, per_rank, micro)][skip:]
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=collate, num_workers=cfg.train.num_workers)
        for offset, batch in enumerate(loader):
            yield epoch, skip + offset, batch
        epoch, skip = epoch + 1, 0


def reduce_means(accelerator, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum (total, count) pairs over ranks, then divide: a token-weighted mean over all ranks."""
    if not stats:
        return {}
    names = sorted(stats)
    totals = accelerator.reduce(torch.stack([stats[n] for n in names]), reduction="sum")
    return {n: float(t[0] / t[1].clamp(min=1)) for n, t in zip(names, totals)}


@torch.no_grad()
def evaluate_split(accelerator, drafter, target, dataset, collate, cfg: DictConfig) -> dict[str, dict[str, float]]:
    """Per-domain means of the drafter's metrics on the eval split (each rank takes a slice)."""
    module: Drafter = accelerator.unwrap_model(drafter)
    was_training = module.training
    module.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    indices = list(range(rank, len(dataset), world))
    batches = [indices[i : i + cfg.train.micro_batch_size] for i in range(0, len(indices), cfg.train.micro_batch_size)]
    per_domain: dict[str, dict[str, torch.Tensor]] = defaultdict(lambda: defaultdict(lambda: torch.zeros(2)))
    for batch in DataLoader(dataset, batch_sampler=batches, collate_fn=collate):
        tensors = {k: v.to(accelerator.device) for k, v in batch.items() if torch.is_tensor(v)}
        target_out = run_target(target, tensors["input_ids"], tensors["attention_mask"], module.features)
        with accelerator.autocast():
            _, stats = module(tensors, target_out)
        for name, values in stats.items():
            for row, domain in enumerate(batch["domain"]):
                per_domain[domain][name] += values[row].float().cpu()
                per_domain["all"][name] += values[row].float().cpu()
    module.train(was_training)
    gathered = accelerator.gather_for_metrics([{d: dict(s) for d, s in per_domain.items()}], use_gather_object=True)
    merged: dict[str, dict[str, torch.Tensor]] = defaultdict(lambda: defaultdict(lambda: torch.zeros(2)))
    for part in gathered:
        for domain, stats in part.items():
            for name, pair in stats.items():
                merged[domain][name] += pair
    return {d: {n: float(p[0] / p[1].clamp(min=1)) for n, p in sorted(s.items())} for d, s in sorted(merged.items())}


def accuracy_table(table: dict) -> str:
    """Markdown: per domain, every top-1 metric (`head2/top1`, `step1/top1`, ...) of the drafter on
    the eval split, untrained vs trained."""
    trained, untrained = table["trained"], table["untrained"]

    def natural(name: str) -> list:  # head2 before head10
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]

    names = sorted((n for n in trained["all"] if n.endswith("/top1")), key=natural)
    header = "| domain | " + " | ".join(f"{n.removesuffix('/top1')} top-1 (untrained → trained)" for n in names) + " |"
    lines = [header, "|" + "---|" * (len(names) + 1)]
    for domain in trained:
        cells = [f"{untrained[domain][n]:.3f} → {trained[domain][n]:.3f}" for n in names]
        lines.append(f"| {domain} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def log_step(accelerator, output_dir: Path, step: int, metrics: dict[str, float]) -> None:
    """TensorBoard scalars plus one JSON line per logged step (log.jsonl), from the main process."""
    accelerator.log(metrics, step=step)
    if accelerator.is_main_process:
        with open(output_dir / "log.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **{k: round(v, 6) for k, v in metrics.items()}}) + "\n")


def write_run_summary(accelerator, output_dir: Path, drafter, state: TrainerState, data_checksum: int) -> None:
    """Per-rank facts for checking a distributed run: identical weights, different data."""
    module = accelerator.unwrap_model(drafter)
    checksum = float(sum(p.detach().double().sum() for p in module.parameters()))
    ranks = accelerator.gather_for_metrics(
        [{"rank": accelerator.process_index, "param_checksum": checksum, "data_checksum": data_checksum}], use_gather_object=True
    )
    if accelerator.is_main_process:
        summary = {"world_size": accelerator.num_processes, "steps": state.step, "ranks": ranks}
        (output_dir / "run_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if not math.isfinite(checksum):
            raise RuntimeError("drafter weights are not finite after training")
