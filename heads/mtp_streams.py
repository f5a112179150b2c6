"""An MTP layer whose block passes hyper-connection streams (DeepSeek-V4's `mtp.{j}`), around its block as vLLM 0.32's
DeepSeekV4MTP computes it (models/deepseek_v4/nvidia/mtp.py, and the eager reference of its fused input norm in
common/ops/fused_mtp_input_rmsnorm.py): the parts heads/mtp.py's drafter takes from here for a `Layout.streams` layout.

Draft position p reads the target's last decoder layer's S residual streams s_p [S, H], as that layer leaves them
(before the target's own hc_head collapses them into the lm_head's input), and the embedding of x_{p+1}:

    h      = hidden_proj(hidden_norm(s_p)) + embed_proj(embed_norm(e(x_{p+1})))    the embedding added to each stream
    pre    = block(h)                                                              [S, H]: a decoder layer on streams
    logits = lm_head(final_norm(collapse(pre)))                                    the layer's own hc_head

hidden_norm normalises each stream on its own; e is zeroed at position 0. A later draft step reads `pre` itself (the
streams, as vLLM feeds `hidden_states.flatten(1)` back), so the drafter's state between steps is [.., S, H].
"""

from __future__ import annotations

import torch
from torch import nn

# The drafter's modules around the block, by role (heads/mtp.py's WRAPPER for a one-state layer): one projection of
# the embedding and one of the streams, summed, where the others project their concatenation.
ROLES = ("embed_norm", "hidden_norm", "embed_proj", "hidden_proj", "final_norm")
# The layer's own collapse of its streams (transformers' hyper-head parameters) -> the release's tensors, stored
# beside the wrapper's modules.
COLLAPSE_NAMES = {
    "collapse.hc_fn": "hc_head_fn",
    "collapse.hc_base": "hc_head_base",
    "collapse.hc_scale": "hc_head_scale",
}
# The rotary table the block reads: transformers' V4 names its tables by attention kind, and the MTP block's is the
# sliding-window attention's ("main"; the compressed layers' is "compress").
ROTARY_KIND = "main"


def build(drafter: nn.Module, hidden: int, collapse: type) -> None:
    """The modules a streams layout adds to the drafter's norms: the two projections and the collapse."""
    drafter.embed_proj = nn.Linear(hidden, hidden, bias=False)
    drafter.hidden_proj = nn.Linear(hidden, hidden, bias=False)
    drafter.collapse = collapse(drafter.layer_config)


def combine(drafter: nn.Module, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block's input [.., S, H] from the embedding [.., H] and the streams [.., S, H]."""
    return (
        drafter.hidden_proj(drafter.hidden_norm(streams))
        + drafter.embed_proj(drafter.embed_norm(embedded))[..., None, :]
    )


def block_arguments(drafter: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> dict:
    """What the streams block takes besides its input: its rotary table by kind, and `mask` (boolean, what may be
    seen) made additive (its attention adds the mask to its scores, with its sinks: transformers runs it eagerly)."""
    dtype = drafter.embed_proj.weight.dtype
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    rope = drafter.rotary_emb(hidden, positions, layer_type=ROTARY_KIND)
    return {"attention_mask": additive, "position_embeddings": {ROTARY_KIND: rope}}


def head_input(drafter: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """The lm_head's input [.., H] from a step's output streams [.., S, H]: the layer's own collapse (transformers'
    takes [B, T, S, H]), then its final norm."""
    collapsed = drafter.collapse(streams.reshape(-1, 1, *streams.shape[-2:]))
    return drafter.final_norm(collapsed.reshape(*streams.shape[:-2], -1))
