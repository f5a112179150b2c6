"""Whether transformers loads a target's config as a causal LM (`AutoModelForCausalLM`, the class draftsmith loads
every target with), told from the config alone: a model type it maps to no causal LM class (a vision-language
wrapper whose language model transformers builds no model of alone) is refused in one line when the recipe is
checked, and at load time for a Hub id, instead of transformers' line listing its ~200 config classes after the data
is tokenized. A wrapper that transformers maps to its language model's causal LM class loads as that model; one it
loads only as an image-text-to-text model (`wraps_a_text_model`) loads as its language model and lm_head, inside
the language model's own causal LM class where transformers has one (`text_has_causal_lm`)."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any, Optional

# the module defining the model type -> class tables, read as source: a recipe is checked without importing
# transformers (its modules take seconds), and the tables are literals there
MAPPING_MODULE = ("models", "auto", "modeling_auto.py")
CAUSAL_LM_TABLE = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
WRAPPER_TABLE = "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"
MODEL_TABLE = "MODEL_MAPPING_NAMES"
# the table of model types whose config lives in another model type's module (a wrapper's text config in the wrapper's)
MODULE_TABLE = ("models", "auto", "auto_mappings.py"), "SPECIAL_MODEL_TYPE_TO_MODULE_NAME"


@functools.cache
def auto_module_tree(module: tuple[str, ...] = MAPPING_MODULE) -> Optional[ast.Module]:
    """A module of transformers' (under its package), parsed once a process (None where it cannot be read as this
    reads it)."""
    spec = importlib.util.find_spec("transformers")  # a top-level package's spec: transformers is not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return ast.parse(Path(spec.submodule_search_locations[0], *module).read_text())
    except (OSError, SyntaxError, ValueError):
        return None


@functools.cache
def literal_table(table_name: str, module: tuple[str, ...] = MAPPING_MODULE) -> Optional[dict[str, str]]:
    """The installed transformers' table `table_name` (model type -> class or module name), or None where the table
    is not where, or not what, this reads (then nothing is refused here, and transformers' load says what it says)."""
    tree = auto_module_tree(module)
    if tree is None:
        return None
    try:
        table = next(
            node.value.args[0]
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(name, ast.Name) and name.id == table_name for name in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
        )
        return dict(ast.literal_eval(table))
    except (StopIteration, ValueError, TypeError):
        return None


def mapped_types(table_name: str) -> Optional[frozenset[str]]:
    """The model types the installed transformers' table `table_name` maps to a class (None: see `literal_table`)."""
    table = literal_table(table_name)
    return None if table is None else frozenset(table)


def causal_lm_types() -> Optional[frozenset[str]]:
    """The model types AutoModelForCausalLM maps to a class, or loads as one once registered (`misfiled_causal_lms`)
    (None: see `mapped_types`)."""
    known = mapped_types(CAUSAL_LM_TABLE)
    return None if known is None else known | frozenset(misfiled_causal_lms())


def may_be_a_causal_lm(model_type: str) -> bool:
    """Whether AutoModelForCausalLM builds a model of `model_type`, or the table cannot tell (transformers will)."""
    known = causal_lm_types()
    return known is None or model_type in known


def wraps_a_text_model(config: dict[str, Any]) -> bool:
    """Whether `config` (a config.json's dict) is a vision-language wrapper draftsmith runs as its language model and
    lm_head (draftsmith.wrapped_text.language_causal_lm), as vLLM serves such a wrapper on text prompts: transformers
    loads it as an image-text-to-text model only, and builds its language model alone, as a causal LM
    (`text_has_causal_lm`) or as a model (`AutoModel`). The load proves, once, that the result computes the wrapper's
    own logits, and refuses it in one line where not."""
    model_type, text_type = config.get("model_type"), text_model_type(config)
    known, wrappers, models = causal_lm_types(), mapped_types(WRAPPER_TABLE), mapped_types(MODEL_TABLE)
    if known is None or wrappers is None or models is None:
        return False
    return model_type not in known and model_type in wrappers and (text_type in known or text_type in models)


def text_has_causal_lm(config: dict[str, Any]) -> bool:
    """Whether the language model of a wrapper (`wraps_a_text_model`) has a causal LM class of its own (MiniMax-M3's,
    Inkling's), which then computes the logits rather than the bare lm_head (Inkling's scales the final state)."""
    known = causal_lm_types()
    return wraps_a_text_model(config) and known is not None and text_model_type(config) in known


def text_model_of_a_wrapper(config: dict[str, Any]) -> bool:
    """Whether `config` (a config.json's dict) is a text-only release, a causal LM by its architecture's name, that
    transformers reads as a vision-language wrapper's text config (its module the wrapper's) and maps to no model class
    of its own (Step-3.5's step3p5 is Step-3.7's text config): draftsmith runs it as the wrapper module's text model and
    the checkpoint's lm_head (draftsmith.text_model_lm)."""
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if not any(isinstance(name, str) and name.endswith("ForCausalLM") for name in architectures):
        return False
    known, wrappers, models = causal_lm_types(), mapped_types(WRAPPER_TABLE), mapped_types(MODEL_TABLE)
    modules = literal_table(MODULE_TABLE[1], MODULE_TABLE[0])
    if known is None or wrappers is None or models is None or modules is None or not isinstance(model_type, str):
        return False
    return model_type not in known | wrappers | models and modules.get(model_type) in wrappers


def text_model_type(config: dict[str, Any]) -> Optional[str]:
    text = config.get("text_config")
    return text.get("model_type") if isinstance(text, dict) else None


def not_a_causal_lm(config: dict[str, Any], name_or_path: str) -> Optional[str]:
    """Why draftsmith cannot load a target of `config` (a config.json's dict) as a causal LM, in one line; None where
    it can, or where it cannot tell: no model_type, or custom code naming its own AutoModelForCausalLM class
    (`auto_map`, loaded with target.trust_remote_code=true)."""
    model_type = config.get("model_type")
    auto_map = config.get("auto_map")
    if not isinstance(model_type, str) or may_be_a_causal_lm(model_type) or wraps_a_text_model(config):
        return None
    if text_model_of_a_wrapper(config):
        return None
    if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
        return None
    return f"cannot load target {name_or_path!r}: {no_causal_lm(model_type)}: give a causal LM"


def no_causal_lm(model_type: str) -> str:
    """What is missing for a target of `model_type`, as the lines refusing one say it."""
    version = importlib.metadata.version("transformers")
    return (
        f"transformers {version} has no causal LM class (AutoModelForCausalLM, what draftsmith loads a target as) "
        f"for model_type {model_type!r}"
    )


def misfiled_causal_lms() -> dict[str, str]:
    """The model types whose causal LM class the installed transformers files under image-text-to-text (and
    pretraining) only, not under AutoModelForCausalLM's table (Mistral-Small-4's mistral4 in 5.24): a text model's
    class all the same, by its name, which draftsmith loads as the causal LM it is (`register_misfiled_causal_lms`)."""
    known, wrappers = literal_table(CAUSAL_LM_TABLE), literal_table(WRAPPER_TABLE)
    if known is None or wrappers is None:
        return {}
    return {
        model_type: name
        for model_type, name in wrappers.items()
        if isinstance(name, str) and name.endswith("ForCausalLM") and model_type not in known
    }


@functools.cache
def register_misfiled_causal_lms() -> None:
    """Registers each `misfiled_causal_lms` class with AutoModelForCausalLM (transformers' own registry), once a
    process, so that the loads and builds of draftsmith, all through AutoModelForCausalLM, build it; called where they
    import it."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, name in misfiled_causal_lms().items():
        model_class = getattr(transformers, name, None)
        if model_class is not None and model_type in CONFIG_MAPPING:
            AutoModelForCausalLM.register(CONFIG_MAPPING[model_type], model_class, exist_ok=True)
