"""The recipe's drafter section of EAGLE-1 (heads/eagle.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from draftsmith.errors import UserError
from draftsmith.families import layer_family
from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, check_tree_settings

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


@register_config
@dataclass
class EagleConfig(DrafterConfig):
    type: str = "eagle"  # the drafter kind (registry key)
    SETTINGS = ("feature_loss_weight", "token_loss_weight", "noise_std", "tree_depth", "tree_topk")  # see DrafterConfig
    SERVED = ("tree_depth", "tree_topk")
    num_layers: int = 1  # decoder layers (every published EAGLE-1 checkpoint has 1)
    fc_bias: bool = False  # EAGLE's code defaults to True; its LLaMA-3 checkpoints and vLLM's loader have none
    feature_loss_weight: float = 1.0  # v_w: SmoothL1 between predicted and target feature
    token_loss_weight: float = 0.1  # p_w: soft cross-entropy against the target's next-token distribution
    noise_std: float = 0.2  # width of the uniform noise on input features in training (see `loss`)
    tree_depth: int = 5  # dynamic tree (EAGLE-2): draft steps ...
    tree_topk: int = 8  # ... children expanded per node and nodes expanded per step; eval.tree = node budget
    # The family of the draft's own decoder layers, whatever the target's (draftsmith.families):
    # llama is what vLLM and SGLang build for an EAGLE drafter of any target.
    layer_family: str = "llama"
    decoder: Optional[dict] = None  # the draft layers' classes and config, resolved by from_target

    def check(self, target: Optional[TargetShape] = None) -> None:
        check_tree_settings(self)
        layer_family(self.layer_family, self.type)
        if self.num_layers < 1:
            raise UserError(f"drafter.num_layers must be >= 1 (got {self.num_layers})")
        if (
            self.feature_loss_weight < 0
            or self.token_loss_weight < 0
            or self.feature_loss_weight + self.token_loss_weight <= 0
        ):
            raise UserError("drafter.feature_loss_weight and token_loss_weight must be >= 0, not both 0")
        if self.noise_std < 0:
            raise UserError(f"drafter.noise_std={self.noise_std} must be >= 0")
