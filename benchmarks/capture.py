"""What captured features cost and what their precision does to acceptance, as JSON.

    python benchmarks/capture.py [--recipe eagle3] [--steps 200] [--dtypes bfloat16,float16,float8]
                                 [--train-data demo/data/train.regenerated.jsonl.gz] [--runs runs/bench_capture]

For the recipe's drafter on the bundled demo target, side by side in one run:
1. `python train.py` online (the target runs inside every step): tau per domain at T=0, training tokens/s;
2. per storage dtype: `python -m data_prep.capture` (bytes/token against the 8*H anchor, capture
   tokens/s), then `python train.py data.features=<shards>` with the same steps, data and seed
   (tau, training tokens/s).
It names the cheapest dtype whose overall tau (chain and tree) stays within 2% of bfloat16's.
Training tokens/s is the mean of the logged intervals after the first (which holds start-up). Then the machine,
the versions and the whole wall time (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from names import names_of
from provenance import provenance  # benchmarks/ is the script's directory, first on sys.path

from draftsmith.recipe_schema import CHOICES

REPO = Path(__file__).resolve().parent.parent
TOLERANCE = 0.02


def run(args: list[str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"`python {' '.join(args)}` failed (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return time.perf_counter() - start, result.stdout


def train(common: list[str], out: Path, *extra: str) -> dict:
    wall, _ = run(["train.py", *common, *extra, f"output_dir={out}"])
    report = json.loads((out / "eval" / "report.json").read_text())
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    speeds = [row["train/tokens_per_s"] for row in logged if "train/tokens_per_s" in row][1:]
    return {
        "wall_s": round(wall, 1),
        "train_tokens_per_s": round(sum(speeds) / max(len(speeds), 1), 1),
        "tau": {d: {m: row["tau"] for m, row in methods.items()} for d, methods in report["domains"].items()},
        "lossless": all(row["lossless"] for methods in report["domains"].values() for row in methods.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="eagle3")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--dtypes", type=names_of(CHOICES["data.capture.dtype"]), default="bfloat16,float16,float8")
    parser.add_argument("--train-data", default="demo/data/train.regenerated.jsonl.gz")
    parser.add_argument("--runs", default="runs/bench_capture")
    args = parser.parse_args()
    began = time.perf_counter()
    runs = Path(args.runs).resolve()
    common = [f"recipe={args.recipe}", f"data.train=[{args.train_data}]", f"train.max_steps={args.steps}"]

    results: dict = {"recipe": args.recipe, "steps": args.steps, "train_data": args.train_data}
    results["online"] = train(common, runs / "online")
    captures = {}
    for dtype in args.dtypes:
        shards = runs / f"features_{dtype}"
        wall, _ = run(
            [
                "-m",
                "data_prep.capture",
                *common,
                f"data.capture.dtype={dtype}",
                f"data.capture.output={shards}",
                f"output_dir={runs / 'capture'}",
            ]
        )
        manifest = json.loads((shards / "manifest.json").read_text())
        captures[dtype] = {
            "bytes_per_token": round(manifest["bytes_per_token"], 1),
            "anchor_bytes_per_token": manifest["anchor_bytes_per_token"],
            "anchor_ratio": round(manifest["anchor_ratio"], 3),
            "tokens": manifest["tokens"],
            "capture_tokens_per_s": manifest["last_run"]["tokens_per_s"],
            "capture_wall_s": round(wall, 1),
            "fields": manifest.get("fields"),
            "offline": train(common, runs / f"offline_{dtype}", f"data.features={shards}"),
        }
    results["captures"] = captures

    if "bfloat16" in captures:
        reference = captures["bfloat16"]["offline"]["tau"]["all"]
        within = []
        for dtype, entry in captures.items():
            tau = entry["offline"]["tau"]["all"]
            entry["tau_change_vs_bfloat16"] = {m: round(tau[m] / reference[m] - 1, 4) for m in reference}
            if all(abs(change) <= TOLERANCE for change in entry["tau_change_vs_bfloat16"].values()):
                within.append((entry["bytes_per_token"], dtype))
        results["cheapest_within_2pct_of_bfloat16"] = min(within)[1] if within else None
    print(json.dumps(results | provenance(None, began), indent=2))  # threads: each run's own choice


if __name__ == "__main__":
    main()
