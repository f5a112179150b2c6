"""The recipe's drafter section of Medusa-2 (heads/medusa2.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from draftsmith.errors import UserError
from draftsmith.heads import register_config
from draftsmith.heads.lora import LoraSection
from draftsmith.heads.medusa_config import MedusaConfig

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


def _all_projections() -> LoraSection:
    # Medusa-2's published recipes adapt every linear layer of the decoder (r=32, alpha=16).
    return LoraSection(
        r=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@register_config
@dataclass
class Medusa2Config(MedusaConfig):
    type: str = "medusa2"  # the drafter kind (registry key)
    SETTINGS = (*MedusaConfig.SETTINGS, "backbone_loss_weight", "heads_weight", "heads_warmup", "heads_lr_scale")
    lora: LoraSection = field(default_factory=_all_projections)
    backbone_loss_weight: float = 1.0  # KL(original target || adapted target) on the supervised tokens
    heads_weight: float = 0.01  # the heads' loss weight once ramped up (Medusa-2 recipes' heads_coefficient)
    heads_warmup: int = 100  # optimizer steps over which that weight ramps up (sine)
    heads_lr_scale: float = 4.0  # heads learn at train.lr x this, the adapters at train.lr (Medusa-2 recipes: x4)

    def __post_init__(self):
        self.lora = LoraSection.coerce(self.lora)

    def check(self, target: Optional[TargetShape] = None) -> None:
        super().check(target)
        if self.backbone_loss_weight < 0 or self.heads_weight <= 0 or self.heads_warmup < 0 or self.heads_lr_scale <= 0:
            raise UserError(
                "drafter.backbone_loss_weight must be >= 0, heads_weight and heads_lr_scale > 0, heads_warmup >= 0"
            )
        self.lora.check()
