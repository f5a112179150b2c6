"""The attention of EAGLE-3's training-time test (TTT), at a fixed shape at every step.

Step 0 of the unroll is the draft layer's ordinary causal attention over the W positions of each row
(within a document when rows are packed, within the sliding window when the layer has one); SDPA runs
it. Step i > 0 runs at every one of the same W positions again: its query at position t sees step 0's
keys at positions <= t (the committed sequence) and each later step's key at t itself (its ancestors
and itself): the tree mask of a draft at depth i+1. Nothing here depends on which positions the loss
scores, so no shape depends on the data and the unroll never waits for the host.

Two ways to compute a step i > 0 (`Eagle3Config.ttt_attention`):

- `dense`: the scores against step 0's keys [B, heads, W, W] (masked) and the i diagonal scores side
  by side, one float32 softmax, then the two weighted sums. The reference, and the CPU path: on a CPU
  a fused kernel would do the same arithmetic.
- `flex`: `torch.nn.attention.flex_attention` over the keys of steps 0..i laid end to end
  ([B, kv heads, (i+1)W, d]) with a BlockMask that keeps the causal (document, window) blocks of step 0
  and one diagonal block per later step, so a step costs what its visible blocks cost, not (i+1)W^2.
  Compiled, it is a fused kernel; CUDA only (flex attention has no backward on the CPU).

`auto` picks `flex` on CUDA and `dense` elsewhere.

`StepKeys` is the KV cache stand-in the family's attention module writes to: step 0's keys and values
and, per position, those of steps 1..i."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from draftsmith.errors import UserError
from draftsmith.families import within_window

ATTENTION = "eagle3_ttt"
BACKENDS = ("auto", "dense", "flex")


@dataclass
class TTTStep:
    """What a step i > 0's attention needs beyond q, k, v: `visible` [B, 1, W, W] bool, step 0's keys a
    query at t may read (causal, within its document and its sliding window at position t + i), and
    the backend (`dense` or `flex`)."""

    visible: torch.Tensor
    backend: str


def resolved_backend(backend: str, device: torch.device) -> str:
    """`auto` -> `flex` on CUDA, `dense` elsewhere; `flex` with gradients off CUDA is an error (flex
    attention has no backward there)."""
    if backend == "auto":
        return "flex" if device.type == "cuda" else "dense"
    if backend == "flex" and device.type != "cuda" and torch.is_grad_enabled():
        raise UserError("drafter.ttt_attention=flex trains on CUDA only (no backward elsewhere): use auto or dense")
    return backend


def step_visibility(
    start: torch.Tensor, step: int, mask: Optional[torch.Tensor], window: Optional[int]
) -> torch.Tensor:
    """[B, 1, W, W] bool: the step-0 keys a step-`step` query at each position reads. `start` [B, W] the
    RoPE positions of step 0, `mask` step 0's own mask (None: plain causal). The sliding window moves
    with the query's position t + step (vLLM's window at draft depth step + 1)."""
    rows, width = start.shape
    if mask is None:
        mask = torch.ones(width, width, dtype=torch.bool, device=start.device).tril().expand(rows, 1, width, width)
    if window is None:
        return mask
    return mask & within_window(start[:, None, :, None] + step, start[:, None, None, :], window)


def ttt_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, ttt_step=None, **kwargs):
    """The draft layer's attention: SDPA (decoding, and step 0 of the training-time test), or with
    `ttt_step` (a `TTTStep`) the attention of a step i > 0. There `key` and `value` come from
    `StepKeys`: step 0's [B, kv heads, W, d] and steps 1..i's [B, kv heads, W, i, d]; `query` is
    [B, heads, W, d]; the output is [B, W, heads, d] as transformers' attention functions return it."""
    if ttt_step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    (keys, own_keys), (values, own_values) = key, value
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    dropout = dropout if module.training else 0.0
    if ttt_step.backend == "flex":
        if dropout:
            raise ValueError("flex attention in the training-time test takes no attention dropout")
        out = flex_step(query, keys, values, own_keys, own_values, ttt_step.visible, scaling)
    else:
        out = dense_step(query, keys, values, own_keys, own_values, ttt_step.visible, scaling, dropout)
    return out.transpose(1, 2), None


def dense_step(query, keys, values, own_keys, own_values, visible, scaling, dropout=0.0) -> torch.Tensor:
    """Step i > 0 with every score materialised: [B, heads, W, d]. Grouped-query attention reads kv head
    h // group for query head h without copying the keys."""
    batch, heads, width, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, width, dim)
    scores = grouped @ keys[:, :, None].transpose(-1, -2)  # [B, kv, group, W, W] against step 0's keys
    scores = scores.masked_fill(~visible[:, :, None], float("-inf"))
    diagonal = torch.einsum("bkgwd,bkwid->bkgwi", grouped, own_keys)  # [B, kv, group, W, i]: its own steps
    weights = (torch.cat([scores, diagonal], dim=-1) * scaling).softmax(-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout)
    first, own = weights.split([width, own_keys.shape[3]], dim=-1)
    out = first @ values[:, :, None] + torch.einsum("bkgwi,bkwid->bkgwd", own, own_values)
    return out.reshape(batch, heads, width, dim)


def flex_step(query, keys, values, own_keys, own_values, visible, scaling) -> torch.Tensor:
    """Step i > 0 through flex attention: step 0's keys, then each later step's keys at every position,
    end to end along the key axis; the BlockMask keeps step 0's visible blocks and one diagonal block
    per later step. [B, heads, W, d]."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, heads, width, _ = query.shape
    steps = own_keys.shape[3]
    laid = [
        torch.cat([first, own.permute(0, 1, 3, 2, 4).flatten(2, 3)], dim=2)
        for first, own in ((keys, own_keys), (values, own_values))
    ]

    def mask_mod(b, h, q_idx, kv_idx):
        first = kv_idx < width
        return torch.where(first, visible[b, 0, q_idx, kv_idx.clamp(max=width - 1)], kv_idx % width == q_idx)

    block_mask = create_block_mask(mask_mod, batch, None, width, (steps + 1) * width, device=query.device)
    return flex_attention_for(query.device.type)(
        query, laid[0], laid[1], block_mask=block_mask, scale=scaling, enable_gqa=heads != keys.shape[1]
    )


@lru_cache(maxsize=2)
def flex_attention_for(device_type: str):
    """flex_attention, compiled once per process on CUDA (uncompiled it materialises every score); as
    it is elsewhere, where only its forward runs (an equivalence check on the CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


class StepKeys:
    """The training-time test's stand-in for a KV cache: step 0's keys and values [B, kv heads, W, d],
    and steps 1..i's at every position [B, kv heads, W, i, d], which the family's attention module hands
    to `ttt_attention` unchanged."""

    def __init__(self):
        self.first: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.stacked: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.first is None:
            self.first = (keys, values)
            return keys, values
        new = [x[:, :, :, None] for x in (keys, values)]  # [B, kv, W, d] -> [B, kv, W, 1, d]
        if self.stacked is not None:
            new = [torch.cat([old, x], dim=3) for old, x in zip(self.stacked, new)]
        self.stacked = (new[0], new[1])
        return (self.first[0], new[0]), (self.first[1], new[1])


def register_ttt_attention() -> None:
    """Make `ttt_attention` selectable as the draft layer's attn_implementation (idempotent)."""
    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, ttt_attention)
