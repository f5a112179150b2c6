"""The recipe's drafter section of DFlash (heads/dflash.py), without torch (heads/config.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from draftsmith.errors import UserError
from draftsmith.families import layer_family
from draftsmith.heads import register_config
from draftsmith.heads.config import DrafterConfig, check_mask_token, check_tap_layers, refuse_unread

if TYPE_CHECKING:
    from draftsmith.target import TargetShape

LOSSES = ("ce", "soft_ce")
WEIGHTINGS = ("decay", "dpace")  # per block position: exp(-(k-1)/loss_decay), or D-PACE's from confidence


@dataclass
class DFlashBlockConfig(DrafterConfig):
    """The settings of DFlash's block drafting, which DSpark (heads/dspark_config.py) shares."""

    type: str = "dflash"  # the drafter kind (registry key)
    SETTINGS = ("anchors", "loss", "loss_decay", "loss_weighting", "dpace_alpha", "tree_topk")  # see DrafterConfig
    SERVED = ("tree_topk",)
    num_layers: int = 2  # draft decoder layers (the reference uses 5 for a 36-layer target)
    # Target layers whose states form the context, our ids (= DFlash's target_layer_ids; speculators'
    # aux_hidden_state_layer_ids = ours + 1). None: num_layers ids spread evenly over [1, L-3].
    target_layers: Optional[list[int]] = None
    block_size: int = 8  # block = anchor + block_size-1 masks: proposes up to block_size-1 tokens
    anchors: int = 64  # training: blocks per sequence at most (random loss-bearing anchors)
    loss: str = "ce"  # ce: to the data's tokens; soft_ce: to the target's distribution
    loss_decay: float = 7.0  # block position k's loss weight exp(-(k-1)/loss_decay) (loss_weighting=decay)
    # dpace: D-PACE's weights, from the draft's confidence (the default: +4.7% chain τ on SmolLM2, docs/recipes.md);
    # decay: the weights above
    loss_weighting: str = "dpace"
    dpace_alpha: float = 0.5  # D-PACE's smoothing of the confidence, in (0, 1]
    tree_topk: int = 8  # DDTree: candidates per block position; eval.tree = node budget
    # The mask queries' input: this token's row of the target's (frozen) embedding, as vLLM embeds
    # DFlash's mask queries (dflash_config.mask_token_id); null learns a vector (not exportable).
    mask_token_id: Optional[int] = None
    qk_norm: bool = True  # per-head RMSNorm on queries and keys (Qwen3's), as vLLM's DFlash layers apply
    # The family of the draft's own decoder layers (draftsmith.families); llama with qk_norm is the
    # function of vLLM's DFlash layers (Qwen3's), whatever the target's family; gemma4_text: Gemma-4's layers
    # (heads/dflash_gemma4.py), which vLLM builds for DSpark only (Gemma4DSparkModel); laguna: Laguna's layers
    # (heads/dflash_laguna.py), which vLLM builds for DFlash only (DFlashLagunaForCausalLM)
    layer_family: str = "llama"
    decoder: Optional[dict] = None  # the draft layers' classes and config, resolved by from_target
    # the engine models its export writes among those that alone build a family's layers (draftsmith.families
    # `LayerFamily.engine_model`): a family built by another is refused at the recipe
    ENGINE_MODELS: ClassVar[tuple[str, ...]] = ("DFlashLagunaForCausalLM",)  # formats/dflash_laguna.py

    def check_read(self) -> None:
        # a weighting's own setting given to the other one, which never reads it
        refuse_unread(self, ("loss_decay",), "loss_weighting", "decay")
        refuse_unread(self, ("dpace_alpha",), "loss_weighting", "dpace")

    def check(self, target: Optional[TargetShape] = None) -> None:
        family = layer_family(self.layer_family, self.type, self.ENGINE_MODELS)
        if family.per_kind and not self.qk_norm:
            raise UserError(f"drafter.qk_norm=false: {self.layer_family} layers always norm their queries and keys")
        if self.num_layers < 1:
            raise UserError(f"drafter.num_layers must be >= 1 (got {self.num_layers})")
        if self.block_size < 2:
            raise UserError(
                f"drafter.block_size must be >= 2 (the anchor and at least one mask; got {self.block_size})"
            )
        wrong = [f"drafter.{key} must be >= 1 (got {getattr(self, key)})" for key in ("anchors", "tree_topk")
                 if getattr(self, key) < 1]  # fmt: skip
        wrong += [f"drafter.loss_decay must be > 0 (got {self.loss_decay})"] if self.loss_decay <= 0 else []
        if wrong:
            raise UserError("; ".join(wrong))
        if self.loss not in LOSSES:
            raise UserError(f"drafter.loss={self.loss!r} is not one of {', '.join(LOSSES)}")
        if self.loss_weighting not in WEIGHTINGS:
            raise UserError(f"drafter.loss_weighting={self.loss_weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if self.loss_weighting == "dpace" and self.loss != "ce":
            raise UserError(
                "drafter.loss_weighting=dpace reads each position's confidence from its cross-entropy to the data's "
                "token: set drafter.loss=ce, or drafter.loss_weighting=decay for the soft cross-entropy"
            )
        if not 0 < self.dpace_alpha <= 1:
            raise UserError(f"drafter.dpace_alpha={self.dpace_alpha} must be in (0, 1]")
        check_mask_token(self.mask_token_id, target)
        if target is not None:
            default = (
                None if self.target_layers is not None else "DFlash's default target layers (spread over [1, L-3])"
            )
            layers, last = self.layers_for(target.num_hidden_layers), target.num_hidden_layers - 1
            check_tap_layers(layers, target.num_hidden_layers, "drafter.target_layers", default, "distinct layers")
            if last in layers:  # trains and evals here; no engine serves it
                logging.getLogger(__name__).warning(
                    "drafter.target_layers %s hold layer %d, the target's post-norm last state, which vLLM cannot "
                    "capture: the export for vLLM, the engine that serves this kind, will refuse this drafter; take "
                    "layers below %d to serve it",
                    layers,
                    last,
                    last,
                )

    def layers_for(self, num_layers: int) -> list[int]:
        """The context layers, the even spread for a target of `num_layers` layers when unset."""
        if self.target_layers is not None:
            return [int(layer) for layer in self.target_layers]
        return default_target_layers(num_layers, self.num_layers)


@register_config
@dataclass
class DFlashConfig(DFlashBlockConfig):
    type: str = "dflash"  # the drafter kind (registry key)
    # A released DFlash drafter to start from: its folder, or a Hub id (vLLM's DFlashDraftModel, or the encoder
    # layout of transformers' DFlash assistants: heads/dflash_released.py), whose layers' config (widths, heads, RoPE,
    # sliding windows) and weights it keeps; num_layers, target_layers, block_size and mask_token_id unset or the
    # folder's. It sets the layers' shape, so a resume or a warm start (train.init_from) names the same folder.
    released_drafter: Optional[str] = None

    def released_start(self) -> Optional[str]:  # not a STARTS key: it fixes the layers' shape (compared on resume)
        return f"drafter.released_drafter={self.released_drafter}" if self.released_drafter else None

    def check_read(self) -> None:
        super().check_read()
        if self.released_drafter:  # what a local folder fixes, before any data loads
            from draftsmith.heads.dflash_released import check_local_release

            check_local_release(self)

    def check(self, target: Optional[TargetShape] = None) -> None:
        super().check(target)
        from draftsmith.target import names_a_missing_folder

        if self.released_drafter and names_a_missing_folder(self.released_drafter):  # before any data loads
            raise UserError(
                f"drafter.released_drafter={self.released_drafter}: no such folder (a Hub id reads owner/name)"
            )


def default_target_layers(num_target_layers: int, count: int) -> list[int]:
    """`count` ids spread evenly over [1, L-3] (the middle layer when count is 1)."""
    if count == 1:
        return [num_target_layers // 2]
    low, high = 1, num_target_layers - 3
    return [round(low + index * (high - low) / (count - 1)) for index in range(count)]
