"""How long a draftsmith command's process takes to end once its command is over: the interpreter's finalization
(module teardown, its last garbage collections) after the atexit handlers, with the heap frozen at exit as `run_cli`
does (draftsmith/errors.py::freeze_heap_at_exit) and without. A short training run (`python train.py recipe=medusa`,
3 steps, eval off) in a child process, alternating, its end stamped by an atexit handler registered before run_cli's
(so run after it). Prints JSON: each variant's finalization seconds per run, the machine, threads and versions.

    python benchmarks/cli_exit.py [--runs 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import provenance  # benchmarks/, first on sys.path

REPO = Path(__file__).resolve().parent.parent
STAMP = "import atexit, sys, time; atexit.register(lambda: print('EXIT_STAMP', time.time(), file=sys.stderr)); "
UNFROZEN = "import draftsmith.errors as errors; errors.freeze_heap_at_exit = lambda: None; "
RUN_TRAIN = "import runpy; sys.argv = ['train.py', *sys.argv[1:]]; runpy.run_path('train.py', run_name='__main__')"


def finalization_s(frozen: bool, output_dir: Path) -> float:
    """Seconds from the end of the atexit handlers to the process's end, for one 3-step training run."""
    code = STAMP + ("" if frozen else UNFROZEN) + RUN_TRAIN
    overrides = ["train.max_steps=3", "eval.enabled=false", "train.overwrite=true"]
    args = ["recipe=medusa", f"output_dir={output_dir}", *overrides]
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True)
    ended = time.time()
    if done.returncode != 0:
        sys.exit(f"the training run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    stamp = next(line for line in reversed(done.stderr.splitlines()) if line.startswith("EXIT_STAMP"))
    return round(ended - float(stamp.split()[1]), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("--work", type=Path, default=None, help="where the runs write (default: a temporary folder)")
    args = parser.parse_args()
    began = time.perf_counter()
    work = args.work or Path(tempfile.mkdtemp(prefix="cli-exit-"))
    measured: dict[str, list[float]] = {"frozen": [], "unfrozen": []}
    for _ in range(args.runs):
        for variant in measured:
            measured[variant].append(finalization_s(variant == "frozen", work / variant))
    print(json.dumps({
        "finalization_s": measured,
        "median_s": {variant: statistics.median(times) for variant, times in measured.items()},
        **provenance(int(os.environ.get("OMP_NUM_THREADS", "0")) or None, began),
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
