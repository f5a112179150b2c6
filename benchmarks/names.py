"""The comma-separated name lists benchmarks take (--only, --kinds, --stages, --methods), checked as they are parsed:
a misspelt name is one line, exit 2, before any work, where it used to stop a run with a traceback after the earlier
names' minutes of work, or be skipped without a word.

    parser.add_argument("--stages", type=names_of(STAGES), default=",".join(STAGES))  # a list of names
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable


def names_of(known: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of at least one of `known`, as a list in the order given."""
    known = list(known)

    def names(text: str) -> list[str]:
        given = [name for name in text.split(",") if name]
        unknown = [name for name in given if name not in known]
        if unknown or not given:
            raise argparse.ArgumentTypeError(f"{', '.join(unknown) or 'none given'}: not among {', '.join(known)}")
        return given

    return names


def shipped_recipes() -> list[str]:
    """The recipes the package ships, by name (recipe=NAME)."""
    from draftsmith.resources import recipes_dir

    return sorted(path.stem for path in recipes_dir().glob("*.yaml"))
