"""DFlash's draft layer built from a Laguna decoder layer (`drafter.layer_family=laguna`): what vLLM 0.32's
`DFlashLagunaForCausalLM` (vllm/model_executor/models/laguna_dflash.py, on laguna.py's `LagunaDecoderLayer`)
computes, with DFlash's attention wiring (heads/dflash_layer.py):

    x = input_layernorm(h)
    q = rope(q_norm(q_proj(x)));  k = rope(k_norm(k_proj(x)));  v = v_proj(x)
    a = attention(q, [context k ; k], [context v ; v]) * softplus(g_proj(x))     one gate per head (`gating: true`)
    h = h + o_proj(a);  h = h + mlp(post_attention_layernorm(h))                  a dense SiLU MLP

Two things differ from vLLM's Qwen3 DFlash model around the layers: the context feature norms each tapped target
state before the fc (`aux_hidden_norms`, one RMSNorm per tapped layer: `combine_hidden_states`), and each layer
projects the context through its own input_layernorm (`_project_context_kv`) where the Qwen3 one projects it as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.dflash_layer import DFlashLayer


def is_gated(layer: nn.Module) -> bool:
    """Whether a family decoder layer gates its attention's output (Laguna's `g_proj`): this module's layer."""
    return getattr(layer.self_attn, "g_proj", None) is not None


def tap_norms(layer: nn.Module, count: int, width: int) -> nn.ModuleList:
    """`count` fresh RMSNorms of the family's class over a tapped target state of `width` (weights 1), as vLLM's
    `aux_hidden_norms` norm each slice of the captured states before the fc."""
    norm = layer.input_layernorm
    return nn.ModuleList(type(norm)(width, eps=norm.variance_epsilon) for _ in range(count))


class GatedDFlashLayer(DFlashLayer):
    """A Laguna decoder layer with DFlash's attention (module docstring): its modules under their own names."""

    def context_keys_values(
        self, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys_values(self.input_layernorm(context), rope)

    def attend(self, hidden, rope, context_kv, visible) -> torch.Tensor:
        attended = super().attend(hidden, rope, context_kv, visible)
        gate = self.self_attn.g_proj(self.input_layernorm(hidden))
        gate = F.softplus(gate.float()).to(attended.dtype)
        if self.self_attn.gate_per_head:  # one gate per head, across its dimensions
            heads = attended.view(*attended.shape[:-1], self.heads, self.head_dim) * gate[..., None]
            return heads.flatten(-2)
        return attended * gate
