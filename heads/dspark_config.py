"""The recipe's drafter section of DSpark (heads/dspark.py), without torch (heads/config.py): DFlash's block
settings (heads/dflash_config.py; not `released_drafter`, a DFlash drafter's start) and those of the Markov and
confidence heads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from draftsmith.errors import UserError
from draftsmith.heads import register_config
from draftsmith.heads.config import refuse_unread
from draftsmith.heads.dflash_config import DFlashBlockConfig

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


@register_config
@dataclass
class DSparkConfig(DFlashBlockConfig):
    type: str = "dspark"  # the drafter kind (registry key)
    # see DrafterConfig; adaptive_verification sets how vLLM serves (and the eval decodes), not the weights
    SETTINGS = (*DFlashBlockConfig.SETTINGS, "confidence_weight", "confidence_decay", "adaptive_verification")
    SERVED = ("adaptive_verification",)  # its chains have no tree (tree_topk is refused)
    ENGINE_MODELS = ("Gemma4DSparkModel",)  # formats/dspark_gemma4.py
    # block = anchor + block_size-1 masks, every position predicting the token after it: proposes up to block_size
    # tokens (vLLM's default num_speculative_tokens for the folder)
    block_size: int = 8
    tree_topk: int = 8  # DFlash's DDTree setting, refused when changed: a dspark drafter proposes chains only
    # The Markov head's rank r: the previous token's r-wide embedding (markov_w1, V x r) projected to a bias on
    # every draft token (markov_w2, r -> V); speculators' default is 256
    markov_rank: int = 256
    # The confidence head (a linear map of the block position's output and the previous token's Markov embedding
    # to the logit of its acceptance chance), which vLLM's adaptive verification reads; false: none
    confidence_head: bool = True
    confidence_weight: float = 1.0  # the confidence head's loss weight (speculators' confidence_head_alpha)
    # block position k's weight exp(-k/confidence_decay) in the confidence loss (speculators' gamma)
    confidence_decay: float = 4.0
    # vLLM's speculative config `enable_adaptive_verification` (its default false), which the export writes: vLLM
    # then verifies only as many drafts per step as the confidence head's survival scores pay for (docs/eval.md),
    # and the eval predicts that. Needs the confidence head (without one vLLM estimates acceptance otherwise)
    adaptive_verification: bool = False

    def check_read(self) -> None:
        super().check_read()
        refuse_unread(self, ("confidence_weight", "confidence_decay"), "confidence_head", True)  # the head's loss

    def check(self, target: Optional[TargetShape] = None) -> None:
        super().check(target)
        if self.markov_rank < 1:
            raise UserError(f"drafter.markov_rank must be >= 1 (got {self.markov_rank})")
        if self.confidence_weight < 0 or self.confidence_decay <= 0:
            raise UserError(
                f"drafter.confidence_weight must be >= 0 and confidence_decay > 0 (got {self.confidence_weight}, "
                f"{self.confidence_decay})"
            )
        if self.adaptive_verification and not self.confidence_head:
            raise UserError(
                "drafter.adaptive_verification needs confidence_head: true (without the head vLLM sizes the "
                "verification from an online estimate of the draft logits, which draftsmith's eval does not model)"
            )
        if self.tree_topk != DFlashBlockConfig.tree_topk:
            raise UserError(
                f"drafter.tree_topk={self.tree_topk}: a dspark drafter proposes chains only (its Markov head samples "
                "a block left to right), so it builds no tree; leave tree_topk unset"
            )
