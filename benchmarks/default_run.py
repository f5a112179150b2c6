"""Time the README's main command and summarise what it measured, as JSON.

    python benchmarks/default_run.py [--output-dir runs/bench_medusa] [key=value overrides ...]

Runs `accelerate launch train.py recipe=medusa` (the bundled demo target and data) in a fresh
output directory and prints: eval-split top-1 accuracy per domain and head (trained vs untrained heads), the
speculative-decoding report's tau/alpha/speedup per domain and method, and the wall time with the machine and
versions (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance  # benchmarks/ is the script's directory, first on sys.path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/bench_medusa")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, key=value")
    args = parser.parse_args()
    output_dir = Path(args.output_dir).resolve()
    shutil.rmtree(output_dir, ignore_errors=True)

    launch = ["accelerate", "launch", "--num_processes", "1", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    command = [*launch, "train.py", "recipe=medusa", f"output_dir={output_dir}", *args.overrides]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"training failed (exit {result.returncode}):\n{result.stderr[-3000:]}")

    accuracy = json.loads((output_dir / "eval_accuracy.json").read_text())
    report = json.loads((output_dir / "eval" / "report.json").read_text())
    heads = sorted({k.split("/")[0] for k in accuracy["trained"]["all"] if k.endswith("/top1")})
    summary = {
        "command": " ".join(command),
        "top1": {
            domain: {
                h: {
                    "untrained": round(accuracy["untrained"][domain][f"{h}/top1"], 3),
                    "trained": round(accuracy["trained"][domain][f"{h}/top1"], 3),
                }
                for h in heads
            }
            for domain in accuracy["trained"]
        },
        "speculative": {
            domain: {
                method: {k: row[k] for k in ("tau", "alpha", "speedup", "lossless")}
                for method, row in {**report["domains"][domain], **report["baselines"][domain]}.items()
            }
            for domain in report["domains"]
        },
    }
    # threads: None, the run's own choice (draftsmith/threads.py); wall_s: the command's, from its start
    print(json.dumps(summary | provenance(None, start), indent=2))


if __name__ == "__main__":
    main()
