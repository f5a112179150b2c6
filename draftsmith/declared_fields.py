"""The config fields a released checkpoint declares for what transformers' class computes in code, which engines read
instead (`declare_as_released`): a random target written with them is laid out as its family's releases are, so the
engine builds the model transformers runs. Each field is kept only where transformers reading the config back builds
the same config (`reads_back_alike`)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from huggingface_hub.errors import StrictDataclassError


def declare_as_released(config, model) -> None:
    """Add the config fields released checkpoints carry for what transformers' class always computes,
    which engines read instead (vLLM routes with a softmax and no bias, or fails on a missing field,
    without them): a router with a score-correction bias scores experts by a sigmoid and picks them
    with the bias (`noaux_tc` where the experts are grouped); the rotary embedding's width (`rotary_dim`,
    which the engines that read it take as transformers' head_dim × partial factor); an embedding normed before the
    layers and scales learned on the MLPs and routers (`use_embed_norm`, `use_global_scale`: vLLM's Inkling builds
    neither without them, transformers' always does); a router scaled by `route_scale` whose bias is an MLP's
    `expert_bias` (EXPERT_BIAS_ROUTER); and `release_fields`' (a field the class already has is kept)."""
    tensors = [name for name, _ in (*model.named_buffers(), *model.named_parameters())]
    if any(name.endswith("e_score_correction_bias") for name in tensors):
        config.scoring_func, config.use_routing_bias = "sigmoid", True
        if getattr(config, "n_group", None):
            config.topk_method = "noaux_tc"
    if hasattr(config, "route_scale") and any(name.endswith("mlp.expert_bias") for name in tensors):
        for name, value in EXPERT_BIAS_ROUTER.items():
            setattr(config, name, getattr(config, name, value))
    if hasattr(model.get_input_embeddings(), "embed_norm"):
        config.use_embed_norm = True
    if any(name.endswith("global_scale") for name, _ in model.named_parameters()):
        config.use_global_scale = True
    fields = config.to_dict()  # global values: a field set per layer (Gemma-4's head_dim) raises as an attribute
    factor = rotary_share(fields.get("rope_parameters") or {})
    head_dim = fields.get("head_dim")
    if isinstance(head_dim, int) and factor is not None and fields.get("rotary_dim") is None:
        config.rotary_dim = int(head_dim * factor)
    for name, value in release_fields(config, model).items():
        setattr(config, name, value)


# what a release says of a router scaled by `route_scale` whose picking bias is its MLP's `expert_bias` (AFMoE's; not
# LFM2-MoE's, whose `norm_topk_prob` says whether it renormalises, nor Inkling's), which transformers' code
# always scores by a sigmoid, renormalising the chosen experts' weights, in one group: vLLM's model reads each of these
# fields (and fails without one, "'AfmoeConfig' object has no attribute 'score_func'")
EXPERT_BIAS_ROUTER = {"score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1}


def rotary_share(rope: dict[str, Any]) -> Optional[float]:
    """The share of each head the rotary embedding turns (`partial_rotary_factor`, 1 where unset): of the parameters
    themselves, or the one all layer kinds' parameters agree on where they are set per layer kind (MiMo-V2's); None
    where those differ (no one width describes the model)."""
    kinds = [value for value in rope.values() if isinstance(value, dict)]
    shares = {kind.get("partial_rotary_factor", 1.0) for kind in kinds} or {rope.get("partial_rotary_factor", 1.0)}
    return shares.pop() if len(shares) == 1 else None


# Release fields that are another name of a transformers field (MiMo-V2's `layernorm_epsilon`, HY-V3's
# `expert_hidden_dim`; vLLM's HY-V3 and AFMoE read `route_norm` where transformers says `norm_topk_prob`)
RELEASE_NAMES = {
    "layernorm_epsilon": "rms_norm_eps",
    "expert_hidden_dim": "moe_intermediate_size",
    "route_norm": "norm_topk_prob",
}
# Release fields whose value a transformers class fixes in its code, with no field for it, keyed by the field that
# marks such classes: a router scaled by `router_scaling_factor` without a `norm_topk_prob` switch always
# renormalises the chosen experts' weights (HY-V3's, Step-3.7's), which vLLM's HY-V3 reads as `route_norm`
FIXED_IN_CODE = {"router_scaling_factor": {"route_norm": True}}


def release_fields(config, model) -> dict[str, Any]:
    """The fields a release carries in place of transformers' own, derived from what the config and `model` compute,
    each kept only where transformers reading it back builds the same config (`reads_back_alike`): RELEASE_NAMES and
    FIXED_IN_CODE; query-key norms in every attention (`qk_norm`, which transformers' layers always compute); the
    dense layers before the first with experts (`first_k_dense_replace`, of `mlp_layer_types`); the window under the
    name the class reads it from (`sliding_window_size`, by the class's own conversion); and where sliding layers are
    built apart from full ones (`sliding_layers_apart`), the release's per-layer form of them."""
    fields = config.to_dict()
    out: dict[str, Any] = {name: fields[field] for name, field in RELEASE_NAMES.items() if field in fields}
    for field, values in FIXED_IN_CODE.items():
        out |= {name: value for name, value in values.items() if field in fields and name not in out}
    attentions = [module for name, module in model.named_modules() if name.endswith("self_attn")]
    if attentions and all(hasattr(attention, "q_norm") and hasattr(attention, "k_norm") for attention in attentions):
        out["qk_norm"] = True
    kinds = fields.get("mlp_layer_types")
    if isinstance(kinds, list) and "dense" in kinds:
        dense = next((i for i, kind in enumerate(kinds) if kind != "dense"), len(kinds))
        if "dense" not in kinds[dense:]:  # dense layers first, then none: what the one number says
            out["first_k_dense_replace"] = dense
    window = fields.get("sliding_window")
    if isinstance(window, int):
        # the class's own name for the window, where it derives `sliding_window` from one (MiMo-V2's: one more)
        read = [size for size in (window, window - 1) if reads_window_as(config, size) == window]
        out |= {"sliding_window_size": read[0]} if read else {}
    out |= sliding_layers_apart(fields, model)
    new = {name: value for name, value in out.items() if name not in fields and not hasattr(config, name)}
    return {name: value for name, value in new.items() if reads_back_alike(config, {name: value})}


def reads_window_as(config, size: int) -> Any:
    """The `sliding_window` transformers' class sets when a release gives `sliding_window_size` = `size` (and some
    other `sliding_window`, which it is then derived from `size` or not at all)."""
    back = read_back(config, {"sliding_window": -1, "sliding_window_size": size})
    return None if back is None else back.sliding_window


def reads_back_alike(config, added: dict[str, Any]) -> bool:
    """Whether transformers reading `config` back with the fields `added` builds the same config (a field it reads
    as another of its own, a legacy `rope_theta` into the rotary parameters, would change the target it runs)."""
    back = read_back(config, added)
    fields = config.to_dict()
    return back is not None and {name: v for name, v in back.to_dict().items() if name not in added} == fields


def read_back(config, changed: dict[str, Any]):
    """`config` as transformers reads it from a config.json with the fields `changed`; None where its class refuses
    them (its own checks of a field's type or range)."""
    try:
        return type(config).from_dict({**config.to_dict(), **changed})
    except (StrictDataclassError, TypeError, ValueError):
        return None


def sliding_layers_apart(fields: dict[str, Any], model) -> dict[str, Any]:
    """Where a family builds its sliding-window layers apart from its full-attention ones (other heads, or attention
    sinks on one kind only: MiMo-V2's twice the key-value heads and sinks), the fields its release describes them by
    (vLLM's MiMo-V2 reads them): each layer's kind (`hybrid_layer_pattern`, 1 for sliding) and MLP (`moe_layer_freq`,
    1 for experts), the sliding layers' heads and sinks (`swa_*`, `add_*_attention_sink_bias`), as the model's
    modules are; the norms' epsilon; and the rotary parameters set per layer kind as fields (`rope_theta`,
    `swa_rope_theta`, their shared `partial_rotary_factor`). Nothing for any other family."""
    kinds, layers = fields.get("layer_types"), getattr(model.base_model, "layers", None)
    if not (isinstance(kinds, list) and {"sliding_attention", "full_attention"} <= set(kinds) and layers is not None):
        return {}
    built = {
        kind: attention_sizes(layers[kinds.index(kind)].self_attn) for kind in ("sliding_attention", "full_attention")
    }
    sliding, full = built["sliding_attention"], built["full_attention"]
    if sliding is None or full is None or sliding == full:
        return {}
    out = {"hybrid_layer_pattern": [int(kind == "sliding_attention") for kind in kinds]}
    if isinstance(fields.get("mlp_layer_types"), list):
        out["moe_layer_freq"] = [int(kind != "dense") for kind in fields["mlp_layer_types"]]
    heads, kv_heads, head_dim, value_dim, sinks = sliding
    out |= {"swa_num_attention_heads": heads, "swa_num_key_value_heads": kv_heads, "swa_head_dim": head_dim}
    out |= {"swa_v_head_dim": value_dim, "add_swa_attention_sink_bias": sinks, "add_full_attention_sink_bias": full[-1]}
    rope = fields.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict) and isinstance(rope.get("sliding_attention"), dict):
        out |= {
            "rope_theta": rope["full_attention"]["rope_theta"],
            "swa_rope_theta": rope["sliding_attention"]["rope_theta"],
        }
        share = rotary_share(rope)
        out |= {"partial_rotary_factor": share} if share is not None else {}
    return out


def attention_sizes(attention) -> Optional[tuple[int, int, int, int, bool]]:
    """An attention module's query heads, key-value heads, key and value widths and whether it has sinks, as its
    projections are built; None for one without separate query, key and value projections."""
    projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    head_dim = getattr(attention, "head_dim", None)
    if not isinstance(head_dim, int) or not all(isinstance(p, torch.nn.Linear) for p in projections):
        return None
    query, key, value = (p.out_features for p in projections)
    kv_heads = key // head_dim
    sinks = any(name.split(".")[-1] in ("sinks", "attention_sink_bias") for name, _ in attention.named_parameters())
    return query // head_dim, kv_heads, head_dim, value // kv_heads, sinks
