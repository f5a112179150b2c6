"""Drafter architectures, one file each, found by the recipe's `drafter.type` through this registry.
A kind is its drafter, heads/<name>.py, and that drafter's Config (the recipe's drafter section), beside it in
heads/<name>_config.py; adding a kind's code touches its own files and the import line below, no other module.
The kind also adds its demo recipe, its tests, a README row and its section of the generated recipe reference
(docs/adding-a-kind.md).

The configs import no torch, and this package imports only them: composing a recipe, `--help` and a refused value
read a kind's schema (`config_class`) in the time the schema takes, not the seconds torch takes. The drafters'
modules are imported on first use of `drafter_class` or `drafters`; the drafters' side is imported from its
modules (heads/base.py, heads/proposer.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from draftsmith.errors import InternalError, UserError
from draftsmith.heads.config import DrafterConfig

if TYPE_CHECKING:
    from draftsmith.heads.base import Drafter

CONFIGS: dict[str, type[DrafterConfig]] = {}  # drafter.type -> its Config, from the import line below
_DRAFTERS: dict[str, type[Drafter]] = {}  # drafter.type -> its Drafter, once `drafters` imported their modules


def register_config(cls: type[DrafterConfig]) -> type[DrafterConfig]:
    if cls.type in CONFIGS:
        raise ValueError(f"drafter config type {cls.type!r} registered twice")
    CONFIGS[cls.type] = cls
    return cls


def register(cls: type[Drafter]) -> type[Drafter]:
    if cls.type in _DRAFTERS:
        raise ValueError(f"drafter type {cls.type!r} registered twice")
    _DRAFTERS[cls.type] = cls
    return cls


def unknown_kind(name: str, known) -> UserError:
    return UserError(f"unknown drafter.type {name!r}; known types: {', '.join(sorted(known))}")


def config_class(name: str) -> type[DrafterConfig]:
    """The recipe's drafter section's schema for `drafter.type=name` (no torch imported)."""
    if name not in CONFIGS:
        raise unknown_kind(name, CONFIGS)
    return CONFIGS[name]


def drafter_module(config: type[DrafterConfig]) -> str:
    """The module of a Config's drafter: heads/<name>.py beside heads/<name>_config.py."""
    return config.__module__.removesuffix("_config")


def drafters() -> dict[str, type[Drafter]]:
    """drafter.type -> its Drafter class, every kind's module imported (torch, seconds) on the first call. A kind
    whose Config is registered without its drafter (no heads/<name>.py beside heads/<name>_config.py, or none
    registered there) is a bug of the kind's, said in one line naming the file."""
    for config in CONFIGS.values():
        module = drafter_module(config)
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:  # an import inside the drafter's module: its own line
                raise
            raise InternalError(
                f"drafter.type {config.type!r} has its Config in {config.__module__} but no drafter module {module} "
                "beside it: a kind's drafter is heads/<name>.py, its Config heads/<name>_config.py"
            ) from None
        if config.type not in _DRAFTERS:
            raise InternalError(
                f"drafter.type {config.type!r} has its Config in {config.__module__}, and {module} registers no "
                f"Drafter of that type (@register on a class whose `type` is {config.type!r})"
            )
    return _DRAFTERS


def drafter_class(name: str) -> type[Drafter]:
    registry = drafters()
    if name not in registry:
        raise unknown_kind(name, registry)
    return registry[name]


# each module registers its kind's config
from draftsmith.heads import (  # noqa: E402,F401,I001
    dflash_config, draft_model_config, dspark_config, eagle_config, eagle3_config, gemma4_assistant_config,
    medusa_config, medusa2_config, mtp_config,
)  # fmt: skip

__all__ = [
    "CONFIGS",
    "DrafterConfig",
    "config_class",
    "drafter_class",
    "drafters",
    "register",
    "register_config",
]
