"""The recipe's drafter section of EAGLE-3 (heads/eagle3.py), without torch (heads/config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from draftsmith.errors import UserError
from draftsmith.families import layer_family
from draftsmith.heads import register_config
from draftsmith.heads.config import (
    DrafterConfig,
    check_mask_token,
    check_steps_ahead,
    check_tap_layers,
    check_tree_settings,
    refuse_unread,
)

if TYPE_CHECKING:
    from draftsmith.target import TargetShape

# How steps after the first of the training-time test attend (heads/ttt_attention.py).
BACKENDS = ("auto", "dense", "flex")


@register_config
@dataclass
class Eagle3Config(DrafterConfig):
    type: str = "eagle3"  # the drafter kind (registry key)
    POSITIONS_AHEAD = "ttt_steps"  # see DrafterConfig
    SETTINGS = ("ttt_steps", "ttt_decay", "tree_depth", "tree_topk", "ttt_attention")  # see DrafterConfig
    SERVED = ("tree_depth", "tree_topk")
    # Target layers to fuse, our ids (output of layer i; vLLM id = ours + 1). None: EAGLE-3's default,
    # [1, L//2 - 1, L - 4] (= vLLM's [2, L//2, L-3]), filled in by from_target.
    aux_layers: Optional[list[int]] = None
    draft_vocab_size: int = 32000  # lm_head rows; clipped to the target's vocabulary (= no pruning)
    ttt_steps: int = 7  # training-time test: draft steps unrolled in training
    ttt_decay: float = 0.8  # step i's (0-based) loss weight: ttt_decay**i
    # How steps i > 0 of the training-time test attend (heads/ttt_attention.py): dense (every score,
    # the reference), flex (block-sparse flex attention, CUDA), auto (flex on CUDA, dense elsewhere).
    ttt_attention: str = "auto"
    # False: the layer's residual is the fused feature itself, hidden_norm only feeds attention (EAGLE-3's
    # code, speculators' default). True: the residual is hidden_norm(fused). vLLM assumes True when the
    # key is missing, so an export must write it.
    norm_before_residual: bool = False
    # EAGLE-3.1 (vLLM reads both from its configs): an RMSNorm per aux layer on its captured state before
    # `fc` ...
    fc_norm: bool = False
    # One RMSNorm over the concatenated aux states before `fc` (`input_norm`, [n_aux * H]; speculators'
    # default, vLLM's `norm_before_fc`). It scales all taps by one RMS, where fc_norm scales each by its own;
    # one or the other.
    norm_before_fc: bool = False
    # ... and the post-norm output o' = norm(o) as the feature the next draft step reads (and the lm_head's
    # input), where EAGLE-3 passes the pre-norm o on.
    norm_output: bool = False
    # P-EAGLE: one draft forward proposes the whole chain (at most ttt_steps tokens: the depths trained), the
    # later queries reading mask_token_id's embedding and a learned `mask_hidden` (vLLM: speculative_config
    # parallel_drafting=true) ...
    parallel_drafting: bool = False
    mask_token_id: Optional[int] = None  # ... a token of the target's vocabulary (required with parallel_drafting)
    tree_depth: int = 5  # dynamic tree (EAGLE-2): draft steps ...
    tree_topk: int = 8  # ... children expanded per node and nodes expanded per step; eval.tree = node budget
    # The family of the draft layer, whatever the target's (draftsmith.families): llama is what vLLM
    # (any format) and SGLang build for any target; qwen3 is vLLM's Eagle3Qwen3ForCausalLM (speculators format).
    layer_family: str = "llama"
    # The draft layer's attention sees only the last `sliding_window` positions (its own included), as
    # speculators' trainer builds its draft layers by default (2048); None: every position. Exported as
    # the layer config's layer_types/sliding_window, which vLLM's Llama and Qwen3 draft layers honour.
    sliding_window: Optional[int] = None
    decoder: Optional[dict] = None  # the draft layers' classes and config, resolved by from_target

    def check_read(self) -> None:
        refuse_unread(self, ("mask_token_id",), "parallel_drafting", True)  # P-EAGLE's mask token

    def check(self, target: Optional[TargetShape] = None) -> None:
        check_tree_settings(self)
        layer_family(self.layer_family, self.type)
        check_steps_ahead(self)
        if self.ttt_attention not in BACKENDS:
            raise UserError(f"drafter.ttt_attention={self.ttt_attention!r} must be one of {', '.join(BACKENDS)}")
        if self.draft_vocab_size < 1:
            raise UserError(f"drafter.draft_vocab_size={self.draft_vocab_size} must be >= 1")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UserError(f"drafter.sliding_window={self.sliding_window} must be >= 1 (or null: full attention)")
        if self.fc_norm and self.norm_before_fc:  # speculators' loader refuses the pair (vLLM would chain them)
            raise UserError("drafter.fc_norm and drafter.norm_before_fc both normalise the taps before fc: choose one")
        check_mask_token(self.mask_token_id, target, "drafter.parallel_drafting=true" if self.parallel_drafting else "")
        if self.parallel_drafting and self.ttt_steps < 2:  # mask_hidden would take part in no loss: DDP raises on it
            raise UserError(
                "drafter.parallel_drafting=true trains the chain's later tokens, from mask_hidden, at training-time-"
                f"test steps 2 and on: set drafter.ttt_steps >= 2 (got {self.ttt_steps})"
            )
        if target is not None:
            default = None if self.aux_layers is not None else "EAGLE-3's default aux layers [1, L//2-1, L-4]"
            check_tap_layers(
                self.layers_for(target.num_hidden_layers),
                target.num_hidden_layers,
                "drafter.aux_layers",
                default,
                "low/mid/high layers",
            )

    def layers_for(self, num_layers: int) -> list[int]:
        """The aux layers, EAGLE-3's default for a target of `num_layers` layers when unset."""
        return (
            [int(layer) for layer in self.aux_layers] if self.aux_layers is not None else default_aux_layers(num_layers)
        )


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high layers in our ids: the inputs of layers 2, L//2, L-3 are the outputs of
    layers 1, L//2 - 1, L - 4."""
    return [1, num_layers // 2 - 1, num_layers - 4]
