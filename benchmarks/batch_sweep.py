"""What speculation buys at each batch size: the eval's batch-size sweep for trained drafters, as JSON.

    python benchmarks/batch_sweep.py [--only medusa,eagle3] [--batch-sizes 1,2,4,8] [--runs runs/bench_batch]

For each drafter recipe (the bundled demo target and data), train it with `python train.py
recipe=NAME` unless `<runs>/<NAME>/final` already holds a checkpoint, then run the eval with
`eval.batch_sizes`: plain decoding, the drafter's chain (and tree) and prompt lookup, each at every
batch size on the same prompts, every row checked against plain greedy decoding of its prompt alone.
Prints per drafter, batch size and method: tau, tokens/s and the speedup over plain decoding at the
same batch size (all domains, and per domain); the plot is `<runs>/<NAME>/eval/batch_sweep.png`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from draftsmith_commands import REPO, train_unless_trained  # benchmarks/ is the script's directory, first on sys.path
from names import names_of, shipped_recipes
from provenance import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", type=names_of(shipped_recipes()), default="medusa,eagle3", help="drafter recipes, comma-separated"
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument(
        "--runs", type=Path, default=REPO / "runs/bench_batch", help="where the trained runs live (reused when present)"
    )
    parser.add_argument("--max-prompts", type=int, default=8, help="per domain")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from draftsmith.eval.report import run_eval
    from draftsmith.recipe import load_recipe

    sizes = [int(size) for size in args.batch_sizes.split(",")]
    summary: dict = {"batch_sizes": sizes, "drafters": {}}
    start = time.perf_counter()
    for name in args.only:
        output_dir = (args.runs / name).resolve()
        trained_s = train_unless_trained([f"recipe={name}"], output_dir)
        overrides = [
            f"recipe={name}",
            f"output_dir={output_dir}",
            f"eval.max_prompts={args.max_prompts}",
            f"eval.max_new_tokens={args.max_new_tokens}",
            f"eval.batch_sizes=[{','.join(map(str, sizes))}]",
        ]
        began = time.perf_counter()
        report = run_eval(load_recipe(overrides))
        sweep = report["batch_sweep"]["rows"]
        summary["drafters"][name] = {
            "train_s": trained_s,
            "eval_s": round(time.perf_counter() - began, 1),
            "plot": str(output_dir / "eval" / "batch_sweep.png"),
            "all": {
                size: {
                    method: {k: row[k] for k in ("tau", "tokens_per_s", "speedup", "lossless")}
                    for method, row in sweep[size]["all"].items()
                }
                for size in sweep
            },
            "speedup_per_domain": {
                size: {
                    domain: {method: row["speedup"] for method, row in rows.items() if method != "plain"}
                    for domain, rows in sweep[size].items()
                    if domain != "all"
                }
                for size in sweep
            },
        }
    print(json.dumps(summary | provenance(args.threads, start), indent=2))


if __name__ == "__main__":
    main()
