"""Where a benchmark's numbers came from, the same fields in every benchmark's JSON: the machine (CPU model,
cores, platform, GPU if any), the threads the measured work ran with, the versions (torch, transformers,
draftsmith and the git commit of the checkout it was imported from, where there is one) and the wall time.

    from provenance import provenance  # `python benchmarks/<name>.py` has this folder on sys.path
    began = time.perf_counter()
    ...
    print(json.dumps({**results, **provenance(threads, began)}))
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import time
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (lscpu), else what platform knows."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def gpu() -> dict | None:
    """The GPUs torch sees (kind and count), None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}


def machine() -> dict:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(), "gpu": gpu()}


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def checkout(root: Path) -> dict | None:
    """The commit of the git checkout whose top folder is `root`, and whether tracked files differ from it;
    None elsewhere (a copy of a package inside another checkout, step_compare.py's baseline, is not that
    checkout's commit) or without git (a device machine gets a copy of the tree, not its history)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True
        )
        if head.returncode != 0 or Path(head.stdout.split()[0]).resolve() != root.resolve():
            return None
        changes = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True
        )
    except OSError:
        return None
    return {"commit": head.stdout.split()[1], "modified": bool(changes.stdout.strip())}


def versions() -> dict:
    """torch, transformers and draftsmith as installed; draftsmith's checkout where it is imported from one
    (an editable install), without importing it."""
    spec = importlib.util.find_spec("draftsmith")
    root = Path(spec.origin).parent.parent if spec and spec.origin else None  # draftsmith/ sits at a checkout's top
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "draftsmith": version("draftsmith"),
        "draftsmith_checkout": checkout(root) if root else None,
    }


def provenance(threads: int | None, began: float) -> dict:
    """The fields every benchmark's JSON carries: `threads` the torch (or engine) threads the measured work
    ran with, `began` the time.perf_counter() at the benchmark's start."""
    return {
        "machine": machine(),
        "threads": threads,
        "versions": versions(),
        "wall_s": round(time.perf_counter() - began, 1),
    }


def emit(report: dict, out: Path | None, indent: int = 2) -> None:
    """Print `report` as JSON, and write the same text to `out` where one is given."""
    text = json.dumps(report, indent=indent)
    print(text)
    if out:
        out.write_text(text + "\n")
