"""EAGLE-1 for vLLM (`EagleLlamaForCausalLM`) and SGLang (`LlamaForCausalLMEagle`).

Both engines build the same model as draftsmith: `fc(cat(embed(x_{t+1}), f_t))` (embedding first),
decoder layers of the Llama family with layer 0's input norm left out, no final norm, and the target's
embedding and lm_head shared (not in the folder). The config is the target's decoder settings with the
drafter's layer count, so max_position_embeddings and rope come from the target.

vLLM's fc has no bias and skips an `fc.bias` tensor without an error, so a checkpoint trained with
`drafter.fc_bias=true` cannot be exported for vLLM (train with false). SGLang's fc always has a bias
(no config key turns it off; checked against sglang's llama_eagle.py, not run), so its folder carries
`fc.bias`: the trained one, or zeros for a drafter trained without one (the same function).
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from draftsmith.engines import ENGINE_NAMES
from draftsmith.errors import UserError
from draftsmith.formats import Exporter, Source, register
from draftsmith.formats.repo import (
    SGLANG_FLAGS,
    SGLANG_REVISION_FLAG,
    VLLM_SERVE,
    EngineRepo,
    TargetInfo,
    check_draft_layer,
    draft_layer_config,
)
from draftsmith.heads import drafter_class

SGLANG_SERVE = (
    "python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE --speculative-draft-model-path "
    "{path} --speculative-num-steps {gamma} --speculative-eagle-topk 1 --speculative-num-draft-tokens {gamma_plus_one}"
    + SGLANG_FLAGS
)

LAYER_FAMILIES = ("llama",)  # the draft layers both engines' EAGLE-1 builds


def llama_layers_expected(config: dict[str, Any], skip_first_input_norm: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of `num_hidden_layers` Llama decoder layers named `layers.{i}.*`."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    expected: dict[str, tuple[int, ...]] = {}
    for i in range(config["num_hidden_layers"]):
        prefix = f"layers.{i}."
        expected |= {
            prefix + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            prefix + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            prefix + "mlp.gate_proj.weight": (inner, hidden),
            prefix + "mlp.up_proj.weight": (inner, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inner),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
        if not (skip_first_input_norm and i == 0):
            expected[prefix + "input_layernorm.weight"] = (hidden,)
    return expected


@register
class EagleExporter(Exporter):
    kinds = ("eagle",)
    vllm_method = "eagle"

    def refuse(self, engine: str, drafter, target: TargetInfo, vllm_format: str) -> None:
        super().refuse(engine, drafter, target, vllm_format)
        if engine == "vllm" and drafter.config.fc_bias:
            raise UserError(
                "this EAGLE-1 checkpoint has an fc bias, which vLLM's EAGLE-1 skips without an error (its fc has "
                "none); retrain with drafter.fc_bias=false to serve it in vLLM"
            )
        draft_layer_config(drafter, LAYER_FAMILIES, ENGINE_NAMES[engine], "EAGLE-1")

    def config(self, source: Source, architecture: str, engine: str) -> dict[str, Any]:
        layers = draft_layer_config(source.drafter, LAYER_FAMILIES, engine, "EAGLE-1")
        return {**layers, "architectures": [architecture]}

    def vllm(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        config = self.config(source, "EagleLlamaForCausalLM", "vLLM")
        expected = {
            "fc.weight": (config["hidden_size"], 2 * config["hidden_size"]),
            **llama_layers_expected(config, skip_first_input_norm=True),
        }
        conventions = {
            "fc": (
                "input cat(embed(x_{t+1}), f_t), embedding first; f_t the target's final (post-norm) hidden state; no "
                "bias"
            ),
            "layers": (
                "layer 0 has no input_layernorm (vLLM: disable_input_layernorm); no final norm; the target's lm_head "
                "reads the output"
            ),
            "shared": "embed_tokens and lm_head are the target's (not in the folder)",
        }
        return EngineRepo("vllm", config, source.drafter.state_dict(), expected, VLLM_SERVE, conventions)

    def sglang(self, source: Source, gamma: int, output: Path) -> EngineRepo:
        config = self.config(source, "LlamaForCausalLMEagle", "SGLang")
        hidden = config["hidden_size"]
        tensors = dict(source.drafter.state_dict())
        tensors.setdefault("fc.bias", torch.zeros(hidden))
        expected = {
            "fc.weight": (hidden, 2 * hidden),
            "fc.bias": (hidden,),
            **llama_layers_expected(config, skip_first_input_norm=True),
        }
        conventions = {
            "fc": (
                "input cat(embed(x_{t+1}), f_t), embedding first; SGLang's fc always has a bias (zeros when draftsmith "
                "trained none)"
            ),
            "layers": "layer 0 has no input_layernorm; no final norm; the target's lm_head reads the output",
            "shared": "embed_tokens and lm_head are the target's (not in the folder)",
            "checked_against": "sglang python/sglang/srt/models/llama_eagle.py (source read, not run)",
        }
        return EngineRepo(
            "sglang",
            config,
            tensors,
            expected,
            SGLANG_SERVE,
            conventions,
            method="EAGLE",
            revision_flag=SGLANG_REVISION_FLAG,
        )

    def recognises(self, config: dict[str, Any], names: Collection[str]) -> bool:
        return bool({"EagleLlamaForCausalLM", "LlamaForCausalLMEagle"} & set(config.get("architectures", [])))

    def read(
        self, folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], target_model, info: dict[str, Any]
    ):
        eagle = drafter_class("eagle")
        settings = {"num_layers": int(config["num_hidden_layers"]), "fc_bias": "fc.bias" in tensors}
        settings |= {
            key: value for key, value in info.get("drafter_config", {}).items() if key in ("tree_depth", "tree_topk")
        }  # decode-only
        drafter = eagle.from_target(eagle.Config(**settings), target_model, info.get("verifier", "target"))
        check_draft_layer(folder, config, drafter.config.decoder["config"])  # the engine builds the folder's
        drafter.load_state_dict(tensors)
        return drafter
