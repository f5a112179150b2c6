"""How SGLang 0.5.23 reads a target's config.json where it differs from transformers (formats/mtp_sglang.py's
READS_OTHERWISE): for each MTP model SGLang builds, a function of the config.json as shipped (its language model's
fields) and transformers' reading of it (dict form) returning the one-line reason the export refuses sglang, or "".
Each reads the target's config too, so no folder's config mends it. Read from SGLang's source, not run
(docs/results/sglang-0.5.23-mtp-source.md)."""

from __future__ import annotations

import json

from draftsmith.families import FULL, SLIDING


def deepseek_v4_read_otherwise(shipped: dict, loaded: dict) -> str:
    """How SGLang reads a DeepSeek-V4 config.json otherwise than transformers (for the target too, so the folder's
    config cannot mend it), or ""."""
    if shipped.get("sliding_window") != 128:
        return (
            f"attends the last 128 keys (its attention backend's SWA_WINDOW) whatever the config says, and the "
            f"target's sliding_window is {shipped.get('sliding_window')}"
        )
    absent = [key for key in ("swiglu_limit", "routed_scaling_factor", "num_experts_per_tok") if key not in shipped]
    if absent:
        return f"reads the config.json as DeepSeek-V3's, whose defaults are not V4's, and it lacks {', '.join(absent)}"
    if shipped.get("q_head_norm", True) is not True or shipped.get("hc_pre_from_prev_sublayer", False):
        return "reads q_head_norm=false or hc_pre_from_prev_sublayer=true (V4.1's), which transformers' V4 does not"
    return ""


def ernie_read_otherwise(shipped: dict, loaded: dict) -> str:
    """How SGLang's ERNIE-4.5 MTP block reads the config.json otherwise than draftsmith's (vLLM's Llama layer), or
    ""."""
    if shipped.get("use_bias"):
        return "adds biases to the attention's projections and the layer's input projection (use_bias=true)"
    if shipped.get("rope_is_neox_style"):
        return "rotates the target's layers neox-style (rope_is_neox_style=true), transformers' interleaved"
    if shipped.get("partial_rotary_factor", 1.0) != 1.0:
        return f"rotates a part of each head (partial_rotary_factor={shipped['partial_rotary_factor']})"
    if shipped.get("hidden_act", "silu") != "silu":
        return f"runs SiLU MLPs only (hidden_act={shipped['hidden_act']})"
    return ""


# The layer kinds SGLang's Nemotron-H config accepts (transformers writes the attention and Mamba kinds otherwise)
NEMOTRON_H_KINDS = ("mamba", "attention", "mlp", "moe")


def nemotron_h_read_otherwise(shipped: dict, loaded: dict) -> str:
    """How SGLang reads a Nemotron-H config.json otherwise than transformers, or ""."""
    kinds = {kind for key in ("layers_block_type", "mtp_layers_block_type") for kind in shipped.get(key) or ()}
    if kinds - set(NEMOTRON_H_KINDS):
        return (
            f"accepts the layer kinds {', '.join(NEMOTRON_H_KINDS)} and refuses the config.json's "
            f"{', '.join(sorted(kinds - set(NEMOTRON_H_KINDS)))} (transformers' names; releases ship "
            "hybrid_override_pattern), the target's too"
        )
    if shipped.get("sliding_window") is not None:
        return f"attends a window of sliding_window={shipped['sliding_window']} keys, which transformers ignores"
    if shipped.get("n_shared_experts", 1) != 1:
        return f"builds its shared expert n_shared_experts={shipped['n_shared_experts']} times wide, transformers once"
    if shipped.get("mlp_hidden_act", "relu2") != "relu2" or shipped.get("mlp_bias"):
        return "builds its shared expert with ReLU² and no biases (mlp_hidden_act, mlp_bias)"
    return ""


def ling_read_otherwise(shipped: dict, loaded: dict) -> str:
    """Where SGLang's Bailing NextN reads a Ling-3.0 config.json (its own config class: its keys and defaults) as
    another value than transformers' target (`loaded`) computes with, or "": its routing (SGLang routes by softmax
    without the expert bias, unrenormalised, unless told), experts, the MLA layer's rotation, gate and norms' eps, the
    Ling-3.0 layer itself (else Ling-2.5's), and the clamp of its experts (entry 0 of the lists; draftsmith trains the
    layer unclamped, as vLLM serves it)."""
    default_shared = loaded["moe_intermediate_size"] * shipped.get("num_shared_experts", 1)
    readings = (  # (key, SGLang's value, transformers')
        ("model_type", shipped.get("model_type"), loaded["model_type"]),
        ("short_conv_kernel_size", shipped.get("short_conv_kernel_size"), loaded["short_conv_kernel_size"]),
        ("moe_router_enable_expert_bias", shipped.get("moe_router_enable_expert_bias", False), True),
        ("norm_topk_prob", shipped.get("norm_topk_prob", False), loaded["moe_renormalize"]),
        ("routed_scaling_factor", shipped.get("routed_scaling_factor", 1.0), loaded["routed_scaling_factor"]),
        ("n_group", shipped.get("n_group", 8), loaded["num_expert_group"]),
        ("topk_group", shipped.get("topk_group", 4), loaded["topk_group"]),
        ("num_experts", shipped.get("num_experts", 256), loaded["num_experts"]),
        ("num_experts_per_tok", shipped.get("num_experts_per_tok", 8), loaded["num_experts_per_token"]),
        (
            "moe_shared_expert_intermediate_size",
            shipped.get("moe_shared_expert_intermediate_size", default_shared),
            loaded["moe_intermediate_size"] * loaded["num_shared_experts"],
        ),
        ("gated_attention_proj_granularity_type", shipped.get("gated_attention_proj_granularity_type"), "head_wise"),
        ("rope_interleave", shipped.get("rope_interleave", True), True),
        ("rms_norm_eps", shipped.get("rms_norm_eps", 1e-6), 1e-6),  # transformers' MLA layernorms' eps
        ("expert_swiglu_limit_list[0]", (shipped.get("expert_swiglu_limit_list") or [0])[0] or 0, 0),
        ("share_expert_swiglu_limit_list[0]", (shipped.get("share_expert_swiglu_limit_list") or [0])[0] or 0, 0),
    )
    return first_read_otherwise(readings, shipped)


def first_read_otherwise(readings: tuple, shipped: dict) -> str:
    """The first of `readings` ((key, SGLang's value, transformers') read from the config.json `shipped`) whose values
    differ, as a reason, or ""."""
    for key, sglangs, transformers in readings:
        if sglangs != transformers:
            default = " (its default: the config.json lacks it)" if key.split("[")[0] not in shipped else ""
            return (
                f"reads {key} as {json.dumps(sglangs)}{default}, where draftsmith (transformers) computes the layer "
                f"with {json.dumps(transformers)}"
            )
    return ""


def hy_v4_read_otherwise(shipped: dict, loaded: dict) -> str:
    """How SGLang's HY-V4 NextN (its own config class) computes the layer otherwise than transformers' config says, or
    ""."""
    if loaded["mlp_layer_types"][-1] != "sparse":
        return "builds the layer with experts, and draftsmith (vLLM) the target's last layer's dense MLP"
    n_group, topk_group = loaded.get("n_group"), loaded.get("topk_group")
    if (n_group, topk_group) != (1, 1):
        return f"routes ungrouped (it sets n_group and topk_group to 1; the target's: {n_group}, {topk_group})"
    if (loaded.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        return "rotates with DeepSeek's YaRN whatever rope_type the config names"
    return ""


# SGLang's QSA indexer: its top-k kernel (fast_topk_v2) selects 512 or 2048 blocks (layers/attention/qsa/config.py),
# whole blocks on its 64-key pages (model_overrides/qwen4_exp.py, mem_cache/qsa_kv_pool.py, qsa/mqa.py): of 2, 4 or 8
QSA_BLOCKS_SELECTED = (512, 2048)
QSA_BLOCK_SIZES = (2, 4, 8)


def qwen4_exp_read_otherwise(shipped: dict, loaded: dict) -> str:
    """How SGLang's Qwen4-Exp (a Qwen3-Next text config: other defaults) reads the config.json otherwise than
    transformers, or builds another layer than draftsmith trained (its QSA indexer's limits), or ""."""
    rope = shipped.get("rope_parameters") or {}
    sglangs_rotary = shipped.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    rotary = (loaded.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0)
    readings = (  # (key, SGLang's value, transformers')
        ("partial_rotary_factor", sglangs_rotary, rotary),
        ("vocab_size", shipped.get("vocab_size", 151936), loaded["vocab_size"]),
    )
    why = first_read_otherwise(readings, shipped)
    if why:
        return why
    blocks, size = loaded["indexer_budget"] // loaded["indexer_compress_ratio"], loaded["indexer_compress_ratio"]
    if blocks not in QSA_BLOCKS_SELECTED or loaded["indexer_budget"] % size or size not in QSA_BLOCK_SIZES:
        return (
            f"selects {' or '.join(map(str, QSA_BLOCKS_SELECTED))} blocks of {', '.join(map(str, QSA_BLOCK_SIZES))} "
            f"keys (indexer_budget / indexer_compress_ratio), and the target {blocks} of {size}"
        )
    if loaded["indexer_kv_heads"] != 1 or int(loaded["head_dim"] * rotary) > loaded["indexer_head_dim"]:
        return "builds its QSA indexer with one key head rotating at most indexer_head_dim channels"
    if loaded["hidden_act"] != "silu":
        return f"runs SiLU experts only (hidden_act={loaded['hidden_act']})"
    if loaded.get("attention_bias"):
        return "builds its attention without biases (attention_bias=true) and its loader drops them without a word"
    if loaded.get("tie_word_embeddings"):
        return "leaves its own lm_head unset where the target ties it to the embedding (tie_word_embeddings=true)"
    return ""


# The model type of the Dots3-Note release's flat config.json: the only one SGLang's Dots3Config reads (its pinned
# transformers 5.19 knows neither it nor transformers' own `dots3_note_text`)
DOTS3_RELEASE_MODEL_TYPE = "dots3_note"


def dots3_note_read_otherwise(shipped: dict, loaded: dict) -> str:
    """How SGLang's Dots3Config (read from a release's flat config.json, model_type dots3_note: its pinned transformers
    knows no other) reads it otherwise than transformers, or cannot, or "": its MTP block is always a sliding-window
    layer of the `swa_*` geometry, which the target's sliding layers read too."""
    transformers_form = {"per_layer_config", "rope_parameters"} & set(shipped)
    if shipped.get("model_type") != DOTS3_RELEASE_MODEL_TYPE or transformers_form:
        return (
            f"reads a release's flat config.json only (model_type {DOTS3_RELEASE_MODEL_TYPE}, its swa_* keys), and the "
            f"target's is transformers' form ({shipped.get('model_type')}, per_layer_config, rope_parameters)"
        )
    kinds = set(shipped.get("layer_types") or ["none"])
    if kinds - {SLIDING, FULL} or shipped.get("rope_scaling"):
        return "builds the target's layers from layer_types of full_attention and sliding_attention, unscaled rope"
    if (shipped.get("mtp_layer_types") or [SLIDING])[0] != SLIDING:
        return f"builds the layer with sliding-window attention, and mtp_layer_types names {shipped['mtp_layer_types']}"
    if shipped.get("attention_bias") or loaded["hidden_act"] != "silu":
        return "builds its attention without biases and SiLU MLPs only (attention_bias, hidden_act)"
    if shipped.get("apply_mla_qkv_lora_rescale", True) is not True:
        return "leaves the latents unscaled (apply_mla_qkv_lora_rescale=false), which transformers always scales"
    if shipped.get("swa_attention_gate_type", "headwise") != "headwise":
        return f"gates the attention {shipped['swa_attention_gate_type']}, transformers per head"
    sliding = {**loaded, **loaded["per_layer_config"][str(loaded["layer_types"].index(SLIDING))]}
    defaults = {"num_attention_heads": 32, "num_key_value_heads": 32, "q_lora_rank": 512, "kv_lora_rank": 512}
    defaults |= {"qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}  # Dots3Config's swa_* defaults
    readings = (  # (key, SGLang's value, transformers')
        ("hidden_size", shipped.get("hidden_size", 2560), loaded["hidden_size"]),
        ("intermediate_size", shipped.get("intermediate_size", 7168), loaded["intermediate_size"]),
        ("vocab_size", shipped.get("vocab_size", 152064), loaded["vocab_size"]),
        ("sliding_window_size", shipped.get("sliding_window_size", 512), loaded["sliding_window"]),
        *((f"swa_{key}", shipped.get(f"swa_{key}", value), sliding[key]) for key, value in defaults.items()),
        (
            "swa_rope_theta",
            shipped.get("swa_rope_theta", shipped.get("rope_theta", 50000.0)),
            loaded["rope_parameters"][SLIDING]["rope_theta"],
        ),
    )
    return first_read_otherwise(readings, shipped)


# Model -> how it reads the target's config.json (as shipped; transformers' reading of it, dict form, beside) otherwise
# than draftsmith trained on, or ""
READS_OTHERWISE = {
    "DeepseekV4ForCausalLMNextN": deepseek_v4_read_otherwise,
    "Ernie4_5_MoeForCausalLMMTP": ernie_read_otherwise,
    "NemotronHForCausalLMMTP": nemotron_h_read_otherwise,
    "BailingMoeForCausalLMNextN": ling_read_otherwise,
    "HYV4ForCausalLMNextN": hy_v4_read_otherwise,
    "Qwen4ExpForCausalLMMTP": qwen4_exp_read_otherwise,
    "Dots3NoteForCausalLMNextN": dots3_note_read_otherwise,
}
