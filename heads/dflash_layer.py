"""DFlash's draft layer: a decoder layer of the target's family, rewired so that a block of queries attends
to the shared context and, non-causally, to its own block (`block_attention`). Apart from the drafter that
stacks these layers and trains them (heads/dflash.py, whose docstring describes the attention).
"""

from __future__ import annotations

import torch
from torch import nn

from draftsmith.errors import UserError


def add_qk_norm(layer: nn.Module, config) -> None:
    """Give a family decoder layer without them Qwen3's per-head q_norm/k_norm (RMSNorm over head_dim,
    of the family's RMSNorm class, weights 1: a fresh layer's norms)."""
    attention = layer.self_attn
    head_dim = getattr(attention, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for name in ("q_norm", "k_norm"):
        if getattr(attention, name, None) is None:
            setattr(attention, name, type(layer.input_layernorm)(head_dim, eps=getattr(config, "rms_norm_eps", 1e-6)))


def within(
    visible: torch.Tensor, positions: torch.Tensor, context_positions: torch.Tensor, window: int
) -> torch.Tensor:
    """A sliding-window layer's context visibility [B, A, S, C] per query: `visible` [B, A, C] and the context
    positions [B, C] (or [1, C]) less than `window` before each block position [B, A, S] (`layer_window`)."""
    near = positions[..., None] - context_positions[:, None, None, :] < window
    return visible[:, :, None, :] & near


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half form, as the Llama/Qwen/Mistral families) on [B, heads, n, d] with cos/sin [B, n, d]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat([-second, first], dim=-1) * sin[:, None]


def block_attention(query, context_key, context_value, block_key, block_value, visible, scaling: float) -> torch.Tensor:
    """Attention of A blocks of S queries each: [B, h, A, S, d] queries against the shared context
    ([B, kv, C, d] keys/values, `visible` [B, A, C] says which context positions block a may see, or
    [B, A, S, C] which each query may: a sliding window's) and its own block's S keys/values
    ([B, kv, A, S, d], all visible: non-causal). Scores are computed in
    two parts, [A, S, C] and [A, S, S] per head, so memory is A·S·(C+S) per head rather than the
    (A·S)·(C + A·S) of one mask over every block. Grouped-query attention reads kv head h // group
    without copying keys. Returns [B, h, A, S, d]."""
    batch, heads, blocks, size, dim = query.shape
    kv_heads = context_key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, blocks * size, dim)
    context_scores = (grouped @ context_key[:, :, None].transpose(-1, -2)).view(
        batch, kv_heads, -1, blocks, size, context_key.shape[2]
    )
    per_query = visible[:, None, None] if visible.dim() == 4 else visible[:, None, None, :, None, :]
    context_scores = context_scores.masked_fill(~per_query, float("-inf"))
    grouped = grouped.view(batch, kv_heads, -1, blocks, size, dim)
    block_scores = grouped @ block_key[:, :, None].transpose(-1, -2)  # [B, kv, g, A, S, S]
    weights = (
        (torch.cat([context_scores, block_scores], dim=-1) * scaling).softmax(-1, dtype=torch.float32).to(query.dtype)
    )
    context_weights, block_weights = weights.split([context_key.shape[2], size], dim=-1)
    out = (context_weights.flatten(3, 4) @ context_value[:, :, None]).view(batch, kv_heads, -1, blocks, size, dim)
    out = out + block_weights @ block_value[:, :, None]
    return out.reshape(batch, heads, blocks, size, dim)


class DFlashLayer(nn.Module):
    """One decoder layer of the target's family, with DFlash's attention (see heads/dflash.py's docstring):
    its q/k/v/o projections (and q_norm/k_norm where the family has them), norms and MLP are the
    family's modules under the family's names; only the attention's wiring is DFlash's."""

    def __init__(self, layer: nn.Module, config):
        super().__init__()
        attention = getattr(layer, "self_attn", None)
        needed = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
        parts = [getattr(layer, name, None) for name in ("input_layernorm", "post_attention_layernorm", "mlp")]
        if not all(isinstance(p, nn.Linear) for p in needed) or any(p is None for p in parts):
            raise UserError(
                "DFlash needs a decoder layer with input_layernorm, self_attn.q/k/v/o_proj, post_attention_layernorm "
                f"and mlp; {type(layer).__name__} differs"
            )
        self.self_attn = attention
        self.mlp = layer.mlp
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attention, "head_dim", None) or config.hidden_size // self.heads
        self.scaling = float(getattr(attention, "scaling", self.head_dim**-0.5))

    def _heads(self, projection: str, norm: str, x: torch.Tensor, count: int) -> torch.Tensor:
        """[B, n, H] -> [B, count, n, d] through self_attn.<projection> (and .<norm> if the family has one)."""
        out = getattr(self.self_attn, projection)(x).view(*x.shape[:-1], count, self.head_dim)
        norm_module = getattr(self.self_attn, norm, None)
        return (norm_module(out) if norm_module is not None else out).transpose(1, 2)

    def keys_values(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (rotated) and values [B, kv, n, d] of inputs [B, n, H] at the positions `rope` encodes."""
        return rotate(self._heads("k_proj", "k_norm", x, self.kv_heads), *rope), self._heads(
            "v_proj", "v_norm", x, self.kv_heads
        )

    def context_keys_values(
        self, context: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared context's keys and values [B, kv, C, d] (`keys_values` of the context [B, C, H] as is: no
        input_layernorm on it, as vLLM's Qwen3 DFlash layers project it)."""
        return self.keys_values(context, rope)

    def forward(self, hidden, rope, context_kv, visible) -> torch.Tensor:
        """hidden [B, A, S, H] (A blocks of S) at the positions `rope` encodes ([B, A*S, d] cos/sin);
        context_kv: this layer's context keys/values [B, kv, C, d]; visible [B, A, C]."""
        hidden = hidden + self.self_attn.o_proj(self.attend(hidden, rope, context_kv, visible))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def attend(self, hidden, rope, context_kv, visible) -> torch.Tensor:
        """The attention's output heads [B, A, S, heads·d], before o_proj (`forward`'s arguments)."""
        batch, blocks, size, width = hidden.shape
        x = self.input_layernorm(hidden).view(batch, blocks * size, width)
        query = rotate(self._heads("q_proj", "q_norm", x, self.heads), *rope)
        block_key, block_value = self.keys_values(x, rope)

        def per_block(t):
            return t.view(batch, t.shape[1], blocks, size, self.head_dim)

        attended = block_attention(
            per_block(query), *context_kv, per_block(block_key), per_block(block_value), visible, self.scaling
        )
        return attended.permute(0, 2, 3, 1, 4).reshape(batch, blocks, size, self.heads * self.head_dim)
