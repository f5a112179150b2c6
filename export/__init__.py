"""Export a trained drafter to folders that serving engines load: one folder per engine, each a
complete Hugging Face-style repo (the engine's config.json, weights under the engine's names, the
target's tokenizer where the engine reads one, a model card, `draftsmith_export.json`), checked
against the target and the engine's loader before it lands, optionally loaded in the real engine
(vLLM) and compared with draftsmith's own eval, and optionally pushed to the Hub.

    python -m export recipe=NAME checkpoint=DIR export.engines=[vllm,sglang] export.output=DIR

One exporter per drafter kind (export/<kind>.py), found through this registry; each builds the
folder for an engine (`vllm`, `sglang`) or says why that engine cannot serve the kind, and reads an
engine folder back into a draftsmith drafter (draftsmith/drafter_folder.py reads every folder through
them, so `python -m eval checkpoint=<export>` evaluates exactly what the engine serves).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from draftsmith.errors import UserError
from draftsmith.export.repo import EngineRepo, TargetInfo
from draftsmith.export.versions import Releases, served_by
from draftsmith.heads import Drafter


@dataclass
class Source:
    """What an export starts from: the trained drafter (attached to the loaded target), its checkpoint
    directory, the target model itself, and what the exporters need to know about the target."""

    drafter: Drafter
    checkpoint: Path
    target_model: torch.nn.Module
    target: TargetInfo
    vllm_format: str = "speculators"  # export.vllm_format


class Exporter:
    """The engine formats of one or more drafter kinds."""

    kinds: ClassVar[tuple[str, ...]]
    sglang_reason: ClassVar[str] = ""  # why SGLang cannot serve these kinds ("" = it can)
    vllm_formats: ClassVar[tuple[str, ...]] = ("speculators",)  # export.vllm_format values it writes
    weights_dirs: ClassVar[tuple[str, ...]] = ()  # subfolders of an engine folder that hold its drafter
    vllm_method: ClassVar[str]  # vLLM's speculative method for these kinds' folders
    vllm_releases: ClassVar[Releases] = Releases()  # the vLLM releases that serve it (export/versions.py)

    def check_engines(self, kind: str, engines: list[str], vllm_format: str) -> None:
        """Whether these engines (and vLLM layout) can serve the kind at all: known before any model loads."""
        if "sglang" in engines and self.sglang_reason:
            raise UserError(f"{kind} cannot be exported for sglang: {self.sglang_reason}")
        if "vllm" in engines and vllm_format not in self.vllm_formats:
            raise UserError(
                f"export.vllm_format={vllm_format}: {kind} has one vLLM layout; leave export.vllm_format unset"
            )

    def build(self, engine: str, source: Source, gamma: int, output: Path) -> EngineRepo:
        self.check_engines(source.drafter.type, [engine], source.vllm_format)
        return getattr(self, engine)(source, gamma, output)

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        raise NotImplementedError

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        raise NotImplementedError

    def recognises(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        """Whether an engine folder (its config.json and weights) is in one of this exporter's formats."""
        raise NotImplementedError

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ) -> Drafter:
        """The draftsmith drafter an engine folder holds. `info` is draftsmith_export.json when the
        folder has one (settings the engine does not carry, such as tree sizes); the engine's config
        decides everything the engine uses."""
        raise NotImplementedError


EXPORTERS: dict[str, Exporter] = {}


def register(cls: type[Exporter]) -> type[Exporter]:
    exporter = cls()
    for kind in cls.kinds:
        if kind in EXPORTERS:
            raise ValueError(f"exporter for {kind!r} registered twice")
        EXPORTERS[kind] = exporter
    return cls


def release_table() -> dict[str, str]:
    """vLLM method -> the releases that serve it, over every registered exporter (docs, tests)."""
    return {e.vllm_method: served_by(e.vllm_method, e.vllm_releases) for e in EXPORTERS.values()}


def exporter_for(kind: str) -> Exporter:
    if kind not in EXPORTERS:
        raise UserError(f"drafter type {kind!r} has no export format yet; exportable: {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[kind]


# each registers itself
from draftsmith.export import dflash, draft_model, eagle, eagle3, medusa, mtp  # noqa: E402,F401,I001
from draftsmith.export.run import export_checkpoint  # noqa: E402

__all__ = ["EXPORTERS", "Exporter", "Source", "export_checkpoint", "exporter_for", "register", "release_table"]
