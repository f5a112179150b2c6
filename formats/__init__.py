"""The engine formats of trained drafters: how each kind's drafter is laid out in the folders serving
engines load (vLLM, SGLang, speculators' layout), written and read back. Every stage reads drafters
through this layer: the export writes the folders (export/), eval and the monitor evaluate them, and
training warm-starts from them (formats/folder.py reads any drafter folder).

One format module per drafter kind (formats/<kind>.py), found through this registry; each builds the
folder for an engine (`vllm`, `sglang`) or says why that engine cannot serve the kind, and reads an
engine folder back into a draftsmith drafter, so `python -m eval checkpoint=<export>` evaluates exactly
what the engine serves. formats/repo.py holds what every format shares (the folder as written, its file
names, the serving command, the settings pinned in every served config); formats/versions.py the engine
releases that serve each method. The layers: draftsmith (core) <- heads <- formats <- the stages.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch

from draftsmith.engines import VLLM_FORMATS
from draftsmith.errors import UserError
from draftsmith.formats.repo import EngineRepo, TargetInfo, check_vllm_path, image_token_overrides
from draftsmith.formats.versions import (
    EVERY_BUILD,
    Releases,
    require_language_model_shares,
    require_lm_head_bias_applied,
    unloadable_target,
)
from draftsmith.formats.vllm_backend import backend_overrides
from draftsmith.heads.base import Drafter


@dataclass
class Source:
    """What an export starts from: the trained drafter (attached to the loaded target), its checkpoint
    directory, the target model itself, and what the exporters need to know about the target."""

    drafter: Drafter
    checkpoint: Path
    target_model: torch.nn.Module
    target: TargetInfo
    vllm_format: str = VLLM_FORMATS[0]  # export.vllm_format


class Exporter:
    """The engine formats of one or more drafter kinds."""

    kinds: ClassVar[tuple[str, ...]]  # the kinds it writes; `read` makes the first (formats/folder.py start_kind)
    sglang_reason: ClassVar[str] = ""  # why SGLang cannot serve these kinds ("" = it can)
    vllm_formats: ClassVar[tuple[str, ...]] = VLLM_FORMATS[:1]  # export.vllm_format values it writes
    weights_dirs: ClassVar[tuple[str, ...]] = ()  # subfolders of an engine folder that hold its drafter
    speculators_types: ClassVar[tuple[str, ...]] = ()  # the speculators_model_type values of the folders it reads
    vllm_method: ClassVar[str]  # vLLM's speculative method for these kinds' folders
    # whether vLLM 0.32 may read another method than vllm_method from the served path or repo id (it picks the method
    # from a name holding another's keyword, formats/repo.py VLLM_PATH_TRIGGERS, but for the methods it keeps): the
    # export then refuses such an export.output (build) and export.push.repo_id (export/push.py)
    vllm_method_from_name: ClassVar[bool] = False
    vllm_releases: ClassVar[Releases] = Releases()  # the vLLM releases that serve it (formats/versions.py)
    # whether vLLM's proposer for it takes a γ per batch size (num_speculative_tokens_per_batch_size; γ 0 drafts
    # nothing): vLLM 0.32's Medusa proposer asserts the one γ it was loaded with
    vllm_takes_schedule: ClassVar[bool] = True
    # whether vLLM's proposer for it reads a multimodal target's image token at load (image_token_overrides): every
    # proposer built on vLLM 0.32's shared one does, Medusa's reads nothing of the target's
    vllm_reads_image_token: ClassVar[bool] = True
    # the vLLM builds whose proposer for it shares the target's input embedding through its language model's `.model`
    # (formats/versions.py VLLM_BARE_LANGUAGE_MODEL, formats/vllm_backend.py VLLM_BACKEND_EMBEDDING_ELSEWHERE):
    # EVERY_BUILD, the CPU build (CPU_BUILD) or None. Every V1 model runner proposer built on the shared one does
    # (vllm/v1/spec_decode: eagle.py, dflash.py, llm_base_proposer.py), the only runner the CPU build runs (it has no
    # Triton); GPU builds run V2 by default, whose EAGLE, MTP and DSpark loaders read `.model` too
    # (vllm/v1/worker/gpu/spec_decode: eagle/utils.py, dspark/utils.py; P-EAGLE falls back to V1) while its DFlash
    # loader takes the decoder itself (dflash/utils.py: source read)
    vllm_shares_embedding: ClassVar[Optional[str]] = EVERY_BUILD
    # whether its vLLM folder's config.json is a target family's own causal-LM config, which vLLM's speculative config
    # maps to the family's MTP model where the family ships one (formats/versions.py
    # require_draft_config_read_as_written, asked of the export's engine)
    vllm_writes_family_config: ClassVar[bool] = False

    def releases(self, drafter_config: Mapping[str, Any], gamma: Optional[int] = None) -> Releases:
        """The vLLM releases that serve a drafter of this config (its fields as its checkpoint keeps them) as trained,
        drafting `gamma` tokens a step (None: not known yet, any): `vllm_releases`, unless an exporter serves some of
        its drafters in fewer."""
        return self.vllm_releases

    def check_engines(self, kind: str, engines: list[str], vllm_format: str) -> None:
        """Whether these engines (and vLLM layout) can serve the kind at all: known before any model loads."""
        if "sglang" in engines and self.sglang_reason:
            raise UserError(f"{kind} cannot be exported for sglang: {self.sglang_reason}")
        if "vllm" in engines and vllm_format not in self.vllm_formats:
            raise UserError(
                f"export.vllm_format={vllm_format}: {kind} has one vLLM layout; leave export.vllm_format unset"
            )

    def refuse(self, engine: str, drafter: Drafter, target: TargetInfo, vllm_format: str) -> None:
        """Raise the export's one-line UserError for why `engine` cannot serve this drafter for this target,
        read from their configs alone (no tensor is built): `build` asks it before it builds anything, and
        the eval's report names only the engines it passes (`refusal`). An exporter adds its kinds' checks."""
        self.check_engines(drafter.type, [engine], vllm_format)
        unloadable = (
            unloadable_target(target.config, target.config_json, target.trust_remote_code) if engine == "vllm" else None
        )
        if unloadable:
            raise UserError(f"no vLLM release checked can serve a drafter of this target: {unloadable}")
        if engine == "vllm":
            sharing_nothing = sorted(kind for kind, other in EXPORTERS.items() if other.vllm_shares_embedding is None)
            require_language_model_shares(target.config, self.vllm_method, self.vllm_shares_embedding, sharing_nothing)

    def refusal(self, engine: str, drafter: Drafter, target: TargetInfo, vllm_format: str) -> Optional[str]:
        """`refuse`'s line for the vLLM layout `vllm_format`, or None where `engine` serves the drafter."""
        try:
            self.refuse(engine, drafter, target, vllm_format)
        except UserError as err:
            return str(err)
        return None

    def build(self, engine: str, source: Source, gamma: int, output: Path) -> EngineRepo:
        self.refuse(engine, source.drafter, source.target, source.vllm_format)
        if engine == "vllm":
            require_lm_head_bias_applied(source.target.config, source.target_model)
        if engine == "vllm" and self.vllm_method_from_name:
            check_vllm_path(output, source.drafter.TITLE)
        repo = getattr(self, engine)(source, gamma, output)
        if engine == "vllm":
            repo.method = self.vllm_method  # one name for it: what the checks ask of the engine is what it serves
            told = image_token_overrides(source.target.shape.name_or_path) if self.vllm_reads_image_token else {}
            repo.target_overrides = told | backend_overrides(source.target.config) | repo.target_overrides
        return repo

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        raise NotImplementedError

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        raise NotImplementedError

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        """Whether an engine folder (its config.json and the names of its weights) is in one of this exporter's
        formats."""
        raise NotImplementedError

    def folder_settings(self, folder: Path, config: dict[str, Any], num_layers: Optional[int] = None) -> dict[str, Any]:
        """The drafter settings an engine folder's config.json fixes, read without its target (`num_layers`: the
        target's layer count where known, for defaults that follow from it): what a warm start's recipe is compared
        with before any data or model loads (formats/folder.py require_drafter_folder). None by default: the folder
        is compared once its drafter is built."""
        return {}

    def require_made_for(self, folder: Path, config: dict[str, Any], target_config: dict[str, Any]) -> None:
        """One line where an engine folder's config.json (`config`) says it was made for another target than the one
        whose config.json is `target_config` (read without loading it), checked before any data or model loads; the
        full check comes when it is read. Nothing by default: a format whose config is the drafter's own says nothing
        of the target's family."""

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


def refusals(drafter: Drafter, target: TargetInfo, vllm_format: str) -> dict[str, dict[str, Optional[str]]]:
    """Eval method (chain, tree) -> each engine the drafter's kind names for it (Drafter.SERVED_BY) -> the line its
    export refuses this drafter for this target with (Exporter.refuse), or None where it serves it. A kind that
    names no engine (draftsmith's eval only) needs no export format: its eval runs, only its export is refused."""
    engines = dict.fromkeys(engine for named in type(drafter).SERVED_BY.values() for engine in named)
    exporter = exporter_for(drafter.type) if engines else None
    refused = {engine: exporter.refusal(engine, drafter, target, vllm_format) for engine in engines}
    return {method: {engine: refused[engine] for engine in named} for method, named in type(drafter).SERVED_BY.items()}


def exporter_for(kind: str) -> Exporter:
    if kind not in EXPORTERS:
        raise UserError(f"drafter type {kind!r} has no export format yet; exportable: {', '.join(sorted(EXPORTERS))}")
    return EXPORTERS[kind]


# each registers itself
from draftsmith.formats import dflash, draft_model, dspark, eagle, eagle3  # noqa: E402,F401,I001
from draftsmith.formats import gemma4_assistant, medusa, mtp  # noqa: E402,F401,I001

__all__ = ["EXPORTERS", "Exporter", "Source", "exporter_for", "refusals", "register"]
