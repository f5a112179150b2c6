"""The recipe's drafter section of Medusa-1 (heads/medusa.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from draftsmith.errors import UserError
from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, refuse_unread

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


@register_config
@dataclass
class MedusaConfig(DrafterConfig):
    type: str = "medusa"  # the drafter kind (registry key)
    POSITIONS_AHEAD = "num_heads"  # see DrafterConfig
    SETTINGS = ("loss_decay", "loss_weights", "init_lm_heads_from_target", "tree_topk")  # see DrafterConfig
    SERVED = ("tree_topk",)
    num_heads: int = 3  # heads, one per draft position: the longest chain
    num_layers: int = 1  # residual SiLU blocks per head
    loss_decay: float = 0.8  # head k's loss weight is loss_decay**(k-1) ...
    loss_weights: Optional[List[float]] = None  # ... unless given explicitly, one per head
    init_lm_heads_from_target: bool = True  # each head's output layer starts as a copy of the target's lm_head
    tree_topk: int = 10  # candidates per head considered when building a tree

    def check_read(self) -> None:
        refuse_unread(self, ("loss_decay",), "loss_weights", None)  # the weights given replace the decay's

    def check(self, target: Optional[TargetShape] = None) -> None:
        if self.num_heads < 1 or self.num_layers < 0:
            raise UserError(
                f"drafter.num_heads must be >= 1 and num_layers >= 0 (got {self.num_heads}, {self.num_layers})"
            )
        if self.loss_weights is not None and len(self.loss_weights) != self.num_heads:
            raise UserError(f"drafter.loss_weights has {len(self.loss_weights)} values for {self.num_heads} heads")
        if self.loss_weights is not None and (min(self.loss_weights) < 0 or max(self.loss_weights) <= 0):
            raise UserError(
                f"drafter.loss_weights={list(self.loss_weights)} must be >= 0, one of them > 0: a negative weight "
                "trains its head to guess worse, all zero trains nothing"
            )
        if self.loss_decay <= 0 or self.tree_topk < 1:
            raise UserError(
                f"drafter.loss_decay must be > 0 and tree_topk >= 1 (got {self.loss_decay}, {self.tree_topk})"
            )
