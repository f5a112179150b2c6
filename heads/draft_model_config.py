"""The recipe's drafter section of the draft model (heads/draft_model.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, List, Optional

from draftsmith.errors import UserError
from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, check_mask_token, refuse_unread
from draftsmith.heads.lora import LoraSection

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


@register_config
@dataclass
class DraftModelConfig(DrafterConfig):
    type: str = "draft_model"  # the drafter kind (registry key)
    SETTINGS = ("init", "loss", "mix_weights", "ce_weight", "temperature", "parallel_tokens")  # see DrafterConfig
    RESOLVED = ("model_config",)
    STARTS = ("name_or_path",)
    name_or_path: Optional[str] = None  # an HF causal LM with the target's vocab; None = build from the target
    init: str = "layers"  # with name_or_path unset: the target's first `num_layers` layers
    num_layers: int = 1  # decoder layers of a draft built from the target
    loss: str = "fkl"  # fkl | rkl | tvd | mix (see heads/distill.py)
    mix_weights: List[float] = field(default_factory=lambda: [1.0, 0.0, 1.0])  # loss=mix: weights of fkl, rkl, tvd
    ce_weight: float = 0.0  # extra cross-entropy on the data's own next tokens
    temperature: float = 1.0  # distillation temperature, applied to both distributions
    lora: Optional[LoraSection] = None  # train LoRA adapters only (merged into the saved weights)
    model_config: Optional[dict] = None  # filled by from_target: the draft's HF config, to rebuild it on load
    # PARD: one draft forward proposes `parallel_tokens` tokens, the later ones read at mask_token_id
    # positions (vLLM: speculative_config parallel_drafting=true, the draft's config.json pard_token) ...
    parallel_drafting: bool = False
    mask_token_id: Optional[int] = None  # ... a token of the target's vocabulary (required with parallel_drafting)
    parallel_tokens: int = 4  # ... tokens per forward that training teaches: the longest chain it proposes

    def __post_init__(self):
        self.lora = LoraSection.coerce(self.lora)

    def check_read(self) -> None:
        # PARD's mask token and depth, for a draft model that drafts one token a forward
        refuse_unread(self, ("mask_token_id", "parallel_tokens"), "parallel_drafting", True)
        refuse_unread(self, ("mix_weights",), "loss", "mix")

    def check(self, target: Optional[TargetShape] = None) -> None:
        from draftsmith.heads.distill import LOSSES  # the losses' module imports torch: read at validation only

        if self.loss not in LOSSES:
            raise UserError(f"drafter.loss={self.loss!r} is not one of {', '.join(LOSSES)}")
        weights = list(self.mix_weights)
        if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0 or self.temperature <= 0 or self.ce_weight < 0:
            raise UserError(
                "need 3 drafter.mix_weights >= 0 (fkl, rkl, tvd; not all 0), drafter.temperature > 0 and ce_weight >= "
                f"0 (got {weights}, {self.temperature}, {self.ce_weight})"
            )
        if self.name_or_path is None and self.model_config is None:
            if self.init != "layers":
                raise UserError(
                    f"drafter.init={self.init!r} is not supported (use 'layers', or set drafter.name_or_path)"
                )
            if self.num_layers < 1 or (target is not None and self.num_layers > target.num_hidden_layers):
                limit = (
                    f"the target's {target.num_hidden_layers} layers"
                    if target is not None
                    else "the target's layer count"
                )
                raise UserError(f"drafter.num_layers={self.num_layers} must be between 1 and {limit}")
        if self.lora is not None:
            self.lora.check()
        check_mask_token(self.mask_token_id, target, "drafter.parallel_drafting=true" if self.parallel_drafting else "")
        if self.parallel_tokens < 2:
            raise UserError(f"drafter.parallel_tokens={self.parallel_tokens} must be >= 2")
