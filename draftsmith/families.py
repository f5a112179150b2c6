"""What draftsmith knows about target families, read from the model's own config (never from a list
of model names), and the decoder-layer families a drafter's own layers can be built from.

A target family that transformers implements needs nothing here: every stage reads the target
through transformers' own outputs (`output_hidden_states`, the model's mask construction, its
cache). The two things that do differ between families, and that a stage must know, are:

- each decoder layer's attention kind (`layer_types`): full attention, sliding-window attention
  (Mistral, Gemma-2/3, gpt-oss, Qwen with `use_sliding_window`), or another kind (linear attention in
  hybrid models such as Qwen3-Next), which decides how the eval loop masks a draft and which layers
  may be tapped for features;
- the shape fields a drafter's own decoder layers take from the target (hidden size, heads, head
  dimension, norm epsilon, RoPE).

A drafter's own layers (EAGLE-1/3, DFlash) are a *choice*, `drafter.layer_family`, not an accident of
the target: a serving engine builds them from the family its format names, whatever the target is.
vLLM and SGLang build Llama layers for an EAGLE drafter of any target (what SpecForge and speculators
train for Qwen, gpt-oss, Kimi); vLLM also builds Qwen3 layers (`Eagle3Qwen3ForCausalLM`, and every
DFlash drafter), and Gemma-4 layers for a DSpark drafter (`Gemma4DSparkModel`). `DRAFT_LAYER_FAMILIES` lists
the families a drafter can be built from.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from draftsmith.errors import UserError

FULL = "full_attention"
SLIDING = "sliding_attention"
INDEXED = "indexed_attention"  # sparse attention over keys an indexer picks (DeepSeek-V3.2): its keys too
# sparse attention over blocks of keys an indexer picks, counted from the cache's first slot (MiniMax-M3's kind of its
# own name, told by its config's `index_block_size`): a draft's tokens must sit at their positions' slots, so a draft
# is a chain and rows decode one at a time (left padding would move the blocks); its keys are cut like any others
BLOCK_INDEXED = "block_indexed_attention"
# attention after short convolutions over the last few tokens (transformers' `hybrid` and `hybrid_sliding` cache
# kinds, Inkling's): keys cut like any others, the convolutions' windows a state read in order
CONVOLVED = ("hybrid", "hybrid_sliding")
# attention within fixed chunks of positions (Llama-4's local layers): kept full-length as a sliding layer is
# (caches.new_cache), its keys cut like any others, other chunks' keys hidden by a tree's or a batch's mask
CHUNKED = "chunked_attention"
# the kinds whose keys the eval loop can crop and gather
ATTENTION_KINDS = (FULL, SLIDING, CHUNKED, INDEXED, BLOCK_INDEXED, *CONVOLVED)
LINEAR = "linear_attention"  # a recurrent state (Gated DeltaNet): the eval loop copies it and puts it back
# short convolutions alone (LFM2's): transformers keeps their windows in linear attention's cache layer, a state read
# in order and put back after a rejected draft; no keys
CONV = "conv"
# attention over entries pooled from several positions (DeepSeek-V4's compressed sparse and heavily compressed
# attention): no entry can be cut back to a position, so the eval loop keeps the cache's state and puts it back
COMPRESSED = ("compressed_sparse_attention", "heavily_compressed_attention")
# the kinds whose keys or states the eval loop rolls back after a rejected draft
ROLLED_BACK = (*ATTENTION_KINDS, LINEAR, CONV, *COMPRESSED)


def config_field(config: Any, key: str, default=None):
    """A field of a config object or of its dict."""
    if isinstance(config, dict):
        return config.get(key, default)
    try:
        return getattr(config, key, default)
    except RuntimeError as err:  # a field set per layer (Gemma-4's head_dim): the config's global value
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError":
            raise
        return config.to_dict().get(key, default)


def text_config(config: Any) -> Any:
    """The language model's config of a multimodal wrapper (its `text_config`), else the config."""
    text = config_field(config, "text_config")
    return text if text is not None and config_field(config, "hidden_size") is None else config


def own_layer_kinds(config_class) -> list[str]:
    """The layer kinds whose cache layers a family's modeling module defines (transformers registers them by kind
    when the module is imported: MiniMax-M3's sparse attention), none where it has no such module."""
    import importlib

    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    name = config_class.__module__.replace(".configuration_", ".modeling_")
    try:
        importlib.import_module(name)
    except ImportError:
        return []
    return [kind for kind, layer in DYNAMIC_LAYER_TYPE_MAPPING.items() if layer.__module__ == name]


def even_rotary_share(rope: dict[str, Any], head: int) -> dict[str, Any]:
    """Rotary parameters (`rope`, or each layer kind's in it) whose `partial_rotary_factor` turns an even number of a
    `head`-wide head's channels: the engines rotate `int(head × factor)` channels in pairs, where transformers rotates
    the next even number (MiMo-V2's 0.334 of 64: 21 against 22); an odd count is rounded up to that even one."""
    if any(isinstance(value, dict) for value in rope.values()):
        return {
            kind: even_rotary_share(value, head) if isinstance(value, dict) else value for kind, value in rope.items()
        }
    channels = int(head * rope.get("partial_rotary_factor", 1.0))
    return rope if channels % 2 == 0 else {**rope, "partial_rotary_factor": (channels + 1) / head}


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's attention kind. The config's own `layer_types` where the family has them
    (transformers derives them from `sliding_window`, `use_sliding_window`, `max_window_layers`,
    `sliding_window_pattern`); else sliding-window attention on every layer when the config sets a
    window (Mistral), full attention otherwise."""
    config = text_config(config)
    types = config_field(config, "layer_types")
    if types:
        blocks = config_field(config, "index_block_size") is not None
        return [BLOCK_INDEXED if blocks and kind not in (FULL, SLIDING) else str(kind) for kind in types]
    window = config_field(config, "sliding_window")
    uses_window = window is not None and config_field(config, "use_sliding_window", True) is not False
    return [SLIDING if uses_window else FULL] * int(config_field(config, "num_hidden_layers"))


def reads_in_order(config: Any) -> bool:
    """Whether some layer reads a draft's tokens in order: it folds them into a state instead of keys one per
    position, a recurrent state (linear attention) or pooled entries (compressed attention), where a rejected draft
    is undone by putting the state back and feeding the accepted tokens again; or it picks blocks of keys counted
    from the cache's first slot (block-sparse attention), whose keys are cut back as any others; or it convolves
    the last few tokens before its attention (a state put back, its keys cut), or alone (a state put back)."""
    return bool({LINEAR, CONV, *COMPRESSED, BLOCK_INDEXED, *CONVOLVED} & set(layer_types(config)))


def largest_eval_batch(eval_section: Any) -> int:
    """The most prompts the eval decodes together: eval.batch_size, or the largest of its eval.batch_sizes sweep."""
    sweep = config_field(eval_section, "batch_sizes", None) or []
    return max([int(config_field(eval_section, "batch_size", 1)), *map(int, sweep)])


def check_eval_settings(config: Any, eval_section: Any) -> None:
    """What draftsmith's eval loop can decode on this target, checked before a run or an eval starts:
    a recurrent state, pooled entries or key blocks read a draft's tokens in order (chains only), and no padding may
    pass through them (the loop decodes its rows one at a time, so a batch's speed cannot be measured)."""
    if not reads_in_order(config):
        return
    if int(config_field(eval_section, "tree", 0)) > 0:
        raise UserError(
            "eval.tree: a target with linear-, compressed-, block-sparse or convolved attention layers verifies chains "
            "only (they read a draft's tokens in order, so a tree's branches would see each other): set eval.tree=0"
        )
    if largest_eval_batch(eval_section) > 1:
        raise UserError(
            "eval.batch_size / eval.batch_sizes: the eval loop decodes a target with linear-, compressed-, "
            "block-sparse or convolved attention layers one prompt at a time (no padding may pass through them), so "
            "it cannot measure a batch: set eval.batch_size=1 eval.batch_sizes=[]"
        )


def masks_of_every_kind(config: Any, masks: dict) -> dict:
    """Masks given per layer kind (full and sliding-window attention's), with one for every kind the model's layers
    have, under the names its config gives them: a kind given none attends as full attention does (Dots3-Note's
    indexed layers beside its sliding ones: their indexer picks among the keys that mask lets through)."""
    kinds = config_field(text_config(config), "layer_types") or ()
    return {kind: masks.get(kind, masks[FULL]) for kind in kinds} | masks


def sliding_window(config: Any) -> Optional[int]:
    """The number of positions a sliding-window layer sees (itself included), None without one."""
    config = text_config(config)
    return int(config_field(config, "sliding_window")) if SLIDING in layer_types(config) else None


def attention_chunk(config: Any) -> Optional[int]:
    """The positions of a chunked-attention layer's chunks (`attention_chunk_size`), None without one."""
    return int(config_field(text_config(config), "attention_chunk_size")) if CHUNKED in layer_types(config) else None


def layer_window(config: Any, index: int = 0) -> Optional[int]:
    """Layer `index`'s sliding window as its config states it, dict or config (`sliding_window` where `layer_types`
    makes the layer "sliding_attention"), as vLLM reads a draft layer's config; None: a full-attention layer."""
    kinds, window = config_field(config, "layer_types") or [], config_field(config, "sliding_window")
    return int(window) if index < len(kinds) and kinds[index] == SLIDING and window is not None else None


# The release field whose entry i (> 0; else none) vLLM 0.32 clamps decoder layer i's SwiGLU inputs by: its dense or
# shared-expert MLP, its routed experts (on GPUs: vLLM-CPU's fused experts take no limit), and an MTP block built as
# layer j (entry j). A transformers config class declaring it has its model clamp alike (Step-3.5's text config); one
# that does not keeps it as an extra its model never reads (Exaone-MoE's) and computes every layer unclamped.
CLAMP_FIELD = "swiglu_limits"


def clamp_lists(values: Mapping[str, Any]) -> list[str]:
    """The keys of a config's dict that hold per-layer SwiGLU limits: CLAMP_FIELD, and the names a release gives its
    own (Ling-3.0's `expert_swiglu_limit_list` and `share_expert_swiglu_limit_list`, which transformers 5.25 and later
    read as `swiglu_limits` and `swiglu_limits_shared`)."""
    return [key for key, value in values.items() if "swiglu_limit" in key and isinstance(value, list)]


def unserved_clamp(config: Any, name_or_path: str) -> Optional[str]:
    """Why draftsmith cannot run the target vLLM serves for `config` (a config.json's dict or transformers' config), in
    one line: it clamps some decoder layer's SwiGLU (CLAMP_FIELD), which transformers' class for it does not declare;
    None where both compute alike, or where the class is not known yet (remote code: checked once its config loads)."""
    text = text_config(config)
    limits = config_field(text, CLAMP_FIELD)
    if not isinstance(limits, list):
        return None
    # vLLM reads one entry per decoder layer
    read = limits[: int(config_field(text, "num_hidden_layers") or len(limits))]
    layers = [index for index, limit in enumerate(read) if isinstance(limit, (int, float)) and limit > 0]
    if not layers:  # before transformers' import (a second of every recipe check)
        return None
    import inspect

    from transformers import CONFIG_MAPPING

    model_type = config_field(text, "model_type")
    known = isinstance(text, dict) and isinstance(model_type, str) and model_type in CONFIG_MAPPING
    config_class = type(text) if not isinstance(text, dict) else CONFIG_MAPPING[model_type] if known else None
    if config_class is None:
        return None
    # a field the class declares under its own name or under a release's (its attribute_map: Ling-3.0's)
    if CLAMP_FIELD in {*inspect.signature(config_class.__init__).parameters, *config_class.attribute_map}:
        return None
    return (
        f"cannot load target {name_or_path!r}: its config's {CLAMP_FIELD} clamps the SwiGLU of decoder layers {layers} "
        f"(and of an MTP block j built as layer j) where vLLM 0.32 reads it, and transformers' {config_class.__name__} "
        f"declares no {CLAMP_FIELD} (its model computes them unclamped): draftsmith would train and measure its "
        "drafter on another target than vLLM serves"
    )


def within_window(query_positions, key_positions, window: int):
    """Whether a key is inside a query's sliding window of `window` positions (its own included), as
    vLLM's and transformers' sliding-window attention count it: key position > query position - window.
    Broadcasts its (tensor) arguments."""
    return key_positions > query_positions - window


def within_chunk(query_positions, key_positions, chunk: int):
    """Whether a key is in its query's chunk of `chunk` positions, as transformers' chunked attention counts them
    (positions 0..chunk-1 the first). Broadcasts its (tensor) arguments."""
    return key_positions // chunk == query_positions // chunk


def attention_layers(config: Any) -> list[int]:
    """The layers whose kind is (full, sliding-window or indexed) attention: where a drafter may tap features
    by default. Linear-attention layers of a hybrid target (Qwen3-Next) are left out."""
    return [index for index, kind in enumerate(layer_types(config)) if kind in ATTENTION_KINDS]


def norm_eps(config: Any) -> float:
    for key in ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon"):
        value = config_field(config, key)
        if value is not None:
            return float(value)
    return 1e-6


def rope_theta(config: Any) -> float:
    """The target's RoPE base (of its full-attention layers where the family sets one per kind)."""
    params = config_field(config, "rope_parameters") or config_field(config, "rope_scaling") or {}
    if isinstance(params, dict) and FULL in params:
        params = params[FULL]
    theta = (params or {}).get("rope_theta") if isinstance(params, dict) else None
    return float(theta or config_field(config, "rope_theta") or 10000.0)


# Scaled RoPE kinds the engines' Llama/Qwen3 layers read exactly as transformers computes them;
# other kinds (yarn with per-family extras, per-layer-kind dicts) give the draft layers plain RoPE
# with the target's base: a drafter's positions are its own, and the export writes what it was trained with.
PORTABLE_ROPE = ("default", "linear", "llama3")
# The keys of those kinds. Nothing else is carried over: a target's `partial_rotary_factor` (Qwen3.5, GLM-4.5)
# is ignored by transformers' Llama and Qwen3 rotary embeddings, which rotate every dimension, and read by
# vLLM's, which would rotate a quarter of them: the draft layers rotate every dimension, in both.
PORTABLE_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def draft_rope(config: Any) -> dict[str, Any]:
    params = config_field(config, "rope_parameters") or config_field(config, "rope_scaling")
    kind = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
    if kind in PORTABLE_ROPE:
        return {key: params[key] for key in PORTABLE_ROPE_KEYS if key in params} | {
            "rope_type": kind,
            "rope_theta": rope_theta(config),
        }
    return {"rope_type": "default", "rope_theta": rope_theta(config)}


@dataclass(frozen=True)
class LayerFamily:
    """A family a drafter's own decoder layers are built from: its transformers config class, layer
    and rotary classes (qualified names, imported only from transformers), and the config keys only its
    layers read (`own_config`: what makes them the plain layers `config` promises)."""

    model_type: str
    config_class: str
    layer: str
    rotary: str
    own_config: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # a family whose config sets RoPE and head shapes per layer kind (Gemma-4's, Laguna's): every draft layer is a
    # full-attention layer, its RoPE and heads the ones `config` gives
    per_kind: bool = False
    # config keys set per layer, each layer the one value given here (Laguna's MLP kind: every draft layer dense)
    per_layer: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # the one engine model that builds draft layers of this family (vLLM's class, written by one drafter kind's
    # export, which declares it: heads/dflash_config.py ENGINE_MODELS); empty: every kind's engine models build them
    engine_model: str = ""

    def config(self, target_config: Any, num_layers: int) -> dict[str, Any]:
        """The draft layers' config: the target's shape (hidden size, heads, head dimension, MLP width,
        norm epsilon, RoPE base, context length, vocabulary), plain SiLU layers without biases or
        sliding windows, `num_layers` of them; nothing else from the target's family."""
        target = text_config(target_config)
        hidden, heads = int(config_field(target, "hidden_size")), int(config_field(target, "num_attention_heads"))
        width = config_field(target, "intermediate_size")
        width = width[-1] if isinstance(width, (list, tuple)) else width  # one per layer (Gemma-3n): the last layer's
        config = {
            "model_type": self.model_type,
            "hidden_size": hidden,
            "intermediate_size": int(width or 4 * hidden),
            "num_attention_heads": heads,
            "num_key_value_heads": int(config_field(target, "num_key_value_heads") or heads),
            "head_dim": int(config_field(target, "head_dim") or hidden // heads),
            "hidden_act": "silu",
            "rms_norm_eps": norm_eps(target),
            "vocab_size": int(config_field(target, "vocab_size")),
            "max_position_embeddings": int(config_field(target, "max_position_embeddings") or 4096),
            "rope_parameters": draft_rope(target),
            "attention_bias": False,
            "num_hidden_layers": num_layers,
            "tie_word_embeddings": False,
        }
        config.update(self.own_config)
        config.update({key: [value] * num_layers for key, value in self.per_layer.items()})
        if self.per_kind:
            config |= {
                "layer_types": [FULL] * num_layers,
                "rope_parameters": {FULL: config["rope_parameters"]},
                "global_head_dim": config["head_dim"],
                "num_global_key_value_heads": config["num_key_value_heads"],
            }
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if config_field(target, key) is not None:
                config[key] = config_field(target, key)
        return config


DRAFT_LAYER_FAMILIES = {
    "llama": LayerFamily(
        "llama",
        "transformers.models.llama.configuration_llama.LlamaConfig",
        "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
        "transformers.models.llama.modeling_llama.LlamaRotaryEmbedding",
        own_config={"mlp_bias": False},  # Llama's MLP can have biases; Qwen3's has none to switch off
    ),
    "qwen3": LayerFamily(
        "qwen3",
        "transformers.models.qwen3.configuration_qwen3.Qwen3Config",
        "transformers.models.qwen3.modeling_qwen3.Qwen3DecoderLayer",
        "transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding",
    ),
    # vLLM's Gemma4DSparkModel's layers (DSpark only): the sandwich norms, q/k/v norms, GELU MLP and a scaled
    # embedding of Gemma-4, keys equal to values (attention_k_eq_v: vLLM's fused context projection assumes it on
    # every layer), no soft-capping, per-layer inputs or experts
    "gemma4_text": LayerFamily(
        "gemma4_text",
        "transformers.models.gemma4.configuration_gemma4.Gemma4TextConfig",
        "transformers.models.gemma4.modeling_gemma4.Gemma4TextDecoderLayer",
        "transformers.models.gemma4.modeling_gemma4.Gemma4TextRotaryEmbedding",
        own_config={
            "hidden_activation": "gelu_pytorch_tanh",
            "attention_k_eq_v": True,
            "final_logit_softcapping": None,
            "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0,
            "enable_moe_block": False,
            "use_double_wide_mlp": False,
        },
        per_kind=True,
        engine_model="Gemma4DSparkModel",
    ),
    # vLLM's DFlashLagunaForCausalLM's layers (DFlash only: heads/dflash_laguna.py): q/k norms, a softplus gate per
    # head on the attention's output, a dense SiLU MLP; RoPE over every dimension
    "laguna": LayerFamily(
        "laguna",
        "transformers.models.laguna.configuration_laguna.LagunaConfig",
        "transformers.models.laguna.modeling_laguna.LagunaDecoderLayer",
        "transformers.models.laguna.modeling_laguna.LagunaRotaryEmbedding",
        own_config={"gating": True, "num_experts": 0},
        per_kind=True,
        per_layer={"mlp_layer_types": "dense"},
        engine_model="DFlashLagunaForCausalLM",
    ),
}


def layer_family(name: str, kind: Optional[str] = None, models: tuple[str, ...] = ()) -> LayerFamily:
    """The draft layer family `name`; `kind`: the drafter kind it is for, whose export writes the engine `models`,
    refused where the one engine model building the family's layers is another (`LayerFamily.engine_model`); None:
    any kind."""
    if name not in DRAFT_LAYER_FAMILIES:
        raise UserError(
            f"drafter.layer_family={name!r} is not one of {', '.join(DRAFT_LAYER_FAMILIES)} (the families engines "
            "build draft layers from)"
        )
    family = DRAFT_LAYER_FAMILIES[name]
    if kind is not None and family.engine_model and family.engine_model not in models:
        built_here = ("", *models)
        others = ", ".join(other for other, built in DRAFT_LAYER_FAMILIES.items() if built.engine_model in built_here)
        raise UserError(
            f"drafter.layer_family={name}: no engine builds a {kind} drafter's layers of that family (vLLM builds them "
            f"in its {family.engine_model} only); choose {others}"
        )
    return family


def tap_layers(config: Any, wanted: list[int]) -> list[int]:
    """A drafter's default tap layers `wanted` (our ids: output of layer i) for this target: unchanged
    where every layer is attention; on a hybrid target with layers of another kind (linear attention:
    Qwen3-Next, Qwen3.5) each moved to the nearest attention layer below the last (whose normed state no
    engine captures), in order, without repeats."""
    kinds = layer_types(config)
    allowed = attention_layers(config)
    if len(allowed) == len(kinds) or not allowed:
        return list(wanted)
    usable = [layer for layer in allowed if layer < len(kinds) - 1] or allowed
    snapped = [min(usable, key=lambda layer: (abs(layer - want), layer)) for want in wanted]
    return sorted(dict.fromkeys(snapped))


def family_rotation(module) -> Any:
    """transformers' rotary application of the family whose module `module` is (`apply_rotary_pos_emb` of its modeling
    file: partial rotary where its table is narrower than a head)."""
    return sys.modules[type(module).__module__].apply_rotary_pos_emb
