"""Files that ship with draftsmith (recipes, the demo target and data), found the same way from a
checkout and from an installed wheel: through importlib.resources, never relative to `__file__`."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def bundled(relative: str) -> Path:
    """`demo/target` -> the demo target's directory; `recipes` -> the recipes directory."""
    package, _, rest = relative.strip("/").partition("/")
    root = files(f"draftsmith.{package}")
    return Path(str(root.joinpath(rest) if rest else root))


def recipes_dir() -> Path:
    return bundled("recipes")
