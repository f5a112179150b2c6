"""The causal LM draftsmith runs for a text-only release that transformers reads as a vision-language wrapper's text
config and maps to no model class of its own (draftsmith.causal_lm.text_model_of_a_wrapper; Step-3.5's step3p5, whose
config is Step-3.7's text config): the wrapper module's text model, its weights read under the release's names by the
wrapper's own checkpoint conversion less the renames that nest the text model inside the wrapper, and the release's
lm_head beside it, in a `TextOfWrapper` (named as a causal LM names them: `model.*`, `lm_head`). A module of its own:
it imports transformers, which the modules a recipe check reads must not."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Optional

import torch

from draftsmith.errors import UserError
from draftsmith.model_files import TRANSFORMERS_LAYERS, read_pretrained
from draftsmith.wrapped_text import TextOfWrapper

HEAD = "lm_head.weight"
# the attribute a wrapper's model holds its text model under, which the wrapper's renames of the release's
# `model.layers.*` (and embeddings, final norm) add: a text model read alone keeps the release's names
NESTING = "language_model."


def read_text_model_lm(section, config, dtype: torch.dtype) -> TextOfWrapper:
    """The text model of `config`'s wrapper module and the lm_head, their weights read from the release."""
    from draftsmith.target_loading import HeldLoadReport

    text_class = text_model_class(config, section.name_or_path)
    register_text_conversion(config)
    allow_global_values(config)
    report = HeldLoadReport()
    try:
        text_model, loading = read_pretrained(
            text_class.from_pretrained,
            section.name_or_path,
            f"cannot load target {section.name_or_path!r}",
            config=config,
            revision=section.revision,
            dtype=dtype,
            use_safetensors=True,  # never unpickle a target's weights: a pickle can run code it holds
            output_loading_info=True,
            **TRANSFORMERS_LAYERS,
        )
    finally:
        report.stop()
    if loading["unexpected_keys"] == {HEAD} and not loading["missing_keys"] and not loading["mismatched_keys"]:
        report.held.clear()  # the one tensor the report lists is the lm_head, read beside the text model below
    report.release(loading, text_model.config, section.name_or_path)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=text_model.dtype)
    model = TextOfWrapper(text_model.config, text_model, head)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    else:
        with torch.no_grad():
            head.weight.copy_(head_weight(section))
    return model


def built_text_model_lm(config, dtype: Optional[torch.dtype] = None) -> TextOfWrapper:
    """The model `read_text_model_lm` reads, built from `config` alone with the weights its family initialises (or
    none, on the meta device): what a sharded load fills and a random target of the family is drawn into."""
    allow_global_values(config)
    text_model = text_model_class(config, config.name_or_path or config.model_type)._from_config(config, dtype=dtype)
    head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=text_model.dtype)
    model = TextOfWrapper(text_model.config, text_model, head)
    model.tie_weights()
    return model


def allow_global_values(config) -> None:
    """A config whose layers differ in a field (Step-3.5's sliding layers have more query heads) refuses to give the
    field's global value unless asked; draftsmith's readers of the target's shape take the release's global value, as
    vLLM's config gives it (the attention's FLOPs are counted per layer: draftsmith.trainer.observe.attention_width)."""
    config.allow_global_per_layer_attribute_access = True


def text_model_class(config, name_or_path: str) -> type:
    """The one model class of the wrapper module `config`'s class is defined in whose config is that class (the
    wrapper's text model), or a refusal in one line."""
    from transformers import PreTrainedModel

    config_class = type(config)
    module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
    found = [
        cls
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, PreTrainedModel) and cls.__module__ == module.__name__ and cls.config_class is config_class
    ]
    if len(found) != 1:
        raise UserError(
            f"cannot load target {name_or_path!r}: transformers maps model_type {config.model_type!r} to no model "
            f"class, and its module has {len(found)} model classes of its config {config_class.__name__}, not one "
            "text model to run with the checkpoint's lm_head: give a causal LM"
        )
    return found[0]


def register_text_conversion(config) -> None:
    """Registers, once a process, how transformers reads the release's tensors into the text model: the conversion
    of the wrapper whose text config `config`'s class is (the experts' tensors renamed and stacked as the release
    stores them), without its renames into the wrapper's text model attribute."""
    from transformers import PreTrainedConfig
    from transformers.conversion_mapping import (
        WeightRenaming,
        get_checkpoint_conversion_mapping,
        register_checkpoint_conversion_mapping,
    )

    if get_checkpoint_conversion_mapping(config.model_type) is not None:
        return
    module = importlib.import_module(type(config).__module__)
    wrappers = [
        cls.model_type
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, PreTrainedConfig) and getattr(cls, "sub_configs", {}).get("text_config") is type(config)
    ]
    conversions = [mapping for wrapper in wrappers if (mapping := get_checkpoint_conversion_mapping(wrapper))]
    if not conversions:
        return  # the release's names are the text model's own
    kept = [
        step
        for step in conversions[0]
        if not (isinstance(step, WeightRenaming) and any(NESTING in target for target in step.target_patterns))
    ]
    register_checkpoint_conversion_mapping(config.model_type, kept)


def head_weight(section) -> torch.Tensor:
    """The release's lm_head tensor, from the safetensors file its index names (or its one file)."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    def fetched(filename: str, required: bool = True):
        return cached_file(
            section.name_or_path,
            filename,
            revision=section.revision,
            _raise_exceptions_for_missing_entries=required,
        )

    index = fetched("model.safetensors.index.json", required=False)
    filename = json.loads(Path(index).read_text())["weight_map"].get(HEAD) if index else "model.safetensors"
    with safe_open(fetched(filename or "model.safetensors"), framework="pt") as tensors:
        if HEAD in tensors.keys():
            return tensors.get_tensor(HEAD)
    raise UserError(
        f"cannot load target {section.name_or_path!r}: its checkpoint has no {HEAD} and its config does not tie it to "
        "the input embedding"
    )
