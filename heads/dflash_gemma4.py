"""DFlash's draft layer built from a Gemma-4 decoder layer (`drafter.layer_family=gemma4_text`): what vLLM 0.32's
`Gemma4DSparkDecoderLayer` (vllm/model_executor/models/gemma4_dspark.py, on gemma4_mtp.py's
`Gemma4MTPDecoderLayer`) computes, with DFlash's attention wiring (heads/dflash_layer.py):

    x = input_layernorm(h)
    q = rope(q_norm(q_proj(x)));  k = rope(k_norm(k_proj(x)));  v = v_norm(v_proj(x), or k_proj(x) with k_eq_v)
    h = h + post_attention_layernorm(o_proj(attention(q, [context k ; k], [context v ; v])))   scaling 1
    h = (h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))) * layer_scalar

v_norm has no weight; the context's keys and values are its k_proj (k_norm, RoPE) and v_norm of the same
projection, as vLLM's fused context projection computes them. vLLM embeds the block's tokens with the (shared)
target table times sqrt(hidden) (`Gemma4DSparkModel.embed_input_ids`): heads/dflash.py's `embed_scale`.
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.families import FULL
from draftsmith.heads.dflash_layer import DFlashLayer, rotate

PARTS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


class FullAttentionRope(nn.Module):
    """A per-layer-kind rotary table (Gemma-4's takes the kind) read as a full-attention layer's: every draft
    layer is one."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary(hidden, positions, FULL)


class Gemma4DFlashLayer(DFlashLayer):
    """A Gemma-4 decoder layer with DFlash's attention (module docstring): its modules under their own names."""

    def __init__(self, layer: nn.Module, config):
        nn.Module.__init__(self)
        attention = layer.self_attn
        self.self_attn = attention
        self.mlp = layer.mlp
        for name in PARTS:
            setattr(self, name, getattr(layer, name))
        self.register_buffer("layer_scalar", layer.layer_scalar)
        self.head_dim = attention.head_dim
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.scaling = float(attention.scaling)

    def keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.self_attn.k_proj(x).view(*x.shape[:-1], self.kv_heads, self.head_dim)
        v_proj = self.self_attn.v_proj
        values = keys if v_proj is None else v_proj(x).view_as(keys)
        return (
            rotate(self.self_attn.k_norm(keys).transpose(1, 2), *rope),
            self.self_attn.v_norm(values).transpose(1, 2),
        )

    def forward(self, hidden, rope, context_kv, visible) -> torch.Tensor:
        attended = self.self_attn.o_proj(self.attend(hidden, rope, context_kv, visible))
        hidden = hidden + self.post_attention_layernorm(attended)
        hidden = hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))
        return hidden * self.layer_scalar
