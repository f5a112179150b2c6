"""Whether transformers loads a target's config as a causal LM (`AutoModelForCausalLM`, the class draftsmith loads
every target with), told from the config alone: a model type it maps to no causal LM class (a vision-language
wrapper whose language model transformers has no causal LM class for) is refused in one line when the recipe is
checked, and at load time for a Hub id, instead of transformers' line listing its ~200 config classes after the data
is tokenized. A wrapper that transformers maps to its language model's causal LM class loads as that model."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from pathlib import Path
from typing import Any, Optional

# the module defining the model type -> causal LM class table, read as source: a recipe is checked without importing
# transformers (its modules take seconds), and the table is a literal there
MAPPING_MODULE = ("models", "auto", "modeling_auto.py")
MAPPING_NAME = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"


@functools.cache
def causal_lm_types() -> Optional[frozenset[str]]:
    """The model types the installed transformers' AutoModelForCausalLM maps to a class, or None where its table is
    not where, or not what, this reads (then nothing is refused here, and transformers' load says what it says)."""
    spec = importlib.util.find_spec("transformers")  # a top-level package's spec: transformers is not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(spec.submodule_search_locations[0], *MAPPING_MODULE)
    try:
        tree = ast.parse(source.read_text())
        table = next(
            node.value.args[0]
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(name, ast.Name) and name.id == MAPPING_NAME for name in node.targets)
            and isinstance(node.value, ast.Call)
            and node.value.args
        )
        return frozenset(model_type for model_type, _ in ast.literal_eval(table))
    except (OSError, SyntaxError, StopIteration, ValueError, TypeError):
        return None


def not_a_causal_lm(config: dict[str, Any], name_or_path: str) -> Optional[str]:
    """Why draftsmith cannot load a target of `config` (a config.json's dict) as a causal LM, in one line; None where
    it can, or where it cannot tell: no model_type, or custom code naming its own AutoModelForCausalLM class
    (`auto_map`, loaded with target.trust_remote_code=true)."""
    model_type = config.get("model_type")
    known = causal_lm_types()
    auto_map = config.get("auto_map")
    if not isinstance(model_type, str) or known is None or model_type in known:
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
