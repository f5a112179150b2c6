"""The table of MTP layouts (heads/mtp_layer.py's `Layout`): target architecture -> how its checkpoint stores its MTP
layer and how vLLM 0.32's MTP model for it computes the layer (each read from vLLM's source), and the architectures
whose layer draftsmith does not train (`UNSERVED`) or whose multi-token prediction is a model of its own
(`SEPARATE_MODEL`), and `layout_of`: a target config's layout, or the one line refusing it. Apart from the drafter
(heads/mtp.py), which reads it.
"""

from __future__ import annotations

from dataclasses import replace

from draftsmith.errors import UserError
from draftsmith.families import SLIDING
from draftsmith.heads import mtp_stacked
from draftsmith.heads.mtp_layer import TARGET_EMBED_NORM, Layout

DEEPSEEK_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
HY_V4_NAMES = ("enorm", "hnorm", "eh_proj", "final_layernorm")  # MiniMax-M3's too
QWEN_NAMES = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
# DeepSeek-V4's release names (mtp_streams.ROLES), the block's beside them under `mtp.{j}.` in DeepSeek's original names
V4_NAMES = ("enorm", "hnorm", "e_proj", "h_proj", "norm")
# Qwen4-Exp's release names (mtp_gated.ROLES), its final mixer's beside them (mtp_gated.COLLAPSE_NAMES)
QWEN4_EXP_NAMES = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc_embedding", "fc_hidden")
QWEN4_EXP = Layout(
    "Qwen4ExpMTP", "mtp_num_hidden_layers", QWEN4_EXP_NAMES, False, False, False, streams=True, gated=True
)
EXAONE_MOE = Layout(
    "ExaoneMoeMTP", "num_nextn_predict_layers", QWEN_NAMES, False, False, True, block_kind=(SLIDING, "dense"),
    kind_of_layer_0=True, step_depths=True,
)  # fmt: skip
# vLLM's glm4_moe_mtp: fed back unnormed before 0.34.0, normed from it (its forward returns final_norm(pre) twice)
GLM4_MOE = Layout(
    "glm4_moe_mtp", "num_nextn_predict_layers", DEEPSEEK_NAMES, True, True, False, step_depths=True,
    feedback_changed_in="0.34.0",
)  # fmt: skip
# GLM-4.7-Flash's layer, computed as SGLang's Glm4MoeLiteForCausalLMNextN (formats/mtp_sglang.py): DeepSeek's names at
# layer N, its block the MLA decoder layer with experts, position 0 read, the normed output fed back
GLM4_MOE_LITE = Layout(
    "glm4_moe_lite_mtp", "num_nextn_predict_layers", DEEPSEEK_NAMES, True, False, True,
    vllm_refused="vLLM's glm4_moe_lite_mtp (0.32.0 to 0.34.0) sets num_hidden_layers to 0 and so builds and loads the "
    "target's layer 0 as the MTP layer, never the shipped one",
)  # fmt: skip
# vLLM's qwen3_next_mtp: one wrapper for every depth, depth j's block under `mtp.layers.{j}.`, run at step j from
# vLLM 0.34.0 (0.32's and 0.33's Qwen3NextMTP.forward takes the step in **kwargs and passes none on)
QWEN3_NEXT = Layout(
    "qwen3_next_mtp", "num_nextn_predict_layers", QWEN_NAMES, False, False, True, step_depths=True,
    step_depths_from="0.34.0",
)  # fmt: skip
# vLLM's qwen3_5_mtp: Qwen3-Next's, counted by mtp_num_hidden_layers (0.32 and 0.33 read no count: depth 0 every step)
QWEN3_5 = replace(QWEN3_NEXT, vllm_model="qwen3_5_mtp", count_key="mtp_num_hidden_layers")
# vLLM's Qwen3_5MoeMTP: Qwen3.5's layer with Qwen3-Next's experts (a sigmoid-gated shared expert beside them),
# stored fused as the releases ship them (vLLM reads either form)
QWEN3_5_MOE = replace(QWEN3_5, fused_experts=True)
# Inkling's `mtp_config` keys (vLLM's reading) -> the text_config fields transformers copies them to
MTP_FIELDS = (
    ("num_nextn_predict_layers", "num_mtp_layers"),
    ("chain_hidden_post_norm", "chain_hidden_post_norm"),
    ("local_layer_ids", "mtp_local_layer_ids"),
)
# Target architecture -> its MTP layout, as vLLM 0.32's models read and compute it (read from its source).
LAYOUTS = {
    # vLLM's deepseek_mtp: depth j is layer N + j, its own wrapper and block, run at draft step j (`step_depths`)
    "DeepseekV3ForCausalLM": Layout(
        "deepseek_mtp", "num_nextn_predict_layers", DEEPSEEK_NAMES, True, True, True, step_depths=True
    ),
    # vLLM's DeepseekV32MTP (models/deepseek_v32/): DeepSeek-V3's layer and names, its block V3.2's sparse-attention
    # layer, whose indexer keys the drafter's cache keeps beside its keys (mtp_layer.layer_config); depth j is layer
    # N + j, its own block, indexer and caches (vLLM's `{prefix}.self_attn.indexer.k_cache`), run at draft step j
    "DeepseekV32ForCausalLM": Layout(
        "DeepseekV32MTP", "num_nextn_predict_layers", DEEPSEEK_NAMES, True, True, True, step_depths=True
    ),
    # GLM-5 (glm_moe_dsa) is V3.2's sparse-attention architecture: vLLM's speculative config maps it to
    # deepseek_mtp and builds the same DeepseekV32MTP, so its layer is stored, masked and fed back as V3.2's
    # (normed, unlike GLM-4.5's glm4_moe_mtp)
    "GlmMoeDsaForCausalLM": Layout(
        "DeepseekV32MTP", "num_nextn_predict_layers", DEEPSEEK_NAMES, True, True, True, step_depths=True
    ),
    "Glm4MoeForCausalLM": GLM4_MOE,
    # vLLM's DeepSeekV4MTP (models/deepseek_v4/nvidia/mtp.py): a layer on hyper-connection streams, fed back unnormed;
    # depth j `mtp.{j}.` (layer N + j: compress ratio 1 past the decoder's, plain sliding-window attention), its own
    # wrapper, hc_head, norm, block and caches, run at draft step j
    "DeepseekV4ForCausalLM": Layout(
        "DeepSeekV4MTP",
        "num_nextn_predict_layers",
        V4_NAMES,
        False,
        True,
        False,
        own_prefix=True,
        streams=True,
        step_depths=True,
    ),
    # vLLM's HYV4MTP (models/hy_v4/nvidia/mtp.py): DeepSeek's wrapper, its final norm `final_layernorm`, under
    # `model.mtp_layers.{j}.` beside its block: the decoder layer without its hyper-connections, its own indexer; depth
    # j (layer N + j) its own wrapper, block, indexer and caches, run at draft step j
    "HYV4ForCausalLM": Layout(
        "HYV4MTPModel",
        "num_nextn_predict_layers",
        HY_V4_NAMES,
        False,
        True,
        True,
        own_prefix=True,
        under="model.mtp_layers.",
        plain_block=True,
        step_depths=True,
    ),  # fmt: skip
    # vLLM's Glm5NextMTP (models/glm5next/common/mtp.py): V3.2's wrapper, names and feedback, under the wrapper's
    # language model (`model.language_model.layers.{N}.`); its block the decoder layer without its hyper-connections,
    # with the family's pooled sparse attention (heads/mtp_pooled.py) where the decoder mostly has linear attention; its
    # depths at the count in text_config, which use_multi_module_mtp() reads from vLLM 0.34.0 (as n_predict; 0.32 and
    # 0.33 at the wrapper config's top, where the release has none: depth 0 at every step)
    "Glm5NextForConditionalGeneration": Layout(
        "Glm5NextMTPModel",
        "num_nextn_predict_layers",
        DEEPSEEK_NAMES,
        True,
        True,
        True,
        plain_block=True,
        decoder_prefix="model.language_model.",
        step_depths=True,
        step_depths_from="0.34.0",
    ),  # fmt: skip
    # vLLM's Qwen4ExpMTP (models/qwen4_exp/nvidia/mtp.py): Qwen's `mtp.` layout, the layer on the target's
    # `hc_count` streams with its own final mixer (heads/mtp_gated.py), fed back unmixed; draftsmith loads the
    # release, a vision-language wrapper, as its language model
    "Qwen4ExpForCausalLM": QWEN4_EXP,
    # its release: `mtp.*` at the top of the checkpoint (transformers' classes ignore `^mtp.*`), as Qwen3.5's
    "Qwen4ExpForConditionalGeneration": QWEN4_EXP,
    # vLLM's Dots3NoteMTP (models/dots3_note/nvidia/mtp.py): V3.2's wrapper, names and feedback, its block layer N
    # with sliding-window attention (`mtp_layer_types`, sliding by default) and a dense MLP (`is_moe` needs an index
    # below num_hidden_layers), and an embedding of its own, `model.mtp.embed_tokens` (`has_own_embed_tokens`); depth j
    # layer N + j (attention `mtp_layer_types[j]`), the embedding every depth's, run at draft step j
    "Dots3NoteForCausalLM": Layout(
        "Dots3NoteMTPModel",
        "num_nextn_predict_layers",
        DEEPSEEK_NAMES,
        True,
        True,
        True,
        block_kind=(SLIDING, "dense"),
        own_embedding="model.mtp.embed_tokens.weight",
        step_depths=True,
    ),  # fmt: skip
    # vLLM's MiniMaxM3MTP (models/minimax_m3/nvidia/mtp.py; its speculative config maps the release's model type
    # minimax_m3_vl to minimax_m3_mtp, its text_config's `num_mtp_modules` the count): under the wrapper's language
    # model, `language_model.model.mtp.layers.{j}.` holds enorm, hnorm, eh_proj and final_layernorm beside the block,
    # `transformer_layer.`: the decoder layer with block-sparse attention and experts whatever the target's layers
    # (`force_sparse_attn`, `force_moe`), no hyper-connections to drop, its attention run on the drafter's masks
    # (heads/mtp_blocks.py); the embedding masked at position 0, Gemma-style (1 + w) norms, fed back unnormed (its
    # forward returns `pre`, compute_logits applies final_layernorm)
    "MiniMaxM3SparseForConditionalGeneration": Layout(
        "MiniMaxM3MTP",
        "num_mtp_modules",
        HY_V4_NAMES,
        False,
        True,
        False,
        own_prefix=True,
        under="language_model.model.mtp.layers.",
        block_prefix="transformer_layer.",
        plain_block=True,
        decoder_prefix="language_model.model.",
        wrapper_carrier=True,
        block_kind=("minimax_m3_sparse", "sparse"),
    ),  # fmt: skip
    # vLLM's InklingMTP (models/inkling/nvidia/mtp.py; its speculative config maps the release's model type
    # inkling_mm_model to inkling_mtp, reading `mtp_config`: `num_nextn_predict_layers`, `chain_hidden_post_norm`,
    # `local_layer_ids`): depth j under `model.mtp.layers.{j}.` holds hidden_norm, embed_norm, input_proj on
    # [hidden_norm(f) | embed_norm(e)] and the block, `transformer_block.`: the decoder layer with a dense MLP and its
    # short convolutions (heads/mtp_convolved.py), full attention or, for a depth in `local_layer_ids`, sliding; the
    # embedding first normed by the target's `embed_norm` (`use_embed_norm`; vLLM reads it from the drafter's folder,
    # so the export writes the target's there), nothing masked; one `model.mtp.chain_norm` after every depth where
    # `chain_hidden_post_norm` (else none: mtp_depths.layout_for), fed back and read by the lm_head, whose logits vLLM
    # divides by `logits_mup_width_multiplier`; depth i at draft step i, each over the whole sequence
    # (heads/mtp_depths.py)
    "InklingForConditionalGeneration": Layout(
        "InklingMTP",
        "num_nextn_predict_layers",
        ("embed_norm", "hidden_norm", "input_proj", "chain_norm"),
        False,
        False,
        True,
        own_prefix=True,
        under="model.mtp.layers.",
        block_prefix="transformer_block.",
        decoder_prefix="model.llm.",
        wrapper_carrier=True,
        block_kind=("hybrid", "dense"),
        local_kind="hybrid_sliding",
        convolved=True,
        hidden_first=True,
        target_scales=True,
        count_block="mtp_config",
        step_depths=True,
        outside=(
            ("chain_norm.weight", "model.mtp.chain_norm.weight"),
            (TARGET_EMBED_NORM, "model.llm.embed_norm.weight"),
        ),
    ),  # fmt: skip
    # vLLM's MiMoV2MTP (models/mimo_v2_mtp.py; its speculative config maps MiMoV2FlashForCausalLM to it and serves
    # one layer whatever the count): under `model.mtp.layers.{j}.`, enorm, hnorm, eh_proj and final_layernorm beside
    # the block: the family's sliding-window attention (its SWA heads and sinks) and a dense MLP, its post-attention
    # norm named `pre_mlp_layernorm`, its window the release's `sliding_window_size` keys (transformers' layers attend
    # one more); nothing masked, fed back normed (its forward returns final_layernorm's output)
    "MiMoV2FlashForCausalLM": Layout(
        "MiMoV2MTPModel",
        "num_nextn_predict_layers",
        HY_V4_NAMES,
        False,
        False,
        True,
        own_prefix=True,
        under="model.mtp.layers.",
        plain_block=True,
        block_kind=(SLIDING, "dense"),
        block_renames=(("pre_mlp_layernorm.", "post_attention_layernorm."),),
        window_key="sliding_window_size",
    ),  # fmt: skip
    # vLLM's HYV3MTP (models/hy_v3_mtp.py): DeepSeek-V3's layer N, masked at position 0, its final norm
    # `final_layernorm` applied before it is fed back (the layer's shared_head.head is the target's lm_head, shared)
    "HYV3ForCausalLM": Layout(
        "HYV3MTPModel", "num_nextn_predict_layers", HY_V4_NAMES, True, True, True, step_depths=True
    ),
    # vLLM's BailingMoeV3MTPModel (models/bailing_moe_v3_mtp.py; its speculative config maps a Ling-3.0 release,
    # BailingMoeV3ForCausalLM, to bailing_hybrid_v3_mtp): layer N + j, enorm, hnorm, eh_proj and final_layernorm
    # beside the block: the MLA layer with its head-wise gate and experts whatever layer N's index, under Ling's names
    # (`attention.`, `attention.dense`, `mlp.gate.expert_bias`: transformers' bailing_hybrid conversion); nothing
    # masked, fed back normed (its forward returns final_layernorm's output); depth `spec_step_idx % count` at step i
    "BailingMoeV3ForCausalLM": Layout(
        "BailingMoeV3MTPModel", "num_nextn_predict_layers", HY_V4_NAMES, True, False, True, step_depths=True
    ),
    # vLLM's ExaoneMoeMTP (models/exaone_moe_mtp.py): Qwen's `mtp.` layout and feedback, plain RMSNorms, one wrapper
    # for every depth; depth j's block `mtp.layers.{j}.` the decoder layer with `is_mtp`: a dense MLP, attention as
    # `mtp_layer_types[j]` or the decoder's layer j (sliding in the releases' LLLG pattern; `check_layer_0_kind`),
    # its window `mtp_sliding_windows[j]` or `sliding_windows[j]`, rotated; run at step `spec_step_idx % count`
    "ExaoneMoeForCausalLM": EXAONE_MOE,
    # vLLM's Exaone4_5_MTP (models/exaone4_5_mtp.py; its speculative config maps the release's model type exaone4_5 to
    # it): Exaone-MoE's wrapper, names and feedback, its depth j `mtp.layers.{j}.` Exaone-4's post-norm decoder layer
    # (dense) of the wrapper's text_config, attending as the decoder's layer j (`layer_types[j]`, sliding in the
    # releases' LLLG pattern, its window `sliding_window`: Exaone4Attention reads no `mtp_layer_types`,
    # `mtp_sliding_windows` nor `sliding_windows`; `check_layer_0_kind`); the count at the top of the wrapper's config,
    # run at step `spec_step_idx % count`
    "Exaone4_5_ForConditionalGeneration": replace(
        EXAONE_MOE, vllm_model="Exaone4_5_MTP", count_at_top=True, reads_mtp_fields=False
    ),
    # vLLM's NemotronHMTP (models/nemotron_h_mtp.py): under `mtp.layers.{i}.`, a stack of the family's attention and
    # expert layers (`mtp_hybrid_override_pattern`), enorm, hnorm and eh_proj in its first, final_layernorm in its
    # last (heads/mtp_stacked.py); nothing masked, fed back normed (its forward returns final_layernorm's output)
    "NemotronHForCausalLM": Layout(
        "nemotron_h_mtp", "num_nextn_predict_layers", HY_V4_NAMES, False, False, True, stacked=True
    ),
    # vLLM's LongCatFlashMTP (models/longcat_flash_mtp.py): under `model.mtp.layers.0.`, enorm and hnorm (each
    # `.m.`), eh_proj and the block: a DeepSeek-V2 decoder layer (heads/mtp_family.py), not LongCat-Flash's own, its MLA
    # attention beside and its MLP dense (vLLM clears `n_routed_experts`) under `transformer_layer.mlp.`; its final
    # norm `model.mtp.norm`; the MLA LoRA norms' weights scaled by sqrt(hidden_size / rank) as vLLM loads them where
    # the config's `mla_scale_*_lora` say (as LongCat-Flash's layers scale their LoRA outputs); nothing masked, fed
    # back normed (its forward returns final_layernorm's output)
    "LongcatFlashForCausalLM": Layout(
        "LongCatFlashMTP",
        "num_nextn_predict_layers",
        ("enorm.m", "hnorm.m", "eh_proj", "final_layernorm"),
        False,
        False,
        True,
        own_prefix=True,
        under="model.mtp.layers.",
        block_renames=(("transformer_layer.mlp.", "mlp."),),
        outside=(("final_layernorm.weight", "model.mtp.norm.weight"),),
        block_family="deepseek_v2",
        block_fields=(("first_k_dense_replace", 1),),
        scaled_norms=(
            ("self_attn.q_a_layernorm", "mla_scale_q_lora", "q_lora_rank"),
            ("self_attn.kv_a_layernorm", "mla_scale_kv_lora", "kv_lora_rank"),
        ),
    ),  # fmt: skip
    # vLLM's ErnieMTP (models/ernie_mtp.py; its speculative config maps ernie4_5_moe to it): `model.mtp_emb_norm.0`,
    # `model.mtp_hidden_norm.0`, `model.mtp_linear_proj.0` and the block `model.mtp_block.0.`: a Llama decoder layer
    # (heads/mtp_family.py; neox-style rotary, where ERNIE-4.5's own layers rotate interleaved pairs) of the target's
    # dense MLP width; the embedding masked at position 0; no final norm: the logits and the next step read the
    # block's output
    "Ernie4_5_MoeForCausalLM": Layout(
        "ErnieMTP",
        "num_nextn_predict_layers",
        ("emb_norm.0", "hidden_norm.0", "linear_proj.0"),
        False,
        True,
        False,
        under="model.mtp_",
        block_prefix="block.0.",
        block_family="llama",
        final_norm=False,
    ),  # fmt: skip
    "Glm4MoeLiteForCausalLM": GLM4_MOE_LITE,
    "Qwen3NextForCausalLM": QWEN3_NEXT,
    "Qwen3_5ForCausalLM": QWEN3_5,
    "Qwen3_5MoeForCausalLM": QWEN3_5_MOE,
    # Qwen3.5's releases are vision-language wrappers: the MTP layer at the top of the checkpoint (`mtp.*`, beside
    # `model.language_model.*`), its count in text_config. transformers' AutoModelForCausalLM loads their language
    # model alone (the class above, `loaded_config`), and vLLM serves the layer as for a text-only checkpoint.
    "Qwen3_5ForConditionalGeneration": QWEN3_5,
    "Qwen3_5MoeForConditionalGeneration": QWEN3_5_MOE,
}
# Architectures with MTP layers that draftsmith does not train, and why: vLLM 0.32 would not serve the layer as
# trained, or draftsmith's drafter cannot run it.
UNSERVED = {
    # measured in tests/test_step3p5.py (the IndexError) and tests/test_mtp_step3p5.py (built once put back)
    "Step3p5ForCausalLM": (
        "vLLM 0.32 builds its Step3p5MTP from no release as served: a release's config gives each MTP layer an entry "
        "of layer_types past num_hidden_layers (its kind and, through attention_other_setting, its heads), and "
        "vLLM's own Step3p5Config cuts layer_types to num_hidden_layers, so building depth j (layer "
        "num_hidden_layers + j) reads past the end (IndexError in Step3p5DecoderLayer); only a callable hf_overrides "
        "given to Python's LLM, which vLLM passes on to the draft's config, puts the entries back (`vllm serve` "
        "takes a dict, which stays the target's); and each depth reads logits through its own lm_head copy "
        "(shared_head.output, has_own_lm_head), which draftsmith's MTP drafter does not hold (it reads the target's)"
    ),
    "BailingMoeV2_5ForCausalLM": (
        "a Ling-2.5 release, whose layer vLLM 0.32 serves as BailingMoeV25MTPModel (MLA without an output gate), and "
        "whose target transformers' bailing_hybrid class, which draftsmith runs, does not compute (it is Ling-3.0's: "
        "KDA linear attention, MLA with a head-wise gate)"
    ),
    "BailingHybridForCausalLM": (
        "vLLM 0.32 has no model of that class (transformers' name for model type bailing_hybrid) and maps its MTP "
        "layer to Ling-2.5's BailingMoeV25MTPModel (MLA without the head-wise gate this layer has); a Ling-3.0 "
        "release names BailingMoeV3ForCausalLM in its config.json, whose layer vLLM serves as it trains here"
    ),
}
# Architectures whose multi-token prediction is a model released beside the target, not a layer in its
# checkpoint: Gemma-4's assistant (transformers' gemma4_assistant, vLLM 0.32's gemma4_mtp) is a small
# decoder whose layers hold queries only and attend to the target's own KV cache.
GEMMA4_ASSISTANT = "an assistant model: transformers' gemma4_assistant, vLLM's gemma4_mtp"
UNIFIED_ASSISTANT = "an assistant model: transformers' gemma4_unified_assistant, vLLM's gemma4_mtp"
SEPARATE_MODEL = {
    "Gemma4ForCausalLM": GEMMA4_ASSISTANT,
    "Gemma4ForConditionalGeneration": GEMMA4_ASSISTANT,
    "Gemma4UnifiedForCausalLM": UNIFIED_ASSISTANT,
    "Gemma4UnifiedForConditionalGeneration": UNIFIED_ASSISTANT,
}


def layout_of(config: dict) -> Layout:
    """The MTP layout of a target config (dict form), or a one-line UserError: an architecture whose layout
    draftsmith does not read, one whose layer it does not train (UNSERVED), or a quantized checkpoint."""
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture in UNSERVED:
        raise UserError(
            f"drafter.type=mtp: draftsmith does not train a {architecture} target's MTP layer: {UNSERVED[architecture]}"
        )
    if architecture in SEPARATE_MODEL:
        raise UserError(
            f"drafter.type=mtp: a {architecture} target ships no MTP layer: its multi-token prediction is a model "
            f"of its own ({SEPARATE_MODEL[architecture]}; it reads the target's KV cache): train it with "
            "recipe=gemma4_assistant (drafter.type=gemma4_assistant), or another kind"
        )
    if architecture not in LAYOUTS:
        known = ", ".join(sorted(LAYOUTS))
        raise UserError(
            f"drafter.type=mtp: no MTP layer layout is known for a {architecture} target: draftsmith reads the MTP "
            f"layers of {known} targets only, each checked against vLLM 0.32's model of it (this target may ship "
            "none, or in a layout not checked here); train another kind"
        )
    layout = LAYOUTS[architecture]
    text = config.get("text_config") or {}
    sparse = (text or config).get("sparse_attention_config") or {}
    if sparse.get("sparse_init_block", 0) != 0 or sparse.get("sparse_local_block", 1) != 1:
        # vLLM 0.32's block-sparse indexer always keeps the first `sparse_init_block` blocks and the query's last
        # `sparse_local_block`; draftsmith's (heads/mtp_blocks.py) keeps the query's own block alone, as releases set
        raise UserError(
            "drafter.type=mtp: the target's sparse_attention_config keeps "
            f"sparse_init_block={sparse.get('sparse_init_block', 0)} first and "
            f"sparse_local_block={sparse.get('sparse_local_block', 1)} local blocks, which vLLM 0.32's MTP layer "
            "always attends to and draftsmith's drafter does not (it keeps 0 and 1): train another kind"
        )
    quantized = config.get("quantization_config") or text.get("quantization_config")
    if quantized:
        # the layer's weights are stored quantized beside their scales (FP8 releases: `weight_scale_inv` per
        # 128x128 block): read as plain weights they would train and export wrong
        raise UserError(
            f"drafter.type=mtp: the target's checkpoint is quantized ({quantized.get('quant_method', '?')} in its "
            "config.json's quantization_config), and draftsmith fine-tunes an MTP layer stored unquantized: point "
            "target.name_or_path at the model's BF16 release"
        )
    if layout.count_block:
        check_depths(config, layout)
    if layout.kind_of_layer_0:  # depth 0's; the later depths asked for at mtp_depths.check_requested
        check_layer_0_kind(text or config, layout)
    if layout.stacked:
        mtp_stacked.kinds(text or config)
    return layout


def check_layer_0_kind(text: dict, layout: Layout, depths: int = 1) -> None:
    """A block vLLM 0.32 builds as the decoder's layer 0 where the config names no kind for it (`kind_of_layer_0`; the
    first `depths` blocks as layers 0.. where its model reads the step) is built here as `block_kind`'s sliding-window
    layer: a config whose block would attend otherwise is refused in one line: full attention (which vLLM's Exaone-MoE
    block rotates, and the family's full-attention layers beside sliding ones do not: NoPE), or a window of its own
    (`mtp_sliding_windows`, `sliding_windows`: vLLM reads entry j for depth j, transformers `sliding_window` for
    every layer). Only the fields vLLM reads for the layout (`reads_mtp_fields`; else `layer_types` alone, its window
    transformers' `sliding_window`). `layout_of` checks depth 0, `mtp_depths.check_requested` the depths asked for."""
    own = ("mtp_layer_types", "mtp_sliding_windows", "sliding_windows") if layout.reads_mtp_fields else ()
    read = {name: text.get(name) for name in own}
    kinds = read.get("mtp_layer_types") or text.get("layer_types") or [layout.block_kind[0]]
    windows = read.get("mtp_sliding_windows") or read.get("sliding_windows") or []
    named = "mtp_layer_types[j], else layer j's kind" if layout.reads_mtp_fields else "layer_types[j]: layer j's kind"
    for name, values in (("mtp_layer_types", kinds), ("mtp_sliding_windows", windows)):
        if read.get(name) and len(values) < depths:  # vLLM indexes entry j for depth j: an IndexError as it builds
            raise UserError(
                f"drafter.mtp_depths={depths}: vLLM 0.32 builds depth j from {name}[j], and the target's {name} has "
                f"{len(values)} entries: set drafter.mtp_depths to at most {len(values)}"
            )
    kind = next((kind for kind in kinds[:depths] if kind != layout.block_kind[0]), kinds[0])
    window = next((window for window in windows[:depths] if window != text.get("sliding_window")), None)
    if kind != layout.block_kind[0]:
        raise UserError(
            f"drafter.type=mtp: vLLM 0.32 builds the target's MTP layer with {kind} (depth j's {named}), and "
            f"draftsmith builds {layout.block_kind[0]} only: train another kind"
        )
    if window is not None:
        raise UserError(
            f"drafter.type=mtp: vLLM 0.32 gives the target's MTP layer a window of {window} keys "
            "(mtp_sliding_windows, else sliding_windows; depth j's entry j), transformers' layers "
            f"sliding_window={text.get('sliding_window')}: train another kind"
        )


def check_depths(config: dict, layout: Layout) -> None:
    """A target whose MTP block (`Layout.count_block`: Inkling's `mtp_config`, as vLLM reads it) and the text_config's
    copies of its fields (MTP_FIELDS: transformers copies the block's where text_config has no value of its own, even
    null, and draftsmith's drafter reads the text_config) disagree is refused in one line: transformers would build
    other depths than vLLM serves (their count, a chain norm or not, which of them attend in a sliding window)."""
    text = config.get("text_config") or config
    block = config.get(layout.count_block)
    if block is None:
        return
    count = int(block.get(layout.count_key) or 1)
    read = {  # as each reads it: no count is one depth, no chain norm false, no local ids none
        layout.count_key: lambda value: int(value or 1),
        "chain_hidden_post_norm": bool,
        "local_layer_ids": lambda value: {depth for depth in value or () if depth < count},
    }
    for theirs, ours in MTP_FIELDS:
        if ours in text and read[theirs](text[ours]) != read[theirs](block.get(theirs)):
            raise UserError(
                f"drafter.type=mtp: the target's text_config.{ours} and {layout.count_block}.{theirs} disagree "
                f"({text[ours]} and {block.get(theirs)}): transformers reads the first, vLLM 0.32 the second"
            )
