"""A vision-language wrapper's tiny config around a tiny language model (draftsmith.tiny_config's), as transformers
builds it or as its releases ship it: a tiny vision (and audio) tower, a projector as wide as the language model, and
the fields a release's config carries where vLLM reads them (draftsmith.random_target writes models of them)."""

from __future__ import annotations

import inspect
from typing import Any

from huggingface_hub.errors import StrictDataclassError

from draftsmith.causal_lm import text_has_causal_lm, wraps_a_text_model
from draftsmith.errors import UserError, one_line

# A vision-language wrapper's vision tower at a tiny size (its out_hidden_size: the language model's hidden size):
# text prompts never reach it, but the wrapper's checkpoint holds one, as a release does.
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 16}
# TINY_VISION's sizes under the names other vision configs give them (MiniMax-M3's layers and heads)
VISION_NAMES = {"depth": "num_hidden_layers", "num_heads": "num_attention_heads"}
# and under those of an encoder-free embedder (Gemma-4 Unified's width and position table), where its class has them
EMBEDDER_NAMES = {"hidden_size": "mm_embed_dim", "num_position_embeddings": "mm_posemb_size"}
OUTPUT_NAMES = ("out_hidden_size", "output_proj_dims")  # a tower's output width's names: its language model's
# A wrapper's tower sizes its class keeps at its top that a release's vision config also carries, under the release's
# names, where vLLM reads them (Muse Glimmer's merged output and adapter widths): release name -> the class's name
TOWER_RELEASE_NAMES = {"output_dim": "out_hidden_size", "adapter_dim": "projector_hidden_size"}
# A release's vision config's tokens per image (vLLM's Gemma-4 Unified reads `num_soft_tokens`), which its class has
# no field for: the default of the family's processor class (its image budget) -> release name
PROCESSOR_BUDGETS = {"image_seq_length": "num_soft_tokens"}


def tiny_wrapper_config(model_type: str, text, released: bool = False):
    """The config of `model_type`'s wrapper around the language model `text` with a tiny vision tower, for a
    wrapper transformers has no causal LM class for (its text model's type has none either: the wrapper is the
    target), or for any wrapper where `released`: the release's form, whose checkpoint names and architecture an
    engine reads (MiniMax-M3's MTP layer sits under the wrapper's names, and vLLM maps only the wrapper's type to its
    MTP model; vLLM registers Gemma-4 Unified's wrapper, which transformers loads as a causal LM itself, and not its
    language model's class); None for any other model type. The towers (vision, and audio where the wrapper has one) are
    `tiny_tower`'s, a projector between tower and language model (MiniMax-M3's `projector_hidden_size`) as wide as the
    language model; a class that refuses them is its reason in one line."""
    from transformers import AutoConfig

    wrapped = {"model_type": model_type, "text_config": text.to_dict()}
    if not (wraps_a_text_model(wrapped) or released and is_a_causal_lm_wrapper(model_type, text.model_type)):
        return None  # then its language model is written alone
    if text_has_causal_lm(wrapped) and not released:  # a wrapper of a causal LM: that causal LM, unless released
        return None
    default = AutoConfig.for_model(model_type)
    # a tower the class's default leaves out (Gemma-4 Unified's, set by its release) is its tower class's default's
    vision = default.vision_config or type(default).sub_configs["vision_config"]()
    towers = {"vision_config": tiny_tower(vision.to_dict(), text.hidden_size)}
    if getattr(default, "audio_config", None) is not None:
        # an audio encoder beside (Muse Spark's): tiny in the sizes its class has (another's default is kept: Inkling's)
        fields = default.audio_config.to_dict()
        audio = {name: size for name, size in tiny_tower(fields, text.hidden_size).items() if name in fields}
        towers |= {"audio_config": audio} if audio else {}
    sizes = {"projector_hidden_size": text.hidden_size} if hasattr(default, "projector_hidden_size") else {}
    if isinstance(getattr(default, "out_hidden_size", None), int):
        # the tower's merged output the wrapper's projector reads (Muse Glimmer's: the tower's width times the
        # patches merged), in the same proportion to the tiny tower's width as the release's to its tower's
        sizes["out_hidden_size"] = default.out_hidden_size // vision.hidden_size * TINY_VISION["hidden_size"]
    try:
        config = AutoConfig.for_model(model_type, text_config=text.to_dict(), **towers, **sizes)
    except (StrictDataclassError, ValueError) as err:  # the class's own checks across its towers' sizes
        name = type(default).__name__
        raise UserError(f"transformers' {name} refuses the tiny {model_type} wrapper: {one_line(err)}") from None
    top, vision = release_wrapper_fields(config, text)
    for name, value in top.items():
        setattr(config, name, value)
    for name, value in vision.items():
        setattr(config.vision_config, name, value)
    return config


def release_wrapper_fields(config, text) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fields a wrapper's release carries that transformers' class has none for and vLLM 0.32 reads, at the
    wrapper's top and in its vision config, each where the class lacks it: the language model's vocabulary at the top
    (vLLM's MTP model of a wrapper reads it there: Exaone-4.5's); the tower's sizes the class keeps at the top, in the
    vision config under the release's names (TOWER_RELEASE_NAMES); the tower's tokens per image, its processor
    class's default (PROCESSOR_BUDGETS)."""
    fields = config.to_dict()
    top = {} if "vocab_size" in fields else {"vocab_size": text.vocab_size}
    vision = {ours: fields[theirs] for ours, theirs in TOWER_RELEASE_NAMES.items() if theirs in fields}
    vision |= processor_budgets(config.model_type)
    return top, {name: value for name, value in vision.items() if name not in fields["vision_config"]}


def processor_budgets(model_type: str) -> dict[str, int]:
    """PROCESSOR_BUDGETS' defaults of `model_type`'s processor class, under the release's names; none where transformers
    has no processor for it or cannot import one here (a processor module that imports torchvision)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    try:
        processor = getattr(transformers, PROCESSOR_MAPPING_NAMES.get(model_type) or "", None)
    except ImportError:
        return {}
    defaults = inspect.signature(processor.__init__).parameters if processor else {}
    budgets = {ours: defaults[theirs].default for theirs, ours in PROCESSOR_BUDGETS.items() if theirs in defaults}
    return {name: value for name, value in budgets.items() if isinstance(value, int)}


def tiny_tower(fields: dict[str, Any], width: int) -> dict[str, Any]:
    """A vision or audio tower's sizes (`fields`: its class's defaults) at TINY_VISION's, under the names its class
    gives them, its output as wide as the language model (`width`). A tower of stages, sized by per-stage lists
    (Muse Spark's audio encoder: `hidden_sizes`, `depths`), keeps its stages, each at the tiny width and depth, so
    that its stage count (`num_hidden_layers`) still matches the lists."""

    def named(name: str) -> str:
        if name in fields or EMBEDDER_NAMES.get(name) not in fields:
            return name if name in fields else VISION_NAMES.get(name, name)
        return EMBEDDER_NAMES[name]

    tower = {named(name): size for name, size in TINY_VISION.items()}
    if "num_key_value_heads" in fields:  # a tower's own key-value heads (Exaone-4.5's 8): as many as its tiny heads
        tower["num_key_value_heads"] = TINY_VISION["num_heads"]
    staged = {f"{name}s": size for name, size in TINY_VISION.items() if isinstance(fields.get(f"{name}s"), list)}
    if staged:
        tower = {name: size for name, size in tower.items() if name in fields and name != "num_hidden_layers"}
        tower.update({name: [size] * len(fields[name]) for name, size in staged.items()})
    return tower | {next((name for name in OUTPUT_NAMES if name in fields), OUTPUT_NAMES[0]): width}


def is_a_causal_lm_wrapper(model_type: str, text_type: str) -> bool:
    """Whether `model_type` is a vision-language wrapper around the language model `text_type` that transformers loads
    as a causal LM itself (Gemma-4 Unified's, Qwen4-Exp's)."""
    from transformers import AutoConfig

    from draftsmith.causal_lm import may_be_a_causal_lm

    wrapper = type(AutoConfig.for_model(model_type))
    return model_type != text_type and "text_config" in wrapper.sub_configs and may_be_a_causal_lm(model_type)
