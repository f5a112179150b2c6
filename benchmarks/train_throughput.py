"""Training throughput of a drafter against its real target (default: EAGLE-3 for SmolLM2-135M-Instruct),
full training steps as the trainer runs them, as JSON.

    python benchmarks/train_throughput.py [--recipe eagle3_smollm2] [--data FILE] [--steps 8]
                                          [--warmup 2] [--threads 2] [KEY=VALUE ...]

KEY=VALUE are recipe overrides, as `train.py` takes them (e.g. drafter.ttt_steps=7
data.max_length=256 train.micro_batch_size=4 data.pack=true). The data is `--data` (default the
bundled demo conversations whose answers SmolLM2 regenerated, demo/data/train.regenerated.jsonl.gz),
tokenized and drawn into micro-batches exactly as trainer/loop.py does (`load_tokenized`, the seeded
`micro_batches`, `Collator` or with data.pack `PackingCollator`); the drafter is built and prepared as
there (seed, `from_target`, `prepare` on the training data, AdamW over `param_groups`).

A timed step is the trainer's step on one micro-batch, in four parts, each timed on its own:
`target` the frozen target's forward under no_grad (`run_target` with the drafter's request),
`drafter` the drafter's forward and loss, `backward`, and `optimizer` (gradient clipping, AdamW step,
zero_grad). After `--warmup` untimed steps, `--steps` steps are timed; the report gives real tokens
(padding not counted, as the trainer's train/tokens_per_s) per second over the timed steps, per
core (torch thread), the median step and each part's median, the losses of every step (same data and
seed give the same losses on any code that learns the same thing, up to float rounding), the peak RSS
of the process, and the machine (CPU model, torch version and threads). The machine may be shared:
compare two versions by alternating runs of both and taking medians, not by one run each; and with
other jobs on the cores, more torch threads than free cores make every parallel op wait for a
descheduled thread (on a 2-core machine running another job, --threads 1 was 4x faster than 2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "demo" / "data" / "train.regenerated.jsonl.gz"


def cpu_model() -> str:
    """The CPU's model name (lscpu), else what platform knows."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def bench(recipe: str, data: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from omegaconf import OmegaConf

    from draftsmith.data_prep import Collator, PackingCollator, load_tokenized
    from draftsmith.heads import drafter_class
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target, load_tokenizer, run_target
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import micro_batches

    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_recipe(
            [f"recipe={recipe}", f"data.train=[{json.dumps(str(data))}]", *overrides, f"output_dir={scratch}/run"]
        )
    tokenizer = load_tokenizer(cfg.target)
    train_data = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
    target = load_target(cfg.target)
    torch.manual_seed(cfg.train.seed)
    drafter = drafter_class(cfg.drafter.type).from_target(
        OmegaConf.to_object(cfg.drafter), target, cfg.target.name_or_path
    )
    drafter.prepare(train_data)
    groups = [{"params": params, "lr": cfg.train.lr * scale} for params, scale in drafter.param_groups()]
    optimizer = torch.optim.AdamW(
        groups, lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay
    )
    request = drafter.request
    collate = (
        PackingCollator(tokenizer.pad_token_id, cfg.data.pack_length or cfg.data.max_length)
        if cfg.data.pack
        else Collator(tokenizer.pad_token_id)
    )
    drafter.train()

    parts = ("target", "drafter", "backward", "optimizer")
    seconds: dict[str, list[float]] = {part: [] for part in (*parts, "step")}
    losses, tokens, positions = [], 0, 0
    stream = micro_batches(train_data, collate, cfg, 1, 0, TrainerState())
    for index in range(warmup + steps):
        _, _, batch = next(stream)
        clock = [time.perf_counter()]
        with torch.no_grad():
            target_out = run_target(target, batch["input_ids"], request=request, **causal_lm_inputs(batch))
        clock.append(time.perf_counter())
        loss, count, _ = drafter(batch, target_out)
        clock.append(time.perf_counter())
        (loss / count.clamp(min=1)).backward()  # the per-token loss (heads/base.py)
        clock.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.append(time.perf_counter())
        del target_out
        losses.append(float(loss.detach()))
        if index < warmup:
            continue
        for part, start, stop in zip(parts, clock, clock[1:]):
            seconds[part].append(stop - start)
        seconds["step"].append(clock[-1] - clock[0])
        tokens += int(batch["attention_mask"].sum())
        positions += batch["input_ids"].numel()

    total = sum(seconds["step"])
    threads = torch.get_num_threads()
    return {
        "recipe": recipe,
        "drafter": cfg.drafter.type,
        "overrides": overrides,
        "data": str(data),
        "max_length": cfg.data.max_length,
        "micro_batch_size": cfg.train.micro_batch_size,
        "pack": bool(cfg.data.pack),
        "ttt_steps": OmegaConf.select(cfg, "drafter.ttt_steps"),
        "draft_vocab_size": OmegaConf.select(cfg, "drafter.draft_vocab_size"),
        "warmup_steps": warmup,
        "timed_steps": steps,
        "tokens_per_s": round(tokens / total, 1),
        "tokens_per_s_per_core": round(tokens / total / threads, 1),  # per torch thread (torch.get_num_threads())
        "tokens_per_step": round(tokens / steps, 1),
        "padding_fraction": round(1 - tokens / max(positions, 1), 4),
        "step_s_mean": round(total / steps, 4),
        "step_s_median": round(statistics.median(seconds["step"]), 4),
        "part_s_median": {part: round(statistics.median(seconds[part]), 4) for part in parts},
        "part_s_mean": {part: round(sum(seconds[part]) / steps, 4) for part in parts},
        "losses": [round(value, 6) for value in losses],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, KEY=VALUE")
    parser.add_argument("--recipe", default="eagle3_smollm2")
    parser.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help="conversations file (data.train); default the bundled regenerated demo data",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = bench(args.recipe, args.data, args.overrides, args.steps, args.warmup)
    result |= {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "machine": {
            "cpu": cpu_model(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
