"""Sequence packing (`data.pack`) against padding: same data, same drafter, one run, as JSON.

    python benchmarks/packing.py [--recipes medusa,eagle3] [--steps 30,12] [--warmup 2] [--threads 2]
                                 [--pack-length N]

For each shipped demo recipe (its target, data, max_length, micro_batch_size, lr) the script draws
the micro-batches a training run reads (the trainer's `micro_batches`: the seeded order, each
`train.micro_batch_size` conversations) and collates each one both ways: padded (`Collator`, a row
per conversation) and packed (`PackingCollator`, rows of `--pack-length`, default data.max_length).
Two copies of the same fresh drafter (same seed, same prepared state) train side by side, one step
each on the same micro-batch in turn (alternating which goes first), so whatever else loads the
machine hits both alike. A step is
what the trainer's step does: the frozen target's forward, the drafter's loss, backward, gradient
clipping, AdamW.

Per way it reports real tokens/s (padding not counted), the padding fraction (padding positions /
all positions of the rows), rows and positions per step and the mean step time, after `--warmup`
untimed steps; then the speed-up and the largest relative difference between the two losses at any
step (the same data and initial weights: only float rounding, compounding over the steps); with them the
machine, threads, versions and wall time (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from names import names_of, shipped_recipes
from provenance import provenance


@dataclass(frozen=True)
class Rows:
    """The collator the trainer's `micro_batches` is given here: each micro-batch's conversations as drawn, which the
    script collates both ways (micro_batches gives its collator the run's seed for any draw: `draw_seed`)."""

    draw_seed: int = 0

    def __call__(self, rows: list) -> list:
        return rows


def bench(recipe: str, steps: int, warmup: int, pack_length: int | None) -> dict:
    from omegaconf import OmegaConf

    from draftsmith.data_prep.collate import Collator, PackingCollator
    from draftsmith.data_prep.dataset import load_tokenized
    from draftsmith.heads import drafter_class
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target, load_tokenizer, run_target
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import micro_batches

    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_recipe([f"recipe={recipe}", "data.pack=true", f"output_dir={scratch}/run"])
    tokenizer = load_tokenizer(cfg.target)
    data = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
    target = load_target(cfg.target)
    pack_length = pack_length or cfg.data.max_length
    ways = {"padded": Collator(tokenizer.pad_token_id), "packed": PackingCollator(tokenizer.pad_token_id, pack_length)}

    runs = {}
    for way in ways:
        torch.manual_seed(cfg.train.seed)
        drafter = drafter_class(cfg.drafter.type).from_target(
            OmegaConf.to_object(cfg.drafter), target, cfg.target.name_or_path
        )
        drafter.prepare(data)
        groups = [{"params": params, "lr": cfg.train.lr * scale} for params, scale in drafter.param_groups()]
        optimizer = torch.optim.AdamW(
            groups, lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay
        )
        runs[way] = {
            "drafter": drafter.train(),
            "optimizer": optimizer,
            "seconds": [],
            "losses": [],
            "tokens": 0,
            "positions": 0,
            "rows": 0,
        }

    def step(run: dict, batch: dict) -> tuple[float, float]:
        drafter, optimizer = run["drafter"], run["optimizer"]
        batch = batch | drafter.host_fields(batch)  # what its loss reads as host values, as the trainer adds them
        start = time.perf_counter()
        with torch.no_grad():
            target_out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
        loss, count, _ = drafter(batch, target_out)
        (loss / count.clamp(min=1)).backward()  # the per-token loss (heads/base.py)
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, float(loss.detach())

    stream = micro_batches(data, Rows(), cfg, 1, 0, TrainerState())
    for index in range(warmup + steps):
        _, _, rows = next(stream)
        for way in sorted(ways, reverse=index % 2 == 1):  # alternate which goes first
            batch, run = ways[way](rows), runs[way]
            seconds, loss = step(run, batch)
            run["losses"].append(loss)
            if index >= warmup:
                run["seconds"].append(seconds)
                run["tokens"] += int(batch["attention_mask"].sum())
                run["positions"] += batch["input_ids"].numel()
                run["rows"] += batch["input_ids"].shape[0]

    result = {
        "drafter": cfg.drafter.type,
        "data": list(cfg.data.train),
        "max_length": cfg.data.max_length,
        "pack_length": pack_length,
        "micro_batch_size": cfg.train.micro_batch_size,
        "timed_steps": steps,
    }
    for way, run in runs.items():
        seconds = sum(run["seconds"])
        result[way] = {
            "tokens_per_s": round(run["tokens"] / seconds, 1),
            "padding_fraction": round(1 - run["tokens"] / run["positions"], 4),
            "rows_per_step": round(run["rows"] / steps, 2),
            "positions_per_step": round(run["positions"] / steps, 1),
            "step_s": round(seconds / steps, 4),
            "step_s_median": round(statistics.median(run["seconds"]), 4),
        }
    result["real_tokens_per_step"] = round(runs["packed"]["tokens"] / steps, 1)
    result["speedup_tokens_per_s"] = round(result["packed"]["tokens_per_s"] / result["padded"]["tokens_per_s"], 3)
    result["max_rel_loss_difference"] = float(
        f"{max(abs(a - b) / abs(b) for a, b in zip(runs['packed']['losses'], runs['padded']['losses'])):.3g}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", type=names_of(shipped_recipes()), default="medusa,eagle3")
    parser.add_argument(
        "--steps", default="30,12", help="timed steps per recipe (one value for all, or one per recipe)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pack-length", type=int, default=None, help="default: each recipe's data.max_length")
    args = parser.parse_args()
    recipes = args.recipes
    steps = [int(s) for s in args.steps.split(",")]
    steps = steps * len(recipes) if len(steps) == 1 else steps
    if len(steps) != len(recipes):  # zip would drop the recipes past the last count, without a word
        parser.error(f"--steps {args.steps}: one count for all recipes, or one per recipe ({len(recipes)})")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results = [bench(recipe, count, args.warmup, args.pack_length) for recipe, count in zip(recipes, steps)]
    summary = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "recipes": results,
        **provenance(args.threads, start),
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
