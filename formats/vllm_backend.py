"""What vLLM must be told of a target it builds with its Transformers backend (transformers' own model, its attention
layers swapped for vLLM's): the architectures it builds so, and what it reads otherwise than transformers' model
computes. The export passes `backend_overrides` to its check and the folder's serving command (`--hf-overrides`, the
folder's `target_overrides`); `formats/versions.py` refuses the drafters whose proposers look for an embedding the
backend's model names otherwise, and `formats/draft_model.py` the draft models the backend cannot build beside their
target."""

from __future__ import annotations

from typing import Any, Optional

# the text-generation architectures vLLM 0.32 builds with its Transformers backend, no model class of its own (its
# registry's `_TRANSFORMERS_SUPPORTED_MODELS`: tests/test_families_vllm.py keeps the table so); it builds an
# architecture it registers nothing for so too, where its transformers knows the model type
VLLM_TRANSFORMERS_BACKEND = (
    "ArceeForCausalLM", "CwmForCausalLM", "FlexOlmoForCausalLM", "GlmForCausalLM", "GPTBigCodeForCausalLM",
    "GPTNeoXForCausalLM", "HunYuanDenseV1ForCausalLM", "HunYuanMoEV1ForCausalLM", "Jais2ForCausalLM",
    "MellumForCausalLM", "NanbeigeForCausalLM", "OlmoForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM",
    "PhiForCausalLM", "SeedOssForCausalLM", "SmolLM3ForCausalLM", "Starcoder2ForCausalLM", "VaultGemmaForCausalLM",
)  # fmt: skip
# of those, the ones whose transformers model (the backend's `.model`) names its input embedding otherwise than the
# proposers sharing it look for (`embed_tokens`, `embedding`: measured on GPT-NeoX, "Target model does not have
# 'embed_tokens' or 'embedding' attribute" at start); tests/test_unnamed_families.py keeps it equal to transformers'
VLLM_BACKEND_EMBEDDING_ELSEWHERE = {"GPTNeoXForCausalLM": "embed_in", "GPTBigCodeForCausalLM": "wte"}
# the fields that backend reads a target's count of MTP layers from, the first one the config has (transformers/base.py
# `_recursive_replace`: it adds that count to the layer count, a None included)
BACKEND_MTP_COUNTS = ("n_predict", "num_nextn_predict_layers", "mtp_num_hidden_layers")
# Architectures whose transformers attention hands its attention function its key-value heads repeated once per
# expert a token picks (JetMoE's mixture of attention heads: `num_key_value_heads` × `num_experts_per_tok`), with the
# field that counts the repeats. The backend builds its attention for `num_key_value_heads` heads and reads the
# repeated ones as other positions' keys: vLLM 0.32's greedy output of a tiny JetMoE target differed from
# transformers' from the first token (measured), and equalled it once told the repeated count as `num_kv_heads`, the
# field vLLM reads before `num_key_value_heads` (a KV cache that many times larger). tests/test_unnamed_families.py
# keeps the table equal to what transformers' models hand their attention functions.
VLLM_BACKEND_REPEATED_KV = {"JetMoeForCausalLM": "num_experts_per_tok"}
# Architectures whose transformers model holds each layer's experts as one module named `experts` (a list of experts,
# or 3-D weights), which the backend replaces with vLLM's fused experts registered under the transformers model's own
# path from `model` (transformers/moe.py: `_recursive_replace(self.model, prefix="model")`), whichever model vLLM is
# building. A draft model of such an architecture served beside a target of one registers its experts under the
# target's layers' names, and vLLM stops at the engine's start ("Duplicate layer name: model.layers.0.mlp.experts",
# measured on HunYuan-MoE). tests/test_unnamed_families.py keeps the table equal to transformers' models.
VLLM_BACKEND_FUSED_EXPERTS = ("FlexOlmoForCausalLM", "HunYuanMoEV1ForCausalLM", "MellumForCausalLM")


def built_by_backend(config: dict[str, Any]) -> bool:
    """Whether vLLM builds the target whose HF config this is with its Transformers backend: an architecture of
    VLLM_TRANSFORMERS_BACKEND, or one no vLLM release checked registers a class for."""
    from draftsmith.formats.versions import vllm_targets  # that module refuses what this one's tables say

    names = set(config.get("architectures") or [])
    return bool(names & set(VLLM_TRANSFORMERS_BACKEND)) or not names & vllm_targets()[1]


def backend_overrides(config: dict[str, Any]) -> dict[str, int]:
    """What vLLM must be told of a target it builds with its Transformers backend to compute what transformers'
    model computes (empty for any other target): a count of MTP layers the config leaves unset, None, is 0, which the
    config means (vLLM stops at the model's start otherwise: "unsupported operand type(s) for +: 'int' and
    'NoneType'", measured on a tiny Mellum target); key-value heads repeated per expert (VLLM_BACKEND_REPEATED_KV) are
    that many key-value heads."""
    if not built_by_backend(config):
        return {}
    told = {}
    read = next((name for name in BACKEND_MTP_COUNTS if name in config), None)
    if read is not None and config[read] is None:
        told[read] = 0
    names = [name for name in config.get("architectures") or [] if name in VLLM_BACKEND_REPEATED_KV]
    repeats = config.get(VLLM_BACKEND_REPEATED_KV[names[0]]) if names else None
    if repeats and repeats > 1:
        told["num_kv_heads"] = config["num_key_value_heads"] * repeats
    return told


def fused_experts_clash(target_config: dict[str, Any], draft_config: dict[str, Any]) -> Optional[str]:
    """Why vLLM cannot serve a draft model whose HF config is `draft_config` beside the target whose config is
    `target_config` (None: it can): the backend builds both with their experts fused under the same names
    (VLLM_BACKEND_FUSED_EXPERTS)."""
    clashing = [
        next((name for name in config.get("architectures") or [] if name in VLLM_BACKEND_FUSED_EXPERTS), None)
        for config in (target_config, draft_config)
    ]
    if None in clashing:
        return None
    return (
        f"vLLM builds the target ({clashing[0]}) and the draft model ({clashing[1]}) with its Transformers backend, "
        "which registers each one's fused experts under the transformers model's own path (`model.layers.N.mlp."
        "experts`), the draft's as the target's first layers' (Duplicate layer name, at the engine's start)"
    )
