"""The recipe's drafter section of MTP (heads/mtp.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, check_steps_ahead, check_tree_settings

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


@register_config
@dataclass
class MtpConfig(DrafterConfig):
    type: str = "mtp"  # the drafter kind (registry key)
    SETTINGS = ("ttt_steps", "ttt_decay", "tree_depth", "tree_topk")  # see DrafterConfig
    SERVED = ("tree_depth", "tree_topk")
    ttt_steps: int = 3  # training-time test: draft steps unrolled, each fed the previous step's output
    ttt_decay: float = 0.8  # step i's loss weighs ttt_decay**i
    tree_depth: int = 5  # dynamic tree (EAGLE-2) in draftsmith's eval: draft steps ...
    tree_topk: int = 4  # ... children per expanded node and nodes expanded per step
    decoder: Optional[dict] = None  # the MTP layer's classes, config and layout, resolved by from_target

    def check(self, target: Optional[TargetShape] = None) -> None:
        check_tree_settings(self)
        check_steps_ahead(self)
        if target is not None:
            from draftsmith.heads.mtp import check_target_folder  # reads the checkpoint: at validation, past the schema

            check_target_folder(target.name_or_path)
