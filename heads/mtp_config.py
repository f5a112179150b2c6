"""The recipe's drafter section of MTP (heads/mtp.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from draftsmith.errors import UserError
from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, check_steps_ahead, check_tree_settings

if TYPE_CHECKING:
    from draftsmith.target import TargetShape


@register_config
@dataclass
class MtpConfig(DrafterConfig):
    type: str = "mtp"  # the drafter kind (registry key)
    POSITIONS_AHEAD = "ttt_steps"  # see DrafterConfig
    SETTINGS = ("ttt_steps", "ttt_decay", "tree_depth", "tree_topk")  # see DrafterConfig
    SERVED = ("tree_depth", "tree_topk")
    ttt_steps: int = 3  # training-time test: draft steps unrolled, each fed the previous step's output
    ttt_decay: float = 0.8  # step i's loss weighs ttt_decay**i
    tree_depth: int = 5  # dynamic tree (EAGLE-2) in draftsmith's eval: draft steps ...
    tree_topk: int = 4  # ... children per expanded node and nodes expanded per step
    # MTP depths trained, depth i for draft step i as vLLM's model runner V2 serves them (exported with their count;
    # at most the release's; its CPU build runs depth 0 at every step); null: Inkling's release count, else 1, layer 0
    # at every step
    mtp_depths: Optional[int] = None
    # a later draft step reads the MTP layer's output after its final norm (true) or before it (false), as the vLLM
    # release served computes it (GLM-4.5's: before until 0.33, after from 0.34: formats/mtp.py); null: as 0.32 does
    feeds_back_normed: Optional[bool] = None
    # the embedding at position 0 zeroed (true) or read (false), as the engine served computes the layer: vLLM's
    # DeepSeek and GLM models zero it, SGLang's (NextN) read it (formats/mtp_sglang.py); null: as vLLM does
    masks_first_position: Optional[bool] = None
    decoder: Optional[dict] = None  # the MTP layer's classes, config and layout, resolved by from_target

    def resolved(self, fields: dict[str, Any]) -> dict[str, Any]:
        from draftsmith.heads.mtp_depths import depth_count  # torch: not imported where recipes are checked

        return fields | {"mtp_depths": depth_count(self)}  # null: the release's count or 1, as built

    def check(self, target: Optional[TargetShape] = None) -> None:
        check_tree_settings(self)
        check_steps_ahead(self)
        if self.mtp_depths is not None and self.mtp_depths < 1:
            raise UserError(
                f"drafter.mtp_depths={self.mtp_depths}: an MTP drafter has at least one depth (null: as released)"
            )
        if target is not None:
            from draftsmith.heads import mtp_depths  # reads the checkpoint: at validation, past the schema
            from draftsmith.heads.mtp import check_target_folder

            check_target_folder(target.name_or_path, self.feeds_back_normed, self.masks_first_position)
            mtp_depths.check_target_depths(target.name_or_path, self.mtp_depths)
