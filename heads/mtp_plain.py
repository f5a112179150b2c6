"""An MTP block that is its family's decoder layer without the layer's hyper-connections (`Layout.plain_block`), its
attention run on the drafter's masks where the family's own reads causality from the cache's slots (GLM-5-Next's pooled
sparse attention, heads/mtp_pooled.py; MiniMax-M3's block-sparse attention, whose layer has no hyper-connections to
drop: heads/mtp_blocks.py).

HY-V4's and GLM-5-Next's decoder layers pass `hc_mult` residual streams, mixed by hyper-connections around the
attention and the MLP; their MTP layers do not: the releases ship no hyper-connection tensors for them and vLLM 0.32
builds the block on one residual stream (models/hy_v4/nvidia/mtp.py sets `enable_ihc = False`; glm5next/common/
model.py runs an `is_mtp_layer` layer down its non-mHC path):

    h   = x + attention(input_layernorm(x))
    out = h + mlp(post_attention_layernorm(h))

transformers builds these layers with their hyper-connections always, so the block keeps the layer's attention,
MLP and norms, and drops the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.heads import mtp_blocks, mtp_pooled

# The decoder layer's modules the block keeps, by name (as the checkpoint names their tensors)
KEPT = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")


def strip(layer: nn.Module) -> nn.Module:
    """The layer without its modules outside KEPT (its hyper-connections), in place."""
    for name in [name for name in layer._modules if name not in KEPT]:
        delattr(layer, name)
    return layer


def kept(name: str) -> bool:
    """Whether a parameter of the layer (named under it) belongs to the block."""
    return name.split(".", 1)[0] in KEPT


class PlainBlock(nn.Module):
    """The family's decoder layer's attention, MLP and norms on one residual stream; returns what the layer's
    attention returns beside its output (the sparse attention's top-k selection) as the layer does."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        # attention sinks (HY-V4's): transformers' eager attention adds them (the drafter runs such blocks eagerly:
        # heads/mtp.py); it adds the mask to the scores, so takes it additive
        self.sinks = getattr(layer.self_attn, "sinks", None) is not None
        # an indexer over pools of keys (GLM-5-Next's) runs on the drafter's masks by heads/mtp_pooled.py
        self.pooled = hasattr(getattr(layer.self_attn, "indexer", None), "index_kpool")
        # an indexer picking blocks of keys (MiniMax-M3's) runs on the drafter's masks by heads/mtp_blocks.py
        self.blocked = hasattr(getattr(layer.self_attn, "indexer", None), "topk_blocks")

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, **kwargs
    ) -> tuple[torch.Tensor, object]:
        """`attention_mask`: boolean, what may be seen, [B, 1, Q, K]."""
        if self.sinks:
            dtype = hidden_states.dtype
            attention_mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill(
                ~attention_mask, torch.finfo(dtype).min
            )
        normed = self.input_layernorm(hidden_states)
        if self.pooled:
            attended, selected = mtp_pooled.attention(self.self_attn, normed, attention_mask, kwargs.get("cache")), None
        elif self.blocked:
            rope, cache = kwargs["position_embeddings"], kwargs.get("cache")
            attended, selected = mtp_blocks.attention(self.self_attn, normed, attention_mask, rope, cache), None
        else:
            # (output, weights) or, with a sparse selection, (output, weights, selection) (HY-V4's)
            attended, _, *chosen = self.self_attn(hidden_states=normed, attention_mask=attention_mask, **kwargs)
            selected = chosen[0] if chosen else None
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), selected
