"""Drafter architectures, one file each, found by the recipe's `drafter.type` through this registry.
Adding a kind's code touches its own files and the import line below, no other module; the kind also adds its
demo recipe, its tests, a README row and its section of the generated recipe reference (docs/adding-a-kind.md)."""

from __future__ import annotations

from draftsmith.errors import UserError
from draftsmith.heads.base import Drafter, DrafterConfig, load_drafter
from draftsmith.heads.proposer import DraftState, DraftTree, DynamicTree, Proposer, Tree
from draftsmith.target import TargetShape

REGISTRY: dict[str, type[Drafter]] = {}


def register(cls: type[Drafter]) -> type[Drafter]:
    if cls.type in REGISTRY:
        raise ValueError(f"drafter type {cls.type!r} registered twice")
    REGISTRY[cls.type] = cls
    return cls


def drafter_class(name: str) -> type[Drafter]:
    if name not in REGISTRY:
        raise UserError(f"unknown drafter.type {name!r}; known types: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


# each module registers its kinds
from draftsmith.heads import dflash, draft_model, eagle, eagle3, gemma4_assistant, medusa, medusa2, mtp  # noqa: E402,F401,I001

__all__ = [
    "REGISTRY",
    "DraftState",
    "DraftTree",
    "Drafter",
    "DrafterConfig",
    "DynamicTree",
    "Proposer",
    "TargetShape",
    "Tree",
    "drafter_class",
    "load_drafter",
    "register",
]
