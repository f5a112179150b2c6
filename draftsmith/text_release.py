"""Random targets of a text-only release that transformers reads as a vision-language wrapper's text config and maps to
no model class (draftsmith.causal_lm.text_model_of_a_wrapper; Step-3.5's step3p5): the wrapper module's text model and
an lm_head (draftsmith.text_model_lm.built_text_model_lm), written as such a release ships: its architecture's name, its
tensors under the release's names (the wrapper's checkpoint conversion, reversed as transformers saves a model), and
beside transformers' own config fields the release's (what vLLM's model of the architecture reads), each kept only
where transformers reads the config back the same (draftsmith.declared_fields.reads_back_alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from draftsmith.causal_lm import text_model_of_a_wrapper

# Release fields no transformers field or module tells, by model type: vLLM's Step3p5ForCausalLM asserts the router's
# scores in float32 (transformers' router computes them so) and builds grouped-query attention only; vLLM's
# BailingMoeV3ForCausalLM (Ling-3.0, transformers' bailing_hybrid) builds the head-wise gate on the MLA output, KDA
# without LoRA and projections without biases that transformers' layers always compute only where the release says so
RELEASE_CONSTANTS = {
    "step3p5": {"need_fp32_gate": True, "att_impl_type": "GQA"},
    "bailing_hybrid": {"gated_attention_proj_granularity_type": "head_wise", "no_kda_lora": True, "use_bias": False},
}
# A model type whose releases name another architecture than transformers' class, one vLLM has a model of (vLLM has
# none of transformers' name, and maps its MTP layer to another model), and the fields they carry under vLLM's names
# for transformers' (release name -> transformers field; vLLM's defaults otherwise: 8 experts a token, 8 groups, the
# shared expert 512 wide): Ling-3.0's
RELEASE_FORMS = {
    # Phi-3.5-MoE's releases name vLLM's own class; transformers' name (PhimoeForCausalLM) vLLM builds with its
    # Transformers backend, whose CPU build fails on its routing (an AssertionError at the first forward, measured)
    "phimoe": ("PhiMoEForCausalLM", {}),
    "bailing_hybrid": (
        "BailingMoeV3ForCausalLM",
        {
            "num_experts_per_tok": "num_experts_per_token",
            "n_group": "num_expert_group",
            "moe_shared_expert_intermediate_size": "moe_intermediate_size",  # transformers' width a shared expert
        },
    ),
}
# A model type's release values of transformers fields that build weights its class's default leaves out, where vLLM's
# model always builds them: Phi-3.5-MoE's attention and lm_head biases (vLLM 0.32's PhiMoE builds them whatever the
# config says, and serves a checkpoint without them with the biases unset: token 0 at every step, measured)
RELEASE_WEIGHTS = {"phimoe": {"attention_bias": True, "lm_head_bias": True}}
# what a release says of a router with a score-correction bias (draftsmith.declared_fields.declare_as_released's rule:
# it scores the experts by a sigmoid, and picks them with the bias)
BIASED_ROUTER = {"moe_router_activation": "sigmoid", "use_moe_router_bias": True}
# a release's values of what transformers' router does in its code, with no field for it, keyed by the field that
# marks such routers: one scaled by `moe_router_scaling_factor` renormalises the chosen experts' weights (Step-3.7's)
FIXED_IN_CODE = {"moe_router_scaling_factor": {"norm_expert_weight": True}}

# transformers' own forms of what a release's fields say, which vLLM's config class (of its own transformers) misreads:
# per-layer overrides (`attention_other_setting`'s heads) make it a config whose layers differ, which refuses the global
# head count vLLM builds with; rotary parameters per layer kind (`rope_theta`, `partial_rotary_factors` per layer) it
# takes as one layer's, and fails on
OWN_FORMS = ("per_layer_config", "rope_parameters")


def release_architecture(model_type: str) -> str:
    """The causal LM architecture a release of `model_type` names (`step3p5`: `Step3p5ForCausalLM`, as vLLM
    registers it)."""
    return "".join(part[:1].upper() + part[1:] for part in model_type.split("_")) + "ForCausalLM"


def is_a_text_release(model_type: str) -> bool:
    """Whether a release of `model_type` is a text model of a wrapper (text_model_of_a_wrapper)."""
    return text_model_of_a_wrapper({"model_type": model_type, "architectures": [release_architecture(model_type)]})


def release_config(
    model_type: str, vocab_size: int, special: dict[str, int], sliding_window: Optional[int] = None, **shape: Any
):
    """draftsmith.tiny_config.build_config's config of `model_type`, with what a release sets and the class's default
    leaves out or keeps at full size (`shape` given wins): the shared expert (`share_expert_dim`) as wide as a routed
    one; where the class builds sliding-window layers with heads of their own (`num_sliding_attention_heads`) and a
    window is given, every other layer sliding over `sliding_window` positions, with twice the full ones' heads (so
    the tiny target meets both kinds and both widths, as Step-3.5's do)."""
    from transformers import AutoConfig

    from draftsmith.tiny_config import EXPERTS, TINY, build_config

    default, sizes = AutoConfig.for_model(model_type), {**TINY, **EXPERTS, **shape}
    released: dict[str, Any] = {}
    if hasattr(default, "share_expert_dim"):
        released["share_expert_dim"] = sizes["moe_intermediate_size"]
    apart = hasattr(default, "num_sliding_attention_heads") and sliding_window is not None
    if apart:
        heads = 2 * sizes["num_attention_heads"]
        kinds = ["sliding_attention" if i % 2 else "full_attention" for i in range(sizes["num_hidden_layers"])]
        sliding = {i: {"num_attention_heads": heads} for i, kind in enumerate(kinds) if kind == "sliding_attention"}
        released |= {"layer_types": kinds, "num_sliding_attention_heads": heads, "per_layer_config": sliding}
    config = build_config(model_type, vocab_size, special, sliding_window, **(released | shape))
    if apart and config.sliding_window is None:  # a class whose default has no window (build_config sets one it has)
        config.sliding_window = sliding_window
    rope = config.rope_parameters
    if isinstance(rope, dict) and rope and all(isinstance(params, dict) for params in rope.values()):
        # each layer kind's rotated share given, as transformers reads a release's per-layer lists (1 where unset)
        config.rope_parameters = {kind: {"partial_rotary_factor": 1.0, **params} for kind, params in rope.items()}
    return config


def write_release(model, directory: Path) -> None:
    """Save `model` (built_text_model_lm's) to `directory` as a release of its model type: its tensors under the
    release's names (the wrapper's conversion registered, which saving reverses), its config.json naming the release's
    architecture, with `text_release_fields` beside transformers' own fields; without transformers' own form of what the
    release's fields say (OWN_FORMS), where transformers reads the config back the same without it."""
    from draftsmith.text_model_lm import register_text_conversion

    config = model.config
    register_text_conversion(config)
    model.save_pretrained(directory)
    path = Path(directory) / "config.json"
    written = json.loads(path.read_text())
    written.pop("allow_global_per_layer_attribute_access", None)  # how draftsmith reads the config, not the release's
    config.architectures = written["architectures"] = [release_architecture(config.model_type)]  # saving set its class
    written |= text_release_fields(config, model)
    for form in OWN_FORMS:
        without = {name: value for name, value in written.items() if name != form}
        back = type(config).from_dict(without).to_dict()
        if all(back.get(name) == value for name, value in config.to_dict().items() if name in written):
            written = without
    path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")


def text_release_fields(config, model) -> dict[str, Any]:
    """The fields a release carries beside transformers' own, from what `config` and `model` compute: the aliases of
    its class's `attribute_map` (`num_attention_groups`, `moe_num_experts`, ...); BIASED_ROUTER, FIXED_IN_CODE and
    RELEASE_CONSTANTS; rotary parameters set per layer kind, as per-layer lists (`rope_theta`,
    `partial_rotary_factors`); the layers with experts (`moe_layers_enum`); the sliding layers' heads where they are
    built apart (`attention_other_setting`); a sigmoid gate per attention head (`use_head_wise_attn_gate`)."""
    import torch

    from draftsmith.declared_fields import attention_sizes, reads_back_alike

    fields = config.to_dict()
    out = {alias: fields[name] for alias, name in type(config).attribute_map.items() if name in fields}
    tensors = [name for name, _ in (*model.named_parameters(), *model.named_buffers())]
    out |= BIASED_ROUTER if any(name.endswith("e_score_correction_bias") for name in tensors) else {}
    for field, values in FIXED_IN_CODE.items():
        out |= values if field in fields else {}
    out |= RELEASE_CONSTANTS.get(config.model_type, {})
    kinds, rope = fields.get("layer_types") or [], fields.get("rope_parameters") or {}
    if kinds and all(isinstance(rope.get(kind), dict) for kind in kinds):
        out["rope_theta"] = [rope[kind]["rope_theta"] for kind in kinds]
        out["partial_rotary_factors"] = [rope[kind].get("partial_rotary_factor", 1.0) for kind in kinds]
    mlp = fields.get("mlp_layer_types") or []
    if "sparse" in mlp:
        out["moe_layers_enum"] = ",".join(str(i) for i, kind in enumerate(mlp) if kind == "sparse")
    attentions = [layer.self_attn for layer in model.get_decoder().layers]
    sizes = [attention_sizes(attention) for attention in attentions]
    if {"sliding_attention", "full_attention"} <= set(kinds) and None not in sizes:
        sliding, full = sizes[kinds.index("sliding_attention")], sizes[kinds.index("full_attention")]
        if sliding != full:
            heads, kv_heads, head_dim = sliding[:3]
            out["attention_other_setting"] = {
                "attention_type": "sliding_attention",
                "num_attention_heads": heads,
                "num_attention_groups": kv_heads,
                "head_dim": head_dim,
            }
    gates = [getattr(attention, "g_proj", None) for attention in attentions]
    if None not in sizes and all(
        isinstance(gate, torch.nn.Linear) and gate.out_features == size[0] for gate, size in zip(gates, sizes)
    ):
        out["use_head_wise_attn_gate"] = True
    new = {name: value for name, value in out.items() if name not in fields}
    return {name: value for name, value in new.items() if reads_back_alike(config, {name: value})}


def release_form(config, written: dict[str, Any]) -> dict[str, Any]:
    """`written` (a config.json's fields, of `config`) named and described as `config`'s model type's releases are where
    they name another architecture (RELEASE_FORMS): that architecture, the fields under vLLM's names and
    RELEASE_CONSTANTS', each kept only where transformers reads the config back the same
    (draftsmith.declared_fields.reads_back_alike); `written` itself for another model type."""
    from draftsmith.declared_fields import reads_back_alike

    if config.model_type not in RELEASE_FORMS:
        return written
    architecture, names = RELEASE_FORMS[config.model_type]
    fields = config.to_dict()
    added = {name: fields[field] for name, field in names.items()} | RELEASE_CONSTANTS.get(config.model_type, {})
    kept = {name: value for name, value in added.items() if reads_back_alike(config, {name: value})}
    return written | kept | {"architectures": [architecture]}


def write_release_form(config, directory: Path) -> None:
    """A target saved in `directory` (config.json as transformers wrote it from `config`) in its release's form
    (release_form), where its model type's releases name another architecture; untouched for another model type."""
    if config.model_type not in RELEASE_FORMS:
        return
    path = directory / "config.json"
    path.write_text(json.dumps(release_form(config, json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")
