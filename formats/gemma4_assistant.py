"""Gemma-4's assistant for vLLM (`method: mtp`), trained by draftsmith (heads/gemma4_assistant.py).

vLLM 0.32 serves a Gemma-4 target's assistant from a folder in the released assistant's own format: the
config transformers writes for a `Gemma4AssistantForCausalLM` (model_type gemma4_assistant, which vLLM maps
to its gemma4_mtp model) and the tensors transformers' saver writes for it (`pre_projection`,
`model.layers.*`, `model.norm`, `post_projection`, the vocabulary table as `model.embed_tokens`, to which
vLLM ties its lm_head; the centroids where the assistant has them). Served with
`--speculative-config '{"method": "mtp", "model": <folder>, ...}'`: vLLM wires each assistant layer to the
target's last cached layer of its kind and feeds it the target's embedding (measured:
benchmarks/vllm_gemma4_assistant.py). The folder is also what `train.init_from` reads, so a released
assistant downloaded from the Hub starts fine-tuning as it is.

SGLang: draftsmith has not verified its loader for the assistant.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.repo import VLLM_SERVE, EngineRepo, check_vllm_path
from draftsmith.heads.gemma4_assistant import ASSISTANT_MODEL_TYPE, Gemma4Assistant, store_layers
from draftsmith.target import TargetShape

# The names of the assistant's vocabulary table: the drafter's lm_head, the released folder's embedding.
OWN_TABLE, RELEASED_TABLE = "lm_head.weight", "model.embed_tokens.weight"
SETTINGS = ("ttt_steps", "ttt_decay")  # training settings the engine does not carry


def released_tensors(assistant) -> dict[str, torch.Tensor]:
    """An assistant module's tensors as transformers' saver writes them for its config (a released folder's)."""
    with tempfile.TemporaryDirectory() as tmp:
        assistant.save_pretrained(tmp)
        return load_file(str(Path(tmp) / "model.safetensors"))


@register
class AssistantExporter(Exporter):
    kinds = (Gemma4Assistant.type,)
    vllm_method = "mtp"
    sglang_reason = "draftsmith has not verified SGLang's loader for Gemma-4's assistant; export for vllm"

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        check_vllm_path(output, "Gemma-4 assistant")
        from transformers import Gemma4AssistantForCausalLM

        drafter = source.drafter
        config = drafter.assistant.config
        released = Gemma4AssistantForCausalLM(config)  # the released layout of this config, tied
        own = {name: tensor for name, tensor in drafter.assistant.state_dict().items() if name != OWN_TABLE}
        table = drafter.assistant.lm_head.weight
        released.load_state_dict({**own, RELEASED_TABLE: table, OWN_TABLE: table}, strict=True)
        tensors = released_tensors(released)
        expected = {name: tuple(t.shape) for name, t in released_tensors(Gemma4AssistantForCausalLM(config)).items()}
        values = config.to_dict()
        values["torch_dtype"] = "float32"
        conventions = {
            "config": "the assistant's own config (gemma4_assistant): vLLM builds its gemma4_mtp model from it",
            "weights": f"the released assistant's names; its vocabulary table as {RELEASED_TABLE} (vLLM ties lm_head)",
            "shared": "the input embedding is the target's, scaled by sqrt(hidden) (vLLM shares it; not in the folder)",
            "kv": (
                f"its layers read the target's cached keys and values of layers {drafter.stores} "
                "(the last non-KV-shared layer of each kind)"
            ),
        }
        return EngineRepo("vllm", values, tensors, expected, VLLM_SERVE, conventions, method="mtp")

    def recognises(self, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> bool:
        return config.get("model_type") == ASSISTANT_MODEL_TYPE

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        from transformers import Gemma4AssistantConfig

        kind = Gemma4Assistant
        text_target = getattr(target_model.config, "text_config", None) or target_model.config
        hf_config = Gemma4AssistantConfig.from_dict(config)
        if hf_config.backbone_hidden_size != text_target.hidden_size:
            raise UserError(
                f"{folder} is an assistant for a target of width {hf_config.backbone_hidden_size}; this target's is "
                f"{text_target.hidden_size}"
            )
        text = hf_config.text_config
        settings = {key: value for key, value in info.get("drafter_config", {}).items() if key in SETTINGS}
        drafter_config = kind.Config(
            num_layers=text.num_hidden_layers, hidden_width=text.hidden_size, mlp_width=text.intermediate_size,
            decoder={"assistant": hf_config.to_dict(), "stores": store_layers(text_target.to_dict())}, **settings,
        )  # fmt: skip
        drafter = kind(drafter_config, TargetShape.of(target_model, info.get("verifier", "target")))
        drafter.attach_target(target_model)
        state = {name: tensor for name, tensor in tensors.items() if name != RELEASED_TABLE}
        state[OWN_TABLE] = tensors[RELEASED_TABLE]
        missing, unexpected = drafter.assistant.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise UserError(
                f"{folder}: not an assistant of its config (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        return drafter
