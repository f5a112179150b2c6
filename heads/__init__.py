"""Drafter architectures, one file each, found by the recipe's `drafter.type` through this registry."""
from __future__ import annotations

from draftsmith.errors import UserError
from heads.base import DraftState, DraftTree, Drafter, DynamicTree, TargetShape, Tree, load_drafter

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


from heads import draft_model, eagle, eagle3, medusa, medusa2  # noqa: E402,F401  (each registers itself)

__all__ = ["DraftState", "DraftTree", "Drafter", "DynamicTree", "TargetShape", "Tree", "drafter_class", "load_drafter", "register", "REGISTRY"]
