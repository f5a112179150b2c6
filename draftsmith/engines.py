"""Serving engines as draftsmith uses them: vLLM in an environment of its own, driven through the
scripts in draftsmith/engine_scripts (which import only vLLM and the standard library), so vLLM's
pinned torch and transformers never meet draftsmith's."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional, Sequence

from draftsmith.errors import EngineUnavailable, UserError, one_line


def engine_script(name: str) -> Path:
    return Path(str(files("draftsmith.engine_scripts").joinpath(name)))


def vllm_python(setting: Optional[str], key: str) -> str:
    """The Python that runs vLLM: `setting` (the recipe key `key`) when given, else this one when it
    can import vllm."""
    if setting:
        if not Path(setting).expanduser().is_file():
            raise UserError(f"{key}={setting!r} is not a Python executable")
        return str(Path(setting).expanduser())
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise UserError(
        f"vLLM is not installed in this environment: set {key}=<the python of an environment that has vllm>"
    )


def failure_cause(reply: dict[str, Any], python: str, key: str) -> str:
    """The one-line cause of a vLLM worker's failed reply (draftsmith/engine_scripts/*.py: `error`,
    `error_lines`); a UserError when `python` (the recipe's `key`) has no vllm at all."""
    if reply.get("error", "").startswith("ModuleNotFoundError: No module named 'vllm"):
        raise UserError(
            f"{python} cannot import vllm ({reply['error']}): point {key} at the python of an environment that has it"
        )
    return one_line("; ".join(reply.get("error_lines") or []) or reply.get("error", "unknown error"), 600)


class VllmGenerator:
    """One vLLM engine in a worker process (engine_scripts/vllm_generate.py) answering batches of
    token-id prompts with token ids. A worker that cannot start or dies is EngineUnavailable (a
    temporary fault); work finished before it stays finished."""

    def __init__(self, python: str, key: str, engine: dict[str, Any], env: Optional[dict[str, str]] = None):
        self.python, self.key = python, key  # the recipe key that named `python`, for errors
        self.process = subprocess.Popen(
            [python, str(engine_script("vllm_generate.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.send({"engine": engine})
        self.version = self.receive("start")["vllm_version"]

    def send(self, message: dict[str, Any]) -> None:
        try:
            self.process.stdin.write(json.dumps(message) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):
            self.receive("take a request")  # the worker is gone: its last line says why

    def receive(self, doing: str) -> dict[str, Any]:
        line = self.process.stdout.readline()
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            self.process.kill()
            raise EngineUnavailable(
                f"the vLLM worker stopped before it could {doing} (exit code {self.process.wait()}); its log is above"
            ) from None
        if not message.get("ok"):
            self.process.wait()
            raise EngineUnavailable(f"vLLM could not {doing}: {failure_cause(message, self.python, self.key)}")
        return message

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, top_p: float, seeds: Sequence[int]
    ) -> list[list[int]]:
        self.send(
            {
                "prompts": [list(p) for p in prompts],
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "seeds": list(seeds),
            }
        )
        return self.receive("generate")["outputs"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> VllmGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
