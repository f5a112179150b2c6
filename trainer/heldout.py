"""Held-out evaluation (`train.heldout`, `train.eval_every`): the last `train.heldout` conversations of
the tokenized data.train are set aside before anything is shuffled and never trained on (nor fitted
to: `prepare` sees only the training part). Every `eval_every` optimizer steps and at the last step the
drafter runs over them in eval mode, as in training (same collator, same target features), and its
per-depth teacher-forced top-1 a_1..a_g (g = eval.num_speculative_tokens, or fewer if the drafter
reports fewer depths) gives `heldout/tau_est` = 1 + sum_k prod_{i<=k} a_i. Logged as `heldout/<stat>`
beside `train/tokens` (training tokens so far, all ranks). The evaluation with the highest tau_est so
far is kept in `<output_dir>/best/`: the drafter in `final/`'s format plus `best.json` (step, tokens,
tau_est, the held-out metrics), replaced in one rename. `curve.json` (one row per evaluation, with the
training tokens and conversations seen; updated at each) and `curve.png` (at the end) plot tau_est and
top-1 against training tokens (trainer/curve.py).
The best evaluation and the curve live in the trainer state, so a resumed run continues them exactly.
`train.patience` stops training on measured acceptance: after that many evaluations in a row without a
new best (an EAGLE-3 drafter's acceptance can peak within a few epochs and fall after).
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from draftsmith import compiled_layers
from draftsmith.data_prep.dataset import split_heldout_rows
from draftsmith.errors import UserError
from draftsmith.files import read_json
from draftsmith.heads import drafter_class
from draftsmith.heads.base import pair_means
from draftsmith.trainer.checkpoint import TrainerState, save_final
from draftsmith.trainer.curve import chain_tau, depth_top1

log = logging.getLogger("draftsmith.train")

BEST_DIR, BEST_JSON = "best", "best.json"  # <output_dir>/best/: the drafter of the best held-out evaluation


def reduce_means(accelerator, stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum (total, count) pairs over ranks, then divide: a token-weighted mean over all ranks."""
    if not stats:
        return {}
    names = sorted(stats)
    totals = accelerator.reduce(torch.stack([stats[n] for n in names]), reduction="sum")
    return pair_means(dict(zip(names, totals)))


def split_heldout(dataset, count: int, step_size: int):
    """(training part, held-out part) of the tokenized data.train: the rows of its last `count` conversations, in
    file order (train.heldout, `split_heldout_rows`). The training part must still fill one step (`step_size`
    rows)."""
    train, heldout = split_heldout_rows(dataset, count)
    if len(train) < step_size:
        raise UserError(
            f"train.heldout={count} leaves {len(train)} of the {len(dataset)} data.train rows for training, fewer "
            f"than one step of {step_size} (processes x train.micro_batch_size x train.grad_accum); lower train.heldout"
        )
    return train, heldout


@torch.no_grad()
def evaluate_heldout(accelerator, drafter, heldout, collate, target_features, cfg: DictConfig) -> dict[str, float]:
    """The drafter's own statistics (its loss's (sum, count) pairs, and `loss`: its loss sums over its
    loss_tokens, as training logs it, heads/base.py "The loss contract") over the held-out conversations
    in eval mode: token-weighted means over all ranks, however they fall into batches, plus `tau_est`.

    Each rank takes every world-th conversation in micro-batches of train.micro_batch_size, and every
    rank runs the same number of forwards (a rank out of data runs one more batch and counts it with
    weight 0), so a collective target forward (target.shard=fsdp) or wrapper stays in step. Randomness
    (DFlash's anchors) is each conversation's own, seeded with train.seed (heads/packing.py
    conversation_rand): each evaluation draws the same however the conversations fall to ranks, and in a
    forked RNG any other draw leaves training's streams untouched, so a run trains the same with or without
    them."""
    world, rank, micro = accelerator.num_processes, accelerator.process_index, cfg.train.micro_batch_size
    mine = list(range(len(heldout)))[rank::world]
    rounds = math.ceil(math.ceil(len(heldout) / world) / micro)
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(2, device=accelerator.device))
    held_out_collate = replace(collate, draw_seed=cfg.train.seed)
    module = accelerator.unwrap_model(drafter)  # its host fields (heads/base.py `host_fields`)
    was_training = drafter.training
    drafter.eval()
    try:
        with torch.random.fork_rng(devices=[accelerator.device] if accelerator.device.type == "cuda" else []):
            torch.manual_seed(cfg.train.seed)
            for i in range(rounds):
                indices = mine[i * micro : (i + 1) * micro]
                weight = 1.0 if indices else 0.0
                batch = held_out_collate([heldout[j] for j in (indices or [0])])
                batch |= module.host_fields(batch)
                batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}
                target_out = target_features(batch)
                with accelerator.autocast(), compiled_layers.drafter_limits(cfg.train.compile_drafter):
                    loss, count, stats = drafter(batch, target_out)
                sums["loss"] += weight * torch.stack([loss.float(), torch.as_tensor(count).to(loss.device).float()])
                for name, values in stats.items():
                    sums[name] += weight * values.float().sum(0)
    finally:
        drafter.train(was_training)
    metrics = reduce_means(accelerator, sums)
    # Teacher-forced estimate of tokens per target forward of a greedy chain: depth i's top-1 (scored
    # with the true earlier tokens as context) stands in for the conditional acceptance of depth i
    # given depths < i were accepted. DFlash's block{i}/top1 is not even conditioned that way.
    metrics["tau_est"] = chain_tau([value for _, value in run_top1(metrics, cfg)])
    return metrics


def run_top1(metrics: dict[str, float], cfg: DictConfig) -> list[tuple[str, float]]:
    """The run's kind's per-depth top-1 in `metrics`, depth 1 first, as far as eval.num_speculative_tokens."""
    return depth_top1(metrics, cfg.eval.num_speculative_tokens, drafter_class(cfg.drafter.type).DEPTH_TOP1)


def curve_row(state: TrainerState, measured: dict[str, float], cfg: DictConfig, samples_per_step: int) -> dict:
    """One row of curve.json: step, tokens, samples (conversations trained on, all ranks: every
    micro-batch holds train.micro_batch_size of them), tau_est and the run's kind's per-depth top-1
    (name -> value, depth 1 first, as far as eval.num_speculative_tokens)."""
    top1 = dict(run_top1(measured, cfg))
    samples = state.step * samples_per_step
    return {
        "step": state.step,
        "tokens": state.tokens,
        "samples": samples,
        "tau_est": measured["tau_est"],
        "top1": top1,
    }


def keep_best(accelerator, drafter, state: TrainerState, output_dir: Path, measured: dict[str, float]) -> bool:
    """When `measured["tau_est"]` is higher than every earlier held-out evaluation of the run, record
    it in `state.best` and write `<output_dir>/best/` (the drafter in `final/`'s format, plus best.json
    holding state.best) in one rename; returns whether it did. Collective (the weights are gathered
    from shards under ZeRO-3/FSDP): every rank calls it with the same (reduced) metrics."""
    tau = measured["tau_est"]
    if not math.isfinite(tau) or (state.best is not None and tau <= state.best["tau_est"]):
        return False
    state.best = {
        "step": state.step,
        "tokens": state.tokens,
        "tau_est": tau,
        "metrics": {f"heldout/{k}": v for k, v in measured.items()},
    }
    save_final(accelerator, drafter, output_dir / BEST_DIR, files={BEST_JSON: json.dumps(state.best, indent=2) + "\n"})
    return True


def evaluations_since_best(state: TrainerState) -> int:
    """Held-out evaluations after the best one (all of them while none was finite): read from the
    state's curve, so a resumed run counts on exactly where it stopped."""
    best_step = -1 if state.best is None else state.best["step"]
    return sum(1 for row in state.curve if row["step"] > best_step)


def patience_spent(state: TrainerState, patience: int) -> bool:
    """train.patience: `patience` evaluations in a row have not beaten the best tau_est. Every rank
    decides alike from the same reduced metrics, so stopping needs no collective of its own."""
    return patience > 0 and evaluations_since_best(state) >= patience


def check_best_on_resume(output_dir: Path, state: TrainerState) -> None:
    """best/ written after the checkpoint a run resumes from belongs to steps the run replays: warn
    that it stands until the replay evaluates better than the checkpoint's best (on a deterministic
    device the replay reaches the same evaluation and rewrites it)."""
    path = output_dir / BEST_DIR / BEST_JSON
    if not path.is_file():
        return
    on_disk, kept = read_json(path, "best checkpoint record").get("step"), (state.best or {}).get("step")
    if on_disk != kept:
        log.warning(
            "%s is from step %s, after this checkpoint (whose best is step %s); replaced when the run evaluates better",
            path.parent,
            on_disk,
            kept,
        )
