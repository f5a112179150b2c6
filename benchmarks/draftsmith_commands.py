"""How the benchmarks run draftsmith's own commands (`python train.py ...`, `python -m export ...`) in a child
process from the repository: its wall time, or the benchmark stops with the command and its stderr's tail; and a
recipe trained unless its run already holds a checkpoint, so that a rerun measures without training again."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_python(args: list[str]) -> float:
    """`python <args>` run from the repository; its wall seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"`python {' '.join(args)}` failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def train_unless_trained(overrides: list[str], output_dir: Path) -> float | None:
    """`python train.py <overrides>` into `output_dir`, its eval off (the benchmark measures on its own), unless
    `output_dir/final` holds a checkpoint; the training's wall seconds, None where the run was reused."""
    if (output_dir / "final" / "model.safetensors").is_file():
        return None
    command = ["train.py", *overrides, f"output_dir={output_dir}", "eval.enabled=false", "train.overwrite=true"]
    return round(run_python(command), 1)
