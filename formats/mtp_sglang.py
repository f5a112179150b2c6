"""The target's own MTP layer for SGLang (its NEXTN algorithm, which it runs as EAGLE with the layer as the draft).

SGLang builds the draft from a folder holding the target's config.json, whose architecture its ModelConfig rewrites to
its MTP model (configs/model_config.py `_config_draft_model`): DeepSeek-V3's and V3.2's to DeepseekV3ForCausalLMNextN,
GLM-5's to GlmMoeDsaForCausalLMNextN, GLM-4.5's to Glm4MoeForCausalLMNextN, GLM-4.7-Flash's (glm4_moe_lite, which no
vLLM release serves: heads/mtp_layouts.py) to Glm4MoeLiteForCausalLMNextN, Qwen3-Next's to Qwen3NextForCausalLMMTP,
Qwen3.5's to Qwen3_5ForCausalLMMTP, GLM-5-Next's to Glm5NextForConditionalGenerationNextN, HY-V3's to
HYV3ForCausalLMNextN, LongCat-Flash's to LongcatFlashForCausalLMNextN, DeepSeek-V4's to DeepseekV4ForCausalLMNextN,
ERNIE-4.5's to Ernie4_5_MoeForCausalLMMTP, Nemotron-H's to NemotronHForCausalLMMTP, Ling-3.0's to
BailingMoeForCausalLMNextN, HY-V4's to HYV4ForCausalLMNextN, the Qwen4-Exp release's wrapper (the only Qwen4-Exp
architecture SGLang serves, a target or a draft: the folder holds the wrapper's config whole) to Qwen4ExpForCausalLMMTP
and the Dots3-Note release's flat config (its model type the only one SGLang reads) to Dots3NoteForCausalLMNextN.
Those models read the layer under the names the vLLM folder holds (formats/mtp.py): DeepSeek's, GLM's, Ling's and
Dots3's loaders take `model.layers.{num_hidden_layers}.*` (V4's maps `mtp.0.*` there, HY-V4's `model.mtp_layers.0.*`;
Dots3's reads its own embedding beside) and all but Dots3's assert `num_nextn_predict_layers == 1`; Qwen's and
Nemotron-H's take `mtp.*`, ERNIE's `model.mtp_*.0`, depth 0 only. Checked against SGLang 0.5.23's source (read, not
run: SGLang's kernels need CUDA; docs/results/sglang-0.5.23-mtp-source.md), where each differs from vLLM's models:

- one layer at every draft step: no depth i for step i (its multi-layer worker takes none of these models);
- the embedding at position 0 is read, not zeroed (no model above but ERNIE's masks it): a DeepSeek (V4 too), GLM,
  HY (V3, V4) or Dots3-Note layer trains for SGLang with `drafter.masks_first_position=false`, a function no vLLM
  release computes;
- a later step reads the layer's output after its final norm (the state each forward returns to the logits
  processor, which the EAGLE worker feeds back; V4's its streams, ERNIE's the block's output, as vLLM's): GLM-4.5's
  trains with `drafter.feeds_back_normed=true`;
- a tensor the folder lacks is left uninitialised and one it does not read is skipped, without a word (the export
  checks the names exactly: GLM-4.5's loader skips fused experts, Qwen3-Next's raises on them, and their layouts write
  one tensor per expert); embed_tokens and lm_head are the target's (set_embed_and_head), read from no folder;
- V3.2's, GLM-5's and GLM-5-Next's later steps reuse the first one's sparse-attention selection where the draft's
  config says `index_share_for_mtp_iteration` (there is no server flag), which the folder's config turns off;
  Qwen4-Exp's where its text_config does not say false (SGLang's default is true): the folder's says false;
- LongCat-Flash's config defaults `mla_scale_q_lora` and `mla_scale_kv_lora` to true where draftsmith (and
  transformers) read an absent key as false: the folder's config writes them;
- ERNIE-4.5's MTP block rotates interleaved pairs unless the config says `rope_is_neox_style` (vLLM's, a Llama layer,
  neox-style): the folder's config sets it, which SGLang's target does not read;
- some read the target's config.json otherwise than transformers, for the target too (formats/mtp_sglang_reads.py),
  serve one dtype whatever --dtype says (SERVED_DTYPE) or only some chains (SERVED_GAMMAS): refused.
"""

from __future__ import annotations

import json
import re

from draftsmith.errors import UserError
from draftsmith.formats import Source
from draftsmith.formats.mtp_sglang_reads import READS_OTHERWISE
from draftsmith.formats.repo import SGLANG_FLAGS, SGLANG_REVISION_FLAG, EngineRepo, TargetInfo
from draftsmith.heads import mtp_depths
from draftsmith.heads.mtp import text_fields
from draftsmith.heads.mtp_family import decoder_layers
from draftsmith.heads.mtp_layer import Layout, shipped_config
from draftsmith.heads.mtp_layouts import LAYOUTS

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
    "DeepseekV4ForCausalLM": "DeepseekV4ForCausalLMNextN",
    "Ernie4_5_MoeForCausalLM": "Ernie4_5_MoeForCausalLMMTP",
    "NemotronHForCausalLM": "NemotronHForCausalLMMTP",
    "BailingMoeV3ForCausalLM": "BailingMoeForCausalLMNextN",
    "HYV4ForCausalLM": "HYV4ForCausalLMNextN",
    "Qwen4ExpForCausalLM": "Qwen4ExpForCausalLMMTP",  # draftsmith's load of the wrapper: its language model
    "Qwen4ExpForConditionalGeneration": "Qwen4ExpForCausalLMMTP",
    "Dots3NoteForCausalLM": "Dots3NoteForCausalLMNextN",  # the release's flat config.json (model_type dots3_note)
}
# Models SGLang builds only from a vision-language wrapper's config (its _config_draft_model rewrites the wrapper's
# architecture alone, and it has no model for the language model's): the folder holds the wrapper's config.json whole
WRAPPED = {"Qwen4ExpForCausalLMMTP": "Qwen4ExpForConditionalGeneration"}
# Models computing the layer otherwise than COMPUTED_AS: DeepSeek-V4's forward hands the next step its
# hyper-connection streams before its hc_head, unnormed; ERNIE-4.5's zeroes position 0 and has no final norm (both as
# vLLM's models do)
COMPUTES = {
    "DeepseekV4ForCausalLMNextN": {"feeds_back_normed": False},
    "Qwen4ExpForCausalLMMTP": {"feeds_back_normed": False},  # its streams, unmixed (vLLM's too)
    "Ernie4_5_MoeForCausalLMMTP": {"masks_first_position": True, "feeds_back_normed": False},
}
# Keys the folder's config.json sets for the draft alone (SGLang's target reads its own), so that its model computes
# the layer as trained: ERNIE-4.5's MTP block is SGLang's ERNIE decoder layer, which rotates interleaved pairs unless
# rope_is_neox_style, where vLLM's (a Llama layer) rotates neox-style, as draftsmith trains it; Qwen4-Exp's later draft
# steps reuse the first one's QSA selection unless its text_config says index_share_for_mtp_iteration false (SGLang's
# Qwen4ExpTextConfig defaults it to true; speculative/eagle_worker_v2.py reads the text_config's), where draftsmith's
# layer selects at every step, as vLLM's does
DRAFT_KEYS = {
    "Ernie4_5_MoeForCausalLMMTP": {"rope_is_neox_style": True},
    "Qwen4ExpForCausalLMMTP": {"index_share_for_mtp_iteration": False},
}
# Models SGLang serves in one dtype whatever --dtype says, the target's too -> (the dtype, why): Qwen4-Exp's gated
# residuals' weights (HyperConnectionConfig(params_dtype=bfloat16), which another dtype's activations meet in F.linear),
# Dots3's MLA kv_b_proj (models/dots3_common/modeling.py asserts it)
SERVED_DTYPE = {
    "Qwen4ExpForCausalLMMTP": ("bfloat16", "builds its hyper-connections' weights in bfloat16 whatever --dtype says"),
    "Dots3NoteForCausalLMNextN": ("bfloat16", "asserts its MLA kv_b_proj is bfloat16 (or block FP8)"),
}
# Models that serve only these γ: Dots3's sliding-window MLA attends through a fallback taking 1 or 4 query tokens
# a request (layers/attention/swa_mla_fallback/forward.py), the target's verification and the draft's extend γ + 1
SERVED_GAMMAS = {"Dots3NoteForCausalLMNextN": (3,)}
# Models whose loader reads layer `num_hidden_layers`, but layer 0 where the decoder has one layer (the target's own;
# GLM-5-Next's keeps layer 1's names first, then looks for layer 0's: it loads nothing)
MISREADS_ONE_LAYER = {
    "DeepseekV3ForCausalLMNextN", "GlmMoeDsaForCausalLMNextN", "Glm4MoeForCausalLMNextN", "Glm4MoeLiteForCausalLMNextN",
    "Glm5NextForConditionalGenerationNextN", "DeepseekV4ForCausalLMNextN", "BailingMoeForCausalLMNextN",
    "HYV4ForCausalLMNextN", "Dots3NoteForCausalLMNextN",
}  # fmt: skip
# Models whose CUDA forward norms [embedding | hidden] with one kernel (DeepseekModelNextN's fused_eh_norm), which
# raises unless 256 < hidden_size <= 8192 and hidden_size % 256 == 0, with no fallback
FUSED_EH_NORM = {"DeepseekV3ForCausalLMNextN", "GlmMoeDsaForCausalLMNextN", "Glm5NextForConditionalGenerationNextN"}


def sglang_model(architecture: str) -> str:
    model = SGLANG_MODELS.get(architecture)
    if model is None:
        families = {re.sub("For(CausalLM|ConditionalGeneration)$", "", name) for name in SGLANG_MODELS}
        checked = ", ".join(sorted(families))
        raise UserError(
            f"draftsmith has not checked SGLang's MTP model for {architecture} (checked: {checked}); export for vllm"
        )
    return model


def computed_as(architecture: str) -> dict:
    """The layer as SGLang's model for `architecture` computes it (`drafter.*` settings)."""
    return COMPUTED_AS | COMPUTES.get(sglang_model(architecture), {})


def trained_for_sglang_alone(drafter) -> bool:
    """Whether the drafter's layer trained with the embedding at position 0 read (drafter.masks_first_position=false)
    where vLLM's model of its release zeroes it: SGLang's function, which no vLLM release computes."""
    return drafter.layout.masks_first_position != LAYOUTS[drafter.config.decoder["architecture"]].masks_first_position


def vllm_instead(drafter) -> str:
    """What a line refusing SGLang advises: the vllm export; for a drafter trained for SGLang alone
    (`trained_for_sglang_alone`) training it for vLLM first; for a target no vLLM release serves the MTP layer of,
    that neither engine would."""
    if LAYOUTS[drafter.config.decoder["architecture"]].vllm_refused:
        return "no engine serves it here (no vLLM release checked serves this target's MTP layer either)"
    if not trained_for_sglang_alone(drafter):
        return "export it for vllm"
    return (
        "no engine serves this drafter as it trained (drafter.masks_first_position=false, which no vLLM release "
        "computes): train it with drafter.masks_first_position unset and export it for vllm"
    )


def sglang_training(drafter) -> str:
    """The `drafter.*` settings that train the layer as SGLang computes it (COMPUTED_AS, COMPUTES), each where it is
    not the recipe's default (the layer as vLLM's model of its release computes it)."""
    architecture = drafter.config.decoder["architecture"]
    computed, default = computed_as(architecture), LAYOUTS[architecture]
    keys = [key for key in ("masks_first_position", "feeds_back_normed") if computed[key] != getattr(default, key)]
    return " ".join(f"drafter.{key}={str(computed[key]).lower()}" for key in keys) or "the recipe's defaults"


def refusal(drafter, target: TargetInfo) -> str | None:
    """`refuse`'s line, or None where SGLang serves this MTP drafter as it trained."""
    try:
        refuse(drafter, target)
    except UserError as err:
        return str(err)
    return None


def refuse(drafter, target: TargetInfo) -> None:
    """One line for why SGLang would not serve this MTP drafter as it trained, from the configs alone."""
    model = sglang_model(drafter.config.decoder["architecture"])
    depths = mtp_depths.depths_of(drafter)
    if depths > 1:
        raise UserError(
            f"this MTP drafter trained {depths} depths, one per draft step, and SGLang's {model} runs one layer at "
            "every step (it reads layer 0 alone): export it for vllm, or train with drafter.mtp_depths=1"
        )
    computed = computed_as(drafter.config.decoder["architecture"])
    differ = []  # every way the layer trained otherwise than SGLang computes it, in one line: a retraining mends all
    if drafter.layout.masks_first_position != computed["masks_first_position"]:
        trained, served = (
            (f"zeroed, as vLLM's {drafter.layout.vllm_model} computes it,", "reads")
            if drafter.layout.masks_first_position
            else ("read,", "zeroes")
        )
        differ.append(f"with the embedding at position 0 {trained} and SGLang's {model} {served} it")
    if drafter.layout.feeds_back_normed != computed["feeds_back_normed"]:
        trained, served = ("after", "before") if drafter.layout.feeds_back_normed else ("before", "after")
        differ.append(
            f"later draft steps on the layer's output {trained} its final norm, and SGLang's {model} feeds them the "
            f"output {served} it"
        )
    if differ:
        raise UserError(
            f"this MTP drafter trained {'; and '.join(differ)}: {vllm_instead(drafter)}, or train with "
            f"{sglang_training(drafter)} for sglang"
        )
    hidden = target.shape.hidden_size
    if model in FUSED_EH_NORM and not (256 < hidden <= 8192 and hidden % 256 == 0):
        raise UserError(
            f"SGLang's {model} norms its inputs with a CUDA kernel (fused_eh_norm) that refuses hidden_size={hidden} "
            f"(it takes multiples of 256 from 512 to 8192): {vllm_instead(drafter)}"
        )
    if model in MISREADS_ONE_LAYER and decoder_layers(text_fields(target.config)) == 1:
        raise UserError(
            f"SGLang's {model} does not load a one-layer target's MTP layer (layer 1): its loader then reads layer 0, "
            f"the decoder's own: {vllm_instead(drafter)}"
        )
    if model in WRAPPED and target.config_json.get("architectures") != [WRAPPED[model]]:
        raise UserError(
            f"SGLang builds its {model} from a {WRAPPED[model]} target only (the release's wrapper: it has no model "
            f"for {drafter.config.decoder['architecture']}): {vllm_instead(drafter)}"
        )
    dtype, why = SERVED_DTYPE.get(model, (None, ""))
    if dtype and target.config.get("dtype") != dtype:
        raise UserError(
            f"SGLang's {model} {why} (its target's too), and this export serves the target in "
            f"{target.config.get('dtype')}: export with target.dtype={dtype}, or for vllm"
        )
    read_otherwise = READS_OTHERWISE.get(model)
    shipped = text_fields(shipped_config(target.shape.name_or_path, target.config))
    why = read_otherwise(shipped, text_fields(target.config)) if read_otherwise else ""
    if why:
        raise UserError(f"SGLang's {model} {why}: {vllm_instead(drafter)}")


def repo(source: Source, gamma: int, layout: Layout, config: dict, tensors: dict, expected: dict) -> EngineRepo:
    """The SGLang folder drafting `gamma` tokens a step: the vLLM folder's config (one depth, edited in place) and
    tensors, served as NEXTN."""
    model = sglang_model(source.drafter.config.decoder["architecture"])
    if model in SERVED_GAMMAS and gamma not in SERVED_GAMMAS[model]:
        served = " or ".join(map(str, SERVED_GAMMAS[model]))
        raise UserError(
            f"SGLang's {model} verifies {served} draft tokens a step only (its sliding-window attention's fallback "
            f"takes 1 or 4 query tokens a request), and this export drafts {gamma}: export with "
            f"export.num_speculative_tokens={served}, or for vllm"
        )
    built_from = f"the target's config.json as shipped, {layout.count_key}=1"
    if model in WRAPPED:  # the wrapper's whole, the language model's config as the vLLM folder holds it its text_config
        whole = source.target.config_json
        language_model = {key: value for key, value in config.items() if key not in ("architectures", "model_type")}
        config = {**whole, "text_config": {**whole["text_config"], **language_model}}
        built_from = f"the target's config.json as shipped ({WRAPPED[model]}'s, whole), {layout.count_key}=1 in it"
    text = text_fields(config)
    conventions = {
        "config": f"{built_from}: SGLang builds its {model} model",
        "weights": f"the fine-tuned MTP layer under the target checkpoint's names and shapes "
        f"({layout.prefix(decoder_layers(text))}*), which {model} reads",
        "shared": "embed_tokens and lm_head are the target's (SGLang shares them; not in the folder)",
        "hidden": (
            "the target's last hyper-connection streams (before it mixes them down) at the first draft step, the "
            "layer's own (unnormed, unmixed) at later ones"
            if layout.streams
            else "the target's final (post-norm) hidden state at the first draft step, the layer's output "
            + ("after its final norm" if layout.final_norm else "(it has no final norm)")
            + " at later ones"
        )
        + (
            "; the embedding at position 0 zeroed"
            if layout.masks_first_position
            else "; the embedding at position 0 read, not zeroed"
        ),
        "checked_against": f"{CHECKED}'s source: configs/model_config.py, its model of the layer, "
        "speculative/eagle_worker_v2.py (read, not run)",
    }
    for flag in (flag for _, flag, _ in layout.scaled_norms if flag not in text):
        text[flag] = False  # as draftsmith read the config; SGLang's LongCat config defaults it to true
    if DRAFT_KEYS.get(model):
        text |= DRAFT_KEYS[model]
        conventions["draft_keys"] = (
            f"{', '.join(f'{key}={json.dumps(value)}' for key, value in DRAFT_KEYS[model].items())}: read by SGLang's "
            f"{model} alone (its target reads the target's config), so that it computes the layer as trained"
        )
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
