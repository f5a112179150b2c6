"""What the scripts that read vLLM's own computation share (benchmarks/vllm_mla_rope.py,
benchmarks/vllm_gemma4_assistant.py): the vLLM of an environment of its own, and a script run there that
answers with one tagged JSON line; and how every benchmark reads an engine environment's Python argument
(`engine_python`, `add_vllm_python`)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def engine_python(text: str) -> str:
    """An argparse type for an engine environment's Python (--vllm-python, --speculators-python): relative to the
    current directory, made absolute but not resolved (a venv's python is a link that works only under its own
    path), since the scripts run their children from the repository."""
    return str(Path(text).expanduser().absolute())


def add_vllm_python(parser: argparse.ArgumentParser) -> None:
    """The required --vllm-python of every benchmark that serves or regenerates with vLLM, read by engine_python."""
    parser.add_argument(
        "--vllm-python",
        required=True,
        type=engine_python,
        help="the Python of a vLLM environment, relative to the current directory",
    )


def vllm_version_or_exit(python: str) -> str:
    """The vLLM version installed for `python`, or one line and the bad-input exit code."""
    from draftsmith.engines import installed_vllm
    from draftsmith.errors import EXIT_USER_ERROR, UserError

    try:
        return installed_vllm(python, "--vllm-python")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)


def ask_vllm(python: str, script: str, tag: str, *args: str) -> Any:
    """`script` run by the vLLM Python (no V1 multiprocessing: the model in this child process) with `args`;
    the JSON its last line starting with `tag` and a space carries. Exits with one line when vLLM did not answer."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # fmt: skip
    done = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith(f"{tag} ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"error: vLLM did not answer: {(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(lines[-1][len(tag) + 1 :])
