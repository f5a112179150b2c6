"""The target's own MTP layer for SGLang (its NEXTN algorithm, which it runs as EAGLE with the layer as the draft).

SGLang builds the draft from a folder holding the target's config.json, whose architecture its ModelConfig rewrites to
its MTP model (configs/model_config.py `_config_draft_model`): DeepSeek-V3's and V3.2's to DeepseekV3ForCausalLMNextN,
GLM-5's to GlmMoeDsaForCausalLMNextN, GLM-4.5's to Glm4MoeForCausalLMNextN, GLM-4.7-Flash's (glm4_moe_lite, which no
vLLM release serves: heads/mtp_layouts.py) to Glm4MoeLiteForCausalLMNextN, Qwen3-Next's to Qwen3NextForCausalLMMTP,
Qwen3.5's to Qwen3_5ForCausalLMMTP, GLM-5-Next's to Glm5NextForConditionalGenerationNextN, HY-V3's to
HYV3ForCausalLMNextN and LongCat-Flash's to LongcatFlashForCausalLMNextN. Those models read the layer under the names
the vLLM folder holds (formats/mtp.py): DeepSeek's and GLM's loaders take `model.layers.{num_hidden_layers}.*` and
assert `num_nextn_predict_layers == 1`; Qwen's take `mtp.*`, layer 0 only. Checked against SGLang 0.5.23's source
(read, not run: SGLang's kernels need CUDA; docs/results/sglang-0.5.23-mtp-source.md), where each differs from vLLM's
models:

- one layer at every draft step: no depth i for step i (its multi-layer worker takes none of these models);
- the embedding at position 0 is read, not zeroed (no model above masks it): a DeepSeek, GLM or HY-V3 layer trains for
  SGLang with `drafter.masks_first_position=false`, a function no vLLM release computes;
- a later step reads the layer's output after its final norm (the state each forward returns to the logits
  processor, which the EAGLE worker feeds back): GLM-4.5's trains with `drafter.feeds_back_normed=true`;
- a tensor the folder lacks is left uninitialised and one it does not read is skipped, without a word (the export
  checks the names exactly: GLM-4.5's loader skips fused experts, Qwen3-Next's raises on them, and their layouts write
  one tensor per expert); embed_tokens and lm_head are the target's (set_embed_and_head), read from no folder;
- V3.2's, GLM-5's and GLM-5-Next's later steps reuse the first one's sparse-attention selection where the draft's
  config says `index_share_for_mtp_iteration` (there is no server flag), which the folder's config turns off;
- LongCat-Flash's config defaults `mla_scale_q_lora` and `mla_scale_kv_lora` to true where draftsmith (and
  transformers) read an absent key as false: the folder's config writes them.
"""

from __future__ import annotations

from draftsmith.errors import UserError
from draftsmith.formats import Source
from draftsmith.formats.repo import SGLANG_FLAGS, SGLANG_REVISION_FLAG, EngineRepo, TargetInfo
from draftsmith.heads import mtp_depths
from draftsmith.heads.mtp import text_fields
from draftsmith.heads.mtp_family import decoder_layers
from draftsmith.heads.mtp_layer import Layout

SGLANG_SERVE = (
    "python -m sglang.launch_server --model-path {target} --speculative-algorithm NEXTN "
    "--speculative-draft-model-path {path} --speculative-num-steps {gamma} --speculative-eagle-topk 1 "
    "--speculative-num-draft-tokens {gamma_plus_one}" + SGLANG_FLAGS
)
# the layer as SGLang computes it (`drafter.*`): an SGLang folder read back is built so
COMPUTED_AS = {"masks_first_position": False, "feeds_back_normed": True}
SERVED_AS = {"method": "NEXTN", "revision_flag": SGLANG_REVISION_FLAG}  # SGLang's name for it, its revision flag
CHECKED = "SGLang 0.5.23"  # the release whose source this module was read from
# The served config's architecture -> the MTP model SGLang builds for it
SGLANG_MODELS = {
    "DeepseekV3ForCausalLM": "DeepseekV3ForCausalLMNextN",
    "DeepseekV32ForCausalLM": "DeepseekV3ForCausalLMNextN",
    "GlmMoeDsaForCausalLM": "GlmMoeDsaForCausalLMNextN",
    "Glm4MoeForCausalLM": "Glm4MoeForCausalLMNextN",
    "Glm4MoeLiteForCausalLM": "Glm4MoeLiteForCausalLMNextN",
    "Glm5NextForConditionalGeneration": "Glm5NextForConditionalGenerationNextN",
    "HYV3ForCausalLM": "HYV3ForCausalLMNextN",
    "LongcatFlashForCausalLM": "LongcatFlashForCausalLMNextN",
    "Qwen3NextForCausalLM": "Qwen3NextForCausalLMMTP",
    "Qwen3_5ForCausalLM": "Qwen3_5ForCausalLMMTP",
    "Qwen3_5MoeForCausalLM": "Qwen3_5ForCausalLMMTP",
}
# Models whose loader reads layer `num_hidden_layers`, but layer 0 where the decoder has one layer (the target's own;
# GLM-5-Next's keeps layer 1's names first, then looks for layer 0's: it loads nothing)
MISREADS_ONE_LAYER = {
    "DeepseekV3ForCausalLMNextN", "GlmMoeDsaForCausalLMNextN", "Glm4MoeForCausalLMNextN", "Glm4MoeLiteForCausalLMNextN",
    "Glm5NextForConditionalGenerationNextN",
}  # fmt: skip
# Models whose CUDA forward norms [embedding | hidden] with one kernel (DeepseekModelNextN's fused_eh_norm), which
# raises unless 256 < hidden_size <= 8192 and hidden_size % 256 == 0, with no fallback
FUSED_EH_NORM = {"DeepseekV3ForCausalLMNextN", "GlmMoeDsaForCausalLMNextN", "Glm5NextForConditionalGenerationNextN"}


def sglang_model(architecture: str) -> str:
    model = SGLANG_MODELS.get(architecture)
    if model is None:
        checked = ", ".join(sorted({name.removesuffix("ForCausalLM") for name in SGLANG_MODELS}))
        raise UserError(
            f"draftsmith has not checked SGLang's MTP model for {architecture} (checked: {checked}); export for vllm"
        )
    return model


def refuse(drafter, target: TargetInfo) -> None:
    """One line for why SGLang would not serve this MTP drafter as it trained, from the configs alone."""
    model = sglang_model(drafter.config.decoder["architecture"])
    depths = mtp_depths.depths_of(drafter)
    if depths > 1:
        raise UserError(
            f"this MTP drafter trained {depths} depths, one per draft step, and SGLang's {model} runs one layer at "
            "every step (it reads layer 0 alone): export it for vllm, or train with drafter.mtp_depths=1"
        )
    if drafter.layout.masks_first_position:
        raise UserError(
            f"this MTP drafter trained with the embedding at position 0 zeroed, as vLLM's {drafter.layout.vllm_model} "
            f"computes it, and SGLang's {model} reads it: export it for vllm, or train with "
            "drafter.masks_first_position=false for sglang"
        )
    if not drafter.layout.feeds_back_normed:
        raise UserError(
            f"this MTP drafter trained later draft steps on the layer's output before its final norm, and SGLang's "
            f"{model} feeds them the output after it: export it for vllm, or train with drafter.feeds_back_normed=true "
            "for sglang"
        )
    hidden = target.shape.hidden_size
    if model in FUSED_EH_NORM and not (256 < hidden <= 8192 and hidden % 256 == 0):
        raise UserError(
            f"SGLang's {model} norms its inputs with a CUDA kernel (fused_eh_norm) that refuses hidden_size={hidden} "
            "(it takes multiples of 256 from 512 to 8192): export it for vllm"
        )
    if model in MISREADS_ONE_LAYER and decoder_layers(text_fields(target.config)) == 1:
        raise UserError(
            f"SGLang's {model} does not load a one-layer target's MTP layer (layer 1): its loader then reads layer 0, "
            "the decoder's own: export it for vllm"
        )


def repo(source: Source, layout: Layout, config: dict, tensors: dict, expected: dict) -> EngineRepo:
    """The SGLang folder: the vLLM folder's config (one depth, edited in place) and tensors, served as NEXTN."""
    model = sglang_model(source.drafter.config.decoder["architecture"])
    text = text_fields(config)
    conventions = {
        "config": f"the target's config.json as shipped, {layout.count_key}=1: SGLang builds its {model} model",
        "weights": f"the fine-tuned MTP layer under the target checkpoint's names and shapes "
        f"({layout.prefix(decoder_layers(text))}*), which {model} reads",
        "shared": "embed_tokens and lm_head are the target's (SGLang shares them; not in the folder)",
        "hidden": "the target's final (post-norm) hidden state at the first draft step, the layer's output after its "
        "final norm at later ones; the embedding at position 0 read, not zeroed",
        "checked_against": f"{CHECKED}'s source: configs/model_config.py, its model of the layer, "
        "speculative/eagle_worker_v2.py (read, not run)",
    }
    for flag in (flag for _, flag, _ in layout.scaled_norms if flag not in text):
        text[flag] = False  # as draftsmith read the config; SGLang's LongCat config defaults it to true
    sharing = [fields for fields in (config, text) if fields.get("index_share_for_mtp_iteration")]
    for fields in sharing:  # SGLang reads it from the draft's config alone (a wrapper's at either level)
        fields["index_share_for_mtp_iteration"] = False
    if sharing:
        conventions["selection"] = (
            "the target's config has later draft steps reuse the first one's sparse-attention selection "
            "(index_share_for_mtp_iteration), which the drafter did not train with: the folder's config turns it off, "
            "where SGLang reads it, so each draft step selects its own keys, as trained"
        )
    return EngineRepo("sglang", config, tensors, expected, SGLANG_SERVE, conventions, **SERVED_AS)
