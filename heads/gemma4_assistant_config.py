"""The recipe's drafter section of Gemma-4's assistant (heads/gemma4_assistant.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from draftsmith.errors import UserError
from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, check_steps_ahead

if TYPE_CHECKING:
    from draftsmith.target import TargetShape

# The target text models whose KV cache an assistant reads (transformers' model_type), each with its assistant's
# model type: transformers builds each its own assistant class (the unified one's layers are its target's), and vLLM
# 0.32's speculative config maps both to one gemma4_mtp model.
ASSISTANTS = {"gemma4_text": "gemma4_assistant", "gemma4_unified_text": "gemma4_unified_assistant"}
TARGET_MODEL_TYPES = tuple(ASSISTANTS)


@register_config
@dataclass
class AssistantConfig(DrafterConfig):
    type: str = "gemma4_assistant"  # the drafter kind (registry key)
    POSITIONS_AHEAD = "ttt_steps"  # see DrafterConfig
    SETTINGS = ("ttt_steps", "ttt_decay")  # see DrafterConfig
    STARTS = ("released_assistant",)
    # A released assistant to start from (its folder, or a Hub id with a network): its configuration and weights;
    # null: a fresh assistant at the target's shape, shaped by the three keys below (null where it is released).
    released_assistant: Optional[str] = None
    num_layers: Optional[int] = None  # decoder layers (null: 2): sliding-window attention, the last full attention
    hidden_width: Optional[int] = None  # the assistant's hidden size; null: the target's
    mlp_width: Optional[int] = None  # its MLP's intermediate size; null: the target's
    ttt_steps: int = 3  # training-time test: draft steps unrolled, each fed the previous step's output
    ttt_decay: float = 0.8  # step i's loss weighs ttt_decay**i
    decoder: Optional[dict] = None  # the assistant's transformers config and the target's store layers

    def check(self, target: Optional[TargetShape] = None) -> None:
        for key in ("num_layers", "hidden_width", "mlp_width"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise UserError(f"drafter.{key} must be >= 1 or null (got {getattr(self, key)})")
        check_steps_ahead(self)
        from draftsmith.target import local_target_config, names_a_missing_folder

        if self.released_assistant and names_a_missing_folder(self.released_assistant):  # before any data loads
            raise UserError(
                f"drafter.released_assistant={self.released_assistant}: no such folder (a Hub id reads owner/name)"
            )
        if target is not None and target.model_type not in TARGET_MODEL_TYPES:
            raise UserError(
                f"drafter.type={self.type}: the assistant reads a Gemma-4 target's KV cache; this target is "
                f"{target.model_type}: train another kind (eagle3, mtp where the target ships an MTP layer)"
            )
        # a recipe's (decoder unset) local folder, read before any data loads; a saved drafter's config, checked on
        # every load, is read as it was trained: its start is not read again
        fresh = target is not None and self.released_assistant and self.decoder is None
        released = local_target_config(self.released_assistant) if fresh else None
        if released is not None:
            key = f"drafter.released_assistant={self.released_assistant!r}"
            refusal = released_refusal(key, released, target.model_type, target.hidden_size)
            if refusal or (refusal := sizes_refusal(self, released.get("text_config") or {})):
                raise UserError(refusal)


def released_refusal(key: str, released: dict, target_type: str, target_width: int) -> Optional[str]:
    """Why a released assistant whose config holds `released` (`key` names it) is not one for a target of
    `target_type` and width `target_width`, or None: read from a local folder's config.json as the recipe is
    checked, and from transformers' reading of any (a Hub id's too) as the drafter is built."""
    wanted = ASSISTANTS[target_type]
    if released.get("model_type") != wanted:
        return f"{key} is a {released.get('model_type')} model, not the assistant of a {target_type} target ({wanted})"
    if released.get("backbone_hidden_size") != target_width:
        return (
            f"{key} drafts for a target of width {released.get('backbone_hidden_size')}; this target's is "
            f"{target_width}"
        )
    return None


def released_sizes(text_config: dict) -> dict[str, Optional[int]]:
    """The size keys of a released assistant whose text config is `text_config` (None where it says none)."""
    return {"num_layers": text_config.get("num_hidden_layers"), "hidden_width": text_config.get("hidden_size"),
            "mlp_width": text_config.get("intermediate_size")}  # fmt: skip


def sizes_refusal(config: AssistantConfig, text_config: dict) -> Optional[str]:
    """The size keys `config` gives that differ from the released assistant's (`text_config`), in one line, or None."""
    differ = [
        f"drafter.{key}={getattr(config, key)} ({config.released_assistant} has {value})"
        for key, value in released_sizes(text_config).items()
        if value is not None and getattr(config, key) not in (None, value)
    ]
    return f"{'; '.join(differ)}: leave those null, the released assistant's are its own" if differ else None
