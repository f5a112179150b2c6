"""The tiny configs of any family transformers implements, built from its config class alone: a family's own
sizes (latent ranks, linear-attention and indexer heads, expert groups, per-layer overrides) derived from TINY's by
field name, so that the model is consistent and small (draftsmith.random_target writes models of them)."""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from typing import Any, Optional

from huggingface_hub.errors import StrictDataclassError

from draftsmith.errors import UserError, one_line
from draftsmith.families import COMPRESSED, FULL, LINEAR, even_rotary_share, own_layer_kinds

# The tiny shape every family is proven at (the target-families matrix): hidden 256, 4 layers,
# 4 heads over 2 KV heads of 64, and for mixtures of experts 4 experts of which 2 are routed.
TINY = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 2048,
}
# Mixture-of-experts sizes under the names the config classes use; set where the class has the field.
EXPERTS = {
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "shared_intermediate_size": 128,
    "shared_experts_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128,
}
EXPERT_COUNTS = ("n_routed_experts", "num_local_experts", "num_experts")  # EXPERTS' names of the expert count
# The sparse indexers' keys per query: short enough that a test's sequences go past it (the selection
# is exercised), a multiple of 64 as engines' sparse-attention kernels tile the selected keys.
INDEX_TOPK = 64
INDEX_HEADS = 16  # the sparse indexers' heads, at least (scaled_fields)
INDEX_BLOCK = 4  # a block-sparse indexer's keys pooled per block: a power of two, several blocks within INDEX_TOPK
# Multi-head latent attention's key-value latent and rotary sizes (DeepSeek-V3's, GLM-4.5-Air's, Kimi's):
# vLLM's CPU MLA kernel serves a 576-wide latent head only (mla/cpu_mla.py), so tiny targets keep them.
MLA_LATENT, MLA_ROPE = 512, 64
# Chunked attention's chunk (Llama-4's 8192): 128 positions, which the matrix's rows cross and vLLM's KV blocks divide
# (its CPU build's 128: "attn_chunk_size 48 is not divisible by block_size 128")
ATTENTION_CHUNK = 128


def build_config(
    model_type: str,
    vocab_size: int,
    special: Optional[dict[str, int]] = None,
    sliding_window: Optional[int] = None,
    **shape: Any,
):
    """A transformers config of `model_type` at the TINY shape (`shape` overrides any field): the
    vocabulary and special token ids given, sliding-window layers (where the family has them)
    limited to `sliding_window` positions so that short tests cross the window, and chunked attention's chunks to
    ATTENTION_CHUNK.

    The config is built by its class with every field at once, so that what the class derives in its
    own initialisation (per-layer kinds, MLA's query head size, rotary sizes) follows the tiny shape;
    the fields a family sizes apart from TINY's (latent ranks, linear-attention heads, indexer heads,
    expert groups, per-layer overrides) are derived from TINY's, by field name (`scaled_fields`)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:  # not transformers' list of its hundreds of types: the closest
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING), n=3)
        raise UserError(f"transformers has no model type {model_type!r} (closest: {', '.join(close) or 'none'})")
    default = AutoConfig.for_model(model_type)
    # A multimodal family: its language model's config, built with the fields (the outer config's
    # constructor would leave its text config at the full size).
    default = getattr(default, "text_config", None) or default
    aliases = type(default).attribute_map
    canonical = {key: aliases.get(key, key) for key in (*TINY, *EXPERTS, *shape)}
    # Expert sizes only for a family whose default has experts, or sizes its experts and leaves their count to the
    # release (Dots1's: its model cannot be built without one): a dense default with the fields (Gemma-4's optional
    # MoE block) stays dense, as engines read an expert count as "build the experts"
    counted = any(hasattr(default, key) for key in EXPERT_COUNTS)
    has_experts = any(getattr(default, key, None) for key in EXPERT_COUNTS) or (
        counted and bool(getattr(default, "moe_intermediate_size", None))
    )
    experts = {key: value for key, value in EXPERTS.items() if has_experts and hasattr(default, key)}
    if getattr(default, "num_experts_per_tok", None) == 1:  # top-1 routing (Llama-4's), which vLLM's kernel requires of
        experts["num_experts_per_tok"] = 1  # a router weighting the experts' inputs: kept
    fields: dict[str, Any] = {}
    # Later sources win over a field's aliases too (an expert size that is another name of a TINY one).
    for source in (TINY, experts, shape):
        fields.update({canonical[key]: value for key, value in source.items()})
    fields.update(vocab_size=vocab_size, **(special or {}))
    defaults = default.to_dict()
    # a field under its other name too: scaled_fields reads the usual names (Bailing-Hybrid's n_group: num_expert_group)
    defaults |= {alias: defaults[name] for alias, name in aliases.items() if name in defaults and alias not in defaults}
    sizes = {key: fields[canonical[key]] for key in TINY} | {"vocab_size": vocab_size}
    sizes.update({key: fields[canonical[key]] for key in EXPERTS if canonical[key] in fields})
    given = shape.keys() - TINY.keys()  # a derived size given is kept; TINY's given are what sizes derive from
    scaled = scaled_fields(defaults, sizes)
    fields.update({aliases.get(key, key): value for key, value in scaled.items() if key not in given})
    cls = type(default)
    try:
        config = first_build(cls, fields, defaults, fields[canonical["num_hidden_layers"]], shape)
        if "layer_types" in defaults and config.layer_types is None and "layer_types" not in shape:
            # a class that leaves its layers' kinds to the release (LFM2-MoE's): the kinds its modeling module names
            fields["layer_types"] = module_layer_kinds(cls, fields[canonical["num_hidden_layers"]])
            config = cls(**fields) if fields["layer_types"] else config
        kinds = getattr(config, "layer_types", None)
        if kinds and "layer_types" not in shape:
            config = cls(**fields) if every_kind(fields, kinds, defaults, cls) else config
        overrides = getattr(config, "is_heterogeneous", False) and config.to_dict().get("per_layer_config")
        if overrides and "per_layer_config" not in shape:
            # Per-layer overrides (wider heads on some layers) at the tiny shape: each overridden size scaled
            # as its global field was, so that those layers keep their proportion to the others.
            scaled = {layer: scaled_overrides(values, defaults, fields) for layer, values in overrides.items()}
            config = cls(**fields, per_layer_config=scaled)
    except (StrictDataclassError, AttributeError) as err:  # its own checks of its sizes; a size it derives (Falcon)
        raise UserError(f"transformers' {cls.__name__} refuses the tiny {model_type} target: {one_line(err)}") from None
    sections = module_rotary_sections(cls, config)
    rope = getattr(config, "rope_parameters", None)
    if sections and isinstance(rope, dict) and "mrope_section" not in rope:
        config.rope_parameters = {**rope, "mrope_section": sections}
    if sliding_window is not None and getattr(config, "sliding_window", None) is not None:
        config.sliding_window = sliding_window
    if getattr(config, "attention_chunk_size", None) and "attention_chunk_size" not in shape:
        config.attention_chunk_size = ATTENTION_CHUNK  # chunked attention (Llama-4's): chunks a test's rows cross
    config.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    # a TINY size the class has no field for is left out of its config.json, which the engines read (they would read a
    # GPT-NeoX config's `num_key_value_heads` as a grouping of heads its model does not have); but not a head size
    # the class derives as hidden_size / heads: the key says what its model computes, and an engine may read it where
    # a release's config.json has it (vLLM 0.32's GLM-4-MoE stopped at start without it under transformers 5.25, whose
    # class dropped the field)
    # (read from its fields: a class with sizes per layer refuses the global ones' getters)
    heads, width = (vars(config).get(canonical[key]) for key in ("num_attention_heads", "hidden_size"))
    derived_head = width // heads if isinstance(heads, int) and heads and isinstance(width, int) else None
    for key in TINY.keys() - shape.keys():
        name = canonical[key]
        derived = key == "head_dim" and vars(config).get(name) == derived_head
        if name not in defaults and name in vars(config) and not derived:
            delattr(config, name)
    return config


def first_build(cls, fields: dict[str, Any], defaults: dict[str, Any], layers: int, shape: dict[str, Any]):
    """`cls` built with `fields`; where it refuses its own default's per-layer kinds at the tiny depth (Zamba2's, a
    release's 54 whatever the depth), with the first `layers` of them (every_kind adds the kinds further down)."""
    try:
        return cls(**fields)
    except StrictDataclassError:
        kinds = defaults.get("layer_types")
        if not isinstance(kinds, list) or len(kinds) == layers or "layer_types" in shape:
            raise
        fields[kinds_field(cls)] = kinds[:layers]
        return cls(**fields)


def kinds_field(cls) -> str:
    """The name `cls` takes its layers' kinds under: its own field, not `layer_types` where that is an alias (Zamba2's
    `layers_block_type`: given by the alias, its hybrid layers' indices were derived from the default's kinds)."""
    return cls.attribute_map.get("layer_types", "layer_types")


def every_kind(fields: dict[str, Any], kinds: list[str], defaults: dict[str, Any], config_class) -> bool:
    """Set `fields`' layer_types so that the tiny depth has every attention kind of the family; whether it changed
    them. A kind its default has further down (Inkling's full attention, one layer in six) goes last, as in a period;
    a kind of the family's code its default has none of (a release turns it on: MiniMax-M3's sparse attention) goes on
    every other layer. Linear and compressed attention keep the class's layout (tests need linear layers only), unless
    it leaves linear layers alone."""
    own = [] if set(own_layer_kinds(config_class)) & set(kinds) else own_layer_kinds(config_class)
    default_kinds = dict.fromkeys(defaults.get("layer_types") or ())
    kept = {LINEAR, *COMPRESSED} & {*kinds, *default_kinds}
    # linear layers alone at the tiny depth (Kimi-Linear's attention one layer in four, Bailing-Hybrid's one in six):
    # the others go last, as the eval loop decodes no target of linear layers only
    further = [kind for kind in default_kinds if kind not in kinds and (not kept or set(kinds) == {LINEAR})]
    named = {"layer_types", "attn_layer_indices"} & defaults.keys()  # kinds a release names (Granite-4.0-H, Bamba)
    if set(kinds) == {LINEAR} and not further and named and f'"{FULL}"' in modeling_source(config_class):
        further = [FULL]  # linear layers alone by default: attention, which the family's code has, last
    chosen = list(kinds)
    if own:
        chosen = [own[0] if i % 2 == 0 else kind for i, kind in enumerate(chosen)]
    if further and len(chosen) > len(further):
        chosen[-len(further) :] = further
    if "attn_layer_indices" in defaults:  # kinds a class derives from its attention layers' indices (Bamba's)
        fields["attn_layer_indices"] = [i for i, kind in enumerate(chosen) if kind == FULL]
    else:
        fields[kinds_field(config_class)] = chosen
    return chosen != list(kinds)


def modeling_source(config_class) -> str:
    """The source of the modeling module of `config_class`'s family; empty where it has none."""
    try:
        return inspect.getsource(
            importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
        )
    except (ImportError, OSError, TypeError):
        return ""


def module_rotary_sections(config_class, config) -> Optional[list[int]]:
    """The multimodal rotary sections (`rope_parameters.mrope_section`: each head's rotary frequencies split between
    the position's time, height and width) of a family whose modeling module splits them by a default sized for a
    release's head (Qwen2-VL's [16, 24, 24] of 128 / 2) that the tiny `config`'s head does not fit: the default scaled
    to it (the model would fail on its first forward; a text prompt's three positions are one, so no output depends on
    the split); None where the module has no such default or it fits."""
    source = modeling_source(config_class)
    found = re.search(r'"mrope_section",\s*\[([\d,\s]+)\]', source)
    splits = re.search(r"split\((self\.)?mrope_section", source)  # not interleaved: sections that must add up
    if not (found and splits):
        return None
    default = [int(size) for size in found[1].split(",")]
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if sum(default) == head // 2:
        return None
    scaled = [size * (head // 2) // sum(default) for size in default]
    scaled[0] += head // 2 - sum(scaled)  # what rounding left, so the sections cover the half head exactly
    return scaled


def module_layer_kinds(config_class, layers: int) -> list[str]:
    """`layers` layers' kinds in turn, of the cache kinds of transformers (`DYNAMIC_LAYER_TYPE_MAPPING`) that the
    modeling module of `config_class`'s family names, in the order its source names them (LFM2-MoE's "conv" and
    "full_attention"); none where it has no such module."""
    from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING

    source = modeling_source(config_class)
    named = sorted((source.find(f'"{kind}"'), kind) for kind in DYNAMIC_LAYER_TYPE_MAPPING if f'"{kind}"' in source)
    return [named[i % len(named)][1] for i in range(layers)] if named else []


def scaled_fields(defaults: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """The sizes a family keeps apart from TINY's fields, at sizes derived from them so that the tiny
    model is consistent and small (`defaults`: the class's own config, whose fields say which apply;
    `fields`: the tiny sizes under TINY's and EXPERTS' names, and the vocabulary's)."""
    head, heads, hidden = fields["head_dim"], fields["num_attention_heads"], fields["hidden_size"]
    kv_heads, layers = fields["num_key_value_heads"], fields["num_hidden_layers"]
    out: dict[str, Any] = {}
    if defaults.get("num_key_value_heads") == 1:  # multi-query attention: one key-value head, shared by all
        out["num_key_value_heads"] = 1
    if "kv_lora_rank" in defaults:
        # Multi-head latent attention: keys and values are expanded from one latent per token into every
        # query head, so the heads are not grouped (a group would repeat already expanded heads). Its
        # head_dim is the rotary part's (what the rotary embedding reads): a head_dim given as a field
        # would replace the one the class derives, so it is given as that part. The latent and rotary
        # sizes stay the released models' (512 + 64): vLLM's CPU MLA kernel takes that latent only. A family whose
        # class has no rotary part (its sparse layers attend without positions: a NoPE default of 0) keeps none.
        rope = 0 if defaults.get("qk_rope_head_dim") == 0 else MLA_ROPE
        out.update(num_key_value_heads=heads, qk_nope_head_dim=head, qk_rope_head_dim=rope, v_head_dim=head)
        out.update(head_dim=rope, kv_lora_rank=MLA_LATENT)
        share = (defaults.get("rope_parameters") or {}).get("partial_rotary_factor")
        if share and defaults.get("head_dim") and defaults["head_dim"] * share == defaults.get("qk_rope_head_dim"):
            # a class whose rotary embedding turns a share of a head as wide as both parts (Mistral-4's, the share
            # its own of the parts given): that head
            out["head_dim"] = head + rope
    if defaults.get("q_lora_rank"):  # a query latent (None where queries are projected at full rank: kept)
        out["q_lora_rank"] = 3 * head  # not the key-value latent's 2 * head: a mix-up of the two fails on shape
    if defaults.get("o_lora_rank"):  # grouped low-rank output projection: groups of two query heads
        out.update(o_lora_rank=head, o_groups=largest_divisor(heads, defaults.get("o_groups") or 1, per_part=2))
    if "index_n_heads" in defaults:
        # A sparse-attention indexer: each head a rotary part as wide as the attention's (the latent's 64)
        # beside a plain part of `head`. At least INDEX_HEADS heads: a key's score sums the heads' ReLU'd
        # products, exactly 0 when every head's is negative, and top-k breaks such ties by position, not
        # alike in a one-token step and a many-token forward; with the released 64 heads (here 16) that
        # never happens, with 4 it did within 20 tokens.
        out.update(index_n_heads=max(heads, INDEX_HEADS), index_head_dim=head + out.get("qk_rope_head_dim", 0))
        out["index_topk"] = min(defaults.get("index_topk") or INDEX_TOPK, INDEX_TOPK)
    if "index_num_heads" in defaults:  # an indexer scoring with key head 0's query heads (Kolibri-1.1's): all of them
        out["index_num_heads"] = heads // out.get("num_key_value_heads", kv_heads)
    if "index_block_size" in defaults:
        # An indexer that picks blocks of keys (MiniMax-M3's): blocks of INDEX_BLOCK, as many as make INDEX_TOPK
        # keys; one indexer head per key-value head where the family ties them (its attention expands each head's
        # selection to the query heads of its group).
        out.update(index_block_size=INDEX_BLOCK, index_topk_blocks=INDEX_TOPK // INDEX_BLOCK)
        if defaults.get("index_n_heads") == defaults.get("num_key_value_heads"):
            out["index_n_heads"] = kv_heads
    if isinstance(defaults.get("rotary_dim"), int) and isinstance(defaults.get("head_dim"), int):
        # The family's rotated share (MiniMax-M3's half), as `rotary_dim` and as the factor transformers' rotary
        # embedding reads (head_dim × `partial_rotary_factor` of rope_parameters, where the class's default is 1, the
        # whole head) and vLLM's (its config's, 0.5 by default): so that both rotate the same channels.
        out["rotary_dim"] = head * defaults["rotary_dim"] // defaults["head_dim"]
        share = {"partial_rotary_factor": defaults["rotary_dim"] / defaults["head_dim"]}
        out["rope_parameters"] = {**(defaults.get("rope_parameters") or {}), **share}
    if isinstance(defaults.get("v_head_dim"), int) and "kv_lora_rank" not in defaults:
        # value heads of their own width (MiMo-V2's 128 beside 192): as wide as the keys', as vLLM-CPU's attention
        # has no kernel for value heads of another width
        out["v_head_dim"] = head
    rope = out.get("rope_parameters", defaults.get("rope_parameters"))
    if isinstance(rope, dict) and (even := even_rotary_share(rope, out.get("head_dim", head))) != rope:
        out["rope_parameters"] = even
    if defaults.get("logits_mup_width_multiplier"):
        # muP's width multiplier (Inkling's: the final state divided by it before the lm_head) is the model's width over
        # the base width the release was tuned at: at the tiny width the same base's (the class default's 24 at 6144
        # would squash a tiny model's logits 96-fold too many, and its training with them)
        out["logits_mup_width_multiplier"] = defaults["logits_mup_width_multiplier"] * hidden / defaults["hidden_size"]
    if defaults.get("output_multiplier"):
        # the logits' scale before the soft cap, 1/sqrt(width / 256) in a release (Muse's): at the tiny width the same
        # rule's (the release's would squash a tiny model's logits several-fold, and its routers' with them)
        out["output_multiplier"] = defaults["output_multiplier"] * (defaults["hidden_size"] / hidden) ** 0.5
    if "swa_head_dim" in defaults:  # sliding-window layers sized apart (Inkling's): as the others
        out.update(swa_head_dim=head, swa_num_attention_heads=heads, swa_num_key_value_heads=kv_heads)
    if defaults.get("unpadded_vocab_size"):  # the lm_head's rows a release pads to `vocab_size`: every row, unpadded
        out["unpadded_vocab_size"] = fields["vocab_size"]
    if "mamba_num_heads" in defaults:  # Mamba-2 layers (Nemotron-H's): heads and state as wide as attention's
        out.update(mamba_num_heads=heads, mamba_head_dim=head, ssm_state_size=head, n_groups=kv_heads)
    if "mamba_n_heads" in defaults:  # under Bamba's names (Granite-4.0-H's, Falcon-H1's): heads of attention's width,
        inner = (defaults.get("mamba_expand") or 2) * hidden  # as many as fill the inner width the class checks
        out.update(mamba_n_heads=inner // head, mamba_d_head=head, mamba_d_state=head, mamba_n_groups=kv_heads)
        out["mamba_d_ssm"] = inner  # the inner width itself, where the class has it (Falcon-H1's)
    if "num_heads" in defaults and "expand" in defaults and "state_size" in defaults:
        # Mamba-2's own heads: as wide as attention's, as many as fill the inner width its class checks
        out["num_heads"] = defaults["expand"] * hidden // head
    if defaults.get("moe_hidden_size"):  # the width experts run at, pooled from the hidden size (Muse Spark's half)
        out["moe_hidden_size"] = hidden * defaults["moe_hidden_size"] // defaults["hidden_size"]
    if "dense_intermediate_size" in defaults:  # the dense layers' MLP of a mixture-of-experts family: the tiny one
        out["dense_intermediate_size"] = fields["intermediate_size"]
    if "indexer_budget" in defaults:  # a block-sparse indexer (QSA: unset by the class, set by a release): blocks of
        # INDEX_BLOCK keys scored by one key head, INDEX_TOPK keys kept; heads as above (ties), as wide as attention's
        out.update(indexer_n_heads=max(heads, INDEX_HEADS), indexer_kv_heads=1, indexer_head_dim=head)
        out.update(indexer_compress_ratio=INDEX_BLOCK, indexer_budget=INDEX_TOPK)
    if "ple_layer_ids" in defaults:  # per-layer n-gram embeddings (none by default; a release's hold billions of rows):
        # on the first layer, each hashed table about the vocabulary's size, saved as one part
        out.update(ple_layer_ids=[1], ngram_vocab_size_base=fields["vocab_size"], split_ngram_parts=1)
    if defaults.get("hc_lowrank"):  # hyper-connections' low-rank stream mixer: a head's width (the release's ~hidden/6)
        out["hc_lowrank"] = head
    has_experts = any(fields.get(key) for key in EXPERT_COUNTS)
    if defaults.get("n_group") and has_experts:
        # Grouped routing: the experts split in groups (each scored by its top two experts), the tokens
        # routed within the best `topk_group` of them; as many groups as divide the experts in pairs, the
        # family's share of them kept (at least enough groups for the experts a token takes).
        experts = next(fields[key] for key in EXPERT_COUNTS if fields.get(key))
        groups = largest_divisor(experts, defaults["n_group"], per_part=2)
        share = round(groups * (defaults.get("topk_group") or 1) / defaults["n_group"])
        needed = -(-fields.get("num_experts_per_tok", 1) // (experts // groups))
        out.update(n_group=groups, topk_group=min(groups, max(1, share, needed)))
    for offset in [key for key in defaults if key.endswith("_layer_offset")]:
        period = offset.removesuffix("offset") + "period"
        if isinstance(defaults[offset], int) and isinstance(defaults.get(period), int) and defaults[offset] >= layers:
            # a kind on every `period`-th layer from `offset` (Jamba's attention: one in 8, from the 5th), which the
            # tiny depth would not reach: on every other layer
            out.update({period: 2, offset: 1})
    if "n_shared_experts" in defaults and defaults["n_shared_experts"] is None and has_experts:
        out["n_shared_experts"] = 1  # a count left to the release that the model multiplies by (Dots1's): one
    if defaults.get("first_k_dense_replace"):  # dense layers first: one, so that 2 layers still meet both kinds
        out["first_k_dense_replace"] = 1
    if isinstance(defaults.get("mlp_layer_types"), list) and defaults["mlp_layer_types"]:
        # The family's first layer's kind, then its last layer's (dense or hash-routed first, then routed).
        kinds = defaults["mlp_layer_types"]
        out["mlp_layer_types"] = [kinds[0]] + [kinds[-1]] * (layers - 1)
    if "linear_key_head_dim" in defaults:  # linear attention (Gated DeltaNet): heads as the attention's
        out.update(linear_key_head_dim=head, linear_value_head_dim=head)
        out.update(linear_num_key_heads=kv_heads, linear_num_value_heads=heads)
    if "linear_head_dim" in defaults:  # linear attention with one head size for keys and values (GLM-5-Next's)
        out.update(linear_head_dim=head, linear_num_heads=heads)
    if defaults.get("vocab_size_per_layer_input"):  # per-layer input embeddings: of the vocabulary used
        out["vocab_size_per_layer_input"] = fields["vocab_size"]
    if defaults.get("hidden_size_per_layer_input"):
        out["hidden_size_per_layer_input"] = head
    if "num_kv_shared_layers" in defaults:  # layers reusing another's cache: none, each layer its own
        out["num_kv_shared_layers"] = 0
    return {key: value for key, value in out.items() if key in defaults}


def scaled_overrides(values: dict[str, Any], defaults: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """A layer's overrides of global sizes, each scaled by its field's tiny/default ratio; a latent-attention head that
    is its plain and rotary parts (Dots3-Note's sliding layers') stays their sum, which the family checks."""

    def scaled(key: str, value: Any) -> Any:
        if not (isinstance(value, int) and isinstance(defaults.get(key), int) and key in fields):
            return value
        return max(1, value * fields[key] // defaults[key])

    out = {key: scaled(key, value) for key, value in values.items()}
    # a part the layer does not override is the global one: the default's, and at the tiny shape the field's
    default_parts = [values.get(key, defaults.get(key)) for key in ("qk_nope_head_dim", "qk_rope_head_dim")]
    tiny_parts = [out.get(key, fields.get(key)) for key in ("qk_nope_head_dim", "qk_rope_head_dim")]
    if "head_dim" in values and all(isinstance(part, int) for part in (*default_parts, *tiny_parts)):
        if values["head_dim"] == sum(default_parts):
            out["head_dim"] = sum(tiny_parts)
    return out


def largest_divisor(n: int, cap: int, per_part: int = 1) -> int:
    """The largest divisor of `n` that is at most `cap` and leaves at least `per_part` in each part."""
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= max(cap, 1) and (n // d >= per_part or d == 1))
