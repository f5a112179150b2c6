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

from dataclasses import dataclass
from typing import Optional

from packaging.version import Version

from draftsmith.engines import installed_vllm
from draftsmith.errors import UserError

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


def require_vllm_serves(method: str, releases: Releases, python: str, key: str = "export.vllm_python") -> str:
    """The installed vLLM's version, or the one-line refusal of a release without the method."""
    version = installed_vllm(python, key)
    if not serves(releases, version):
        raise UserError(f"{key} is vLLM {version}, which cannot serve this drafter: {served_by(method, releases)}")
    return version
