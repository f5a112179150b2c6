"""EAGLE-3's training-time test on a recipe's real micro-batches, its two attention backends side by side on
this machine: the compiled flex unroll against dense, forward only, as JSON (issue #61's CPU figure).

    python benchmarks/flex_unroll.py [--recipe eagle3_smollm2] [--data FILE] [--batches 24] [--threads 2]
                                     [--out FILE] [KEY=VALUE ...]

On a CPU inductor compiles flex attention's forward but not its backward (training with flex is refused off
CUDA), so both backends run `Eagle3.unroll` under no_grad, one after the other on each micro-batch, in one
process: the trainer's own sampler and collator (`micro_batches`, the recipe's padding or packing collator)
over `--data` (default: the demo conversations whose answers SmolLM2 regenerated), the recipe's drafter
built by the trainer's `build_drafter` (KEY=VALUE: recipe overrides, e.g. drafter.ttt_steps=3
train.micro_batch_size=8 data.pack=true). The target's features of every micro-batch are computed first,
untimed. Per backend: seconds per micro-batch (flex: the first call of each length bucket, which compiles,
apart from the rest), the peak resident memory each call adds to what was resident before it (the kernel's
high-water mark, reset per call through /proc/self/clear_refs: Linux), the graphs dynamo compiled over the
run, the calls flex ran uncompiled (torch's fallback warns), and the largest difference between the two
backends' outputs. Needs the recipe's target (eagle3_smollm2: `pip install -e ".[smollm]"`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from provenance import provenance  # benchmarks/, first on sys.path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO / "demo" / "data" / "train.regenerated.jsonl.gz"
FALLBACK = "flex_attention called without torch.compile"  # torch's warning when flex runs its unfused path


def resident_kb(field: str) -> int:
    """This process's VmRSS or VmHWM (peak since the last reset), in kB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def measured_call(run):
    """(result, seconds, MB of resident memory the call added at its peak)."""
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark starts again from what is resident
    before = resident_kb("VmRSS")
    start = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - start
    return result, seconds, (resident_kb("VmHWM") - before) / 1024


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def real_micro_batches(cfg, count: int):
    """The first `count` micro-batches the trainer draws for `cfg`, with the target and the recipe's drafter."""
    from draftsmith.data_prep.collate import Collator
    from draftsmith.data_prep.dataset import load_tokenized
    from draftsmith.target import load_target, load_tokenizer
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import micro_batches
    from draftsmith.trainer.setup import build_drafter, packing_collator

    tokenizer = load_tokenizer(cfg.target)
    data = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
    target = load_target(cfg.target, "cpu")
    collate = packing_collator(cfg, tokenizer, target) or Collator(tokenizer.pad_token_id)
    stream = micro_batches(data, collate, cfg, 1, 0, TrainerState())
    torch.manual_seed(cfg.train.seed)
    drafter = build_drafter(cfg, target, torch.device("cpu"))
    drafter.prepare(data)
    return target, drafter.eval(), [next(stream)[2] for _ in range(count)]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="eagle3_smollm2")
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", help="also write the JSON here")
    args, overrides = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)

    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.heads.ttt_attention import flat_length
    from draftsmith.recipe import load_recipe
    from draftsmith.target import run_target

    began = time.perf_counter()
    cfg = load_recipe([f"recipe={args.recipe}", f"data.train=[{args.data}]", *overrides])
    target, drafter, batches = real_micro_batches(cfg, args.batches)
    with torch.no_grad():
        features = [
            run_target(target, b["input_ids"], request=drafter.request, **causal_lm_inputs(b)).layers for b in batches
        ]
    del target
    rows = {"dense": [], "flex": []}
    buckets, shapes, fallbacks, largest_difference = set(), set(), 0, 0.0
    graphs_before = compiled_graphs()
    for batch, layers in zip(batches, features):
        width = batch["input_ids"].shape[1] - 2
        bucket = flat_length(batch["input_ids"].shape[0] * width)
        shapes.add(tuple(batch["input_ids"].shape))
        outputs = {}
        for backend in ("dense", "flex"):
            drafter.config.ttt_attention = backend
            with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outputs[backend], seconds, peak_mb = measured_call(
                    lambda b=batch, f=layers: drafter.unroll(b["input_ids"], f, b)
                )
            fallbacks += sum(FALLBACK in str(w.message) for w in caught)
            tokens = int(batch["attention_mask"].sum())
            rows[backend].append(
                {"seconds": seconds, "peak_mb": peak_mb, "tokens": tokens, "first": bucket not in buckets}
            )
        buckets.add(bucket)
        for dense, flex in zip(outputs["dense"], outputs["flex"]):
            largest_difference = max(largest_difference, float((dense - flex).abs().max()))
    graphs = compiled_graphs() - graphs_before

    def summary(backend: str) -> dict:
        # flex's first call of a bucket compiles: its time and memory are the compiler's, reported apart
        steady = [r for r in rows[backend] if not (backend == "flex" and r["first"])]
        first = [r for r in rows[backend] if r["first"]]
        return {
            "seconds_per_batch_median": round(statistics.median(r["seconds"] for r in steady), 4),
            "tokens_per_s": round(sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady), 1),
            "peak_added_mb_median": round(statistics.median(r["peak_mb"] for r in steady), 1),
            "peak_added_mb_max": round(max(r["peak_mb"] for r in steady), 1),
            "first_call_of_bucket": [
                {"seconds": round(r["seconds"], 2), "peak_added_mb": round(r["peak_mb"], 1)} for r in first
            ],
        }

    dense, flex = summary("dense"), summary("flex")
    report = {
        "benchmark": "flex_unroll",
        "recipe": args.recipe,
        "overrides": overrides,
        "data": args.data,
        "micro_batches": len(batches),
        "rows_per_batch": cfg.train.micro_batch_size,
        "pack": bool(cfg.data.pack),
        "ttt_steps": drafter.config.ttt_steps,
        "distinct_shapes": len(shapes),
        "length_buckets": sorted(buckets),
        "graphs_compiled": graphs,
        "uncompiled_flex_calls": fallbacks,
        "max_abs_difference": largest_difference,
        "dense": dense,
        "flex": flex,
        "flex_over_dense_time": round(flex["seconds_per_batch_median"] / dense["seconds_per_batch_median"], 3),
        "flex_over_dense_peak": round(flex["peak_added_mb_max"] / max(dense["peak_added_mb_max"], 1e-9), 3),
        "engine": "none: draftsmith's trainer forward on a CPU (no engine serves training)",
        **provenance(torch.get_num_threads(), began),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
