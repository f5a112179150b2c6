"""The attention of EAGLE-3's training-time test (TTT), at a fixed shape at every step.

Step 0 of the unroll is the draft layer's ordinary causal attention over the W positions of each row
(within a document when rows are packed, within the sliding window when the layer has one); SDPA runs
it. Step i > 0 runs at every one of the same W positions again: its query at position t sees step 0's
keys at positions <= t (the committed sequence) and each later step's key at t itself (its ancestors
and itself): the tree mask of a draft at depth i+1. Nothing here depends on which positions the loss
scores, so no shape depends on the data and the unroll never waits for the host.

Two ways to compute a step i > 0 (`Eagle3Config.ttt_attention`):

- `dense`: the scores against step 0's keys [B, heads, W, W] (masked by an additive bias built once per
  micro-batch, `DenseMasks`) and the i diagonal scores side by side, one float32 softmax, then the two
  weighted sums. The reference, and the CPU path: on a CPU a fused kernel would do the same arithmetic.
- `flex`: `torch.nn.attention.flex_attention`, compiled, over one flat row: the micro-batch's rows laid
  end to end and padded to a power of two (at least 128, flex's block), the queries [1, heads, L, d] and
  the keys of every TTT step in regions of L ([1, kv heads, S·L, d], S = ttt_steps; regions past step i
  are zeros). A BlockMask keeps step 0's visible blocks (causal, within a segment: the row, or with
  packing or a window the document, padding a segment of its own per row; within the window) and one
  diagonal block per later step, so a step costs what its visible blocks cost. Every shape is the
  bucket's: one compiled graph per (length bucket, grad mode, dtype), whatever the rows, widths and
  step; `FLEX_RECOMPILE_LIMIT` bounds them, and reaching it is an error, never torch's silent unfused
  fallback. The BlockMasks of all steps are built once per unroll from block arithmetic on per-block
  minima and maxima (`FlexLayout`): [L/128, S·L/128] integers, never an [L, L] mask.

`auto` picks `flex` on CUDA and `dense` elsewhere.

`StepKeys` is the KV cache stand-in the family's attention module writes to: step 0's keys and values
and, per position, those of steps 1..i."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.families import within_window

ATTENTION = "eagle3_ttt"
BLOCK = 128  # flex attention's block: the flat layout's length is a multiple of it
# Compiled flex graphs a process may build: one per (length bucket, grad mode, dtype, head shape). Buckets are
# powers of two from 128 up to rows x width (8 up to 16,384 positions), so a training run with its held-out
# evaluation needs at most 16; tests and benchmarks that build several drafters in one process need more.
FLEX_RECOMPILE_LIMIT = 64


@dataclass
class TTTStep:
    """What a step i > 0's attention needs beyond q, k, v: the backend's view of it, built once per micro-batch
    (`DenseMasks` for `dense`, `FlexLayout` for `flex`), and the step."""

    backend: str
    masks: Optional[DenseMasks] = None
    layout: Optional[FlexLayout] = None
    step: int = 0


FLEX_MIN_HEAD_DIM = 16  # flex attention's CUDA kernels refuse a smaller head (torch 2.11-2.13: "NYI")


def resolved_backend(backend: str, device: torch.device, head_dim: int) -> str:
    """`auto` -> `flex` on CUDA (for heads of at least FLEX_MIN_HEAD_DIM), `dense` elsewhere; `flex` where
    `unrunnable_backend` says why not is an error."""
    if backend == "auto":
        return "flex" if device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM else "dense"
    if (unrunnable := unrunnable_backend(backend, device, head_dim, torch.is_grad_enabled())) is not None:
        raise UserError(unrunnable)
    return backend


def unrunnable_backend(backend: str, device: torch.device, head_dim: int, training: bool) -> Optional[str]:
    """Why `backend` cannot run here (None: it can): `flex` training off CUDA (no backward elsewhere), or on a head
    flex has no kernel for."""
    if backend == "flex" and device.type != "cuda" and training:
        return "drafter.ttt_attention=flex trains on CUDA only (no backward elsewhere): use auto or dense"
    if backend == "flex" and head_dim < FLEX_MIN_HEAD_DIM:
        return (
            f"drafter.ttt_attention=flex needs a head dimension of at least {FLEX_MIN_HEAD_DIM} (the draft layer's "
            f"is {head_dim}): use auto or dense"
        )
    return None


def step_visibility(
    start: torch.Tensor, step: int, mask: Optional[torch.Tensor], window: Optional[int]
) -> torch.Tensor:
    """[B, 1, W, W] bool: the step-0 keys a step-`step` query at each position reads ([1, 1, W, W], the same
    for every row, for plain causal attention without a window). `start` [B, W] the RoPE positions of step 0,
    `mask` step 0's own mask (None: plain causal). The sliding window moves with the query's position
    t + step (vLLM's window at draft depth step + 1)."""
    width = start.shape[1]
    if mask is None:
        mask = torch.ones(width, width, dtype=torch.bool, device=start.device).tril()[None, None]
    if window is None:
        return mask
    return mask & within_window(start[:, None, :, None] + step, start[:, None, None, :], window)


class DenseMasks:
    """The `dense` backend's masks of one micro-batch, for all its steps: which step-0 keys a query reads, as an
    additive bias [B or 1, 1, W, W] float32 (0 visible, -inf hidden) that the scores take in one addition, whose
    backward passes the gradient through (a masked fill would copy it again). Without a sliding window every
    step reads the same keys, so one bias serves all steps; with one the window moves with the step, so each
    step's is its own. `start`, `mask`, `window`: as `step_visibility` takes them."""

    def __init__(self, start: torch.Tensor, mask: Optional[torch.Tensor], window: Optional[int]):
        self.start, self.mask, self.window = start, mask, window
        self.shared = None if window is not None else additive(step_visibility(start, 0, mask, None))

    def bias(self, step: int) -> torch.Tensor:
        if self.shared is not None:
            return self.shared
        return additive(step_visibility(self.start, step, self.mask, self.window))


def additive(visible: torch.Tensor) -> torch.Tensor:
    """A boolean mask (True = may attend) as scores' additive bias: 0 where True, -inf where False."""
    return torch.where(visible, 0.0, float("-inf"))


def ttt_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, ttt_step=None, **kwargs):
    """The draft layer's attention: SDPA (decoding, and step 0 of the training-time test), or with
    `ttt_step` (a `TTTStep`) the attention of a step i > 0. There `key` and `value` come from
    `StepKeys`: step 0's [B, kv heads, W, d] and steps 1..i's [B, kv heads, W, i, d]; `query` is
    [B, heads, W, d]; the output is [B, W, heads, d] as transformers' attention functions return it."""
    if ttt_step is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    (keys, own_keys), (values, own_values) = key, value
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    dropout = dropout if module.training else 0.0
    if ttt_step.backend == "flex":
        if dropout:
            raise ValueError("flex attention in the training-time test takes no attention dropout")
        out = flex_step(query, keys, values, own_keys, own_values, ttt_step.layout, ttt_step.step, scaling)
    else:
        bias = ttt_step.masks.bias(ttt_step.step)
        out = dense_step(query, keys, values, own_keys, own_values, bias, scaling, dropout)
    return out.transpose(1, 2), None


def dense_step(query, keys, values, own_keys, own_values, bias, scaling, dropout=0.0) -> torch.Tensor:
    """Step i > 0 with every score materialised: [B, heads, W, d]; `bias` [B or 1, 1, W, W] (`DenseMasks`) on the
    scores against step 0's keys. Grouped-query attention reads kv head h // group for query head h without
    copying the keys. The scale goes on the query ([.., W, d]) rather than on the scores ([.., W, W + i]):
    a pass fewer each way, the same numbers where the scale is a power of two (head dimensions 16, 64, 256)."""
    batch, heads, width, dim = query.shape
    kv_heads = keys.shape[1]
    grouped = (query * scaling).view(batch, kv_heads, heads // kv_heads, width, dim)
    scores = grouped @ keys[:, :, None].transpose(-1, -2)  # [B, kv, group, W, W] against step 0's keys
    scores.add_(bias[:, :, None].to(scores.dtype))  # in place: the product's backward does not read it
    diagonal = torch.einsum("bkgwd,bkwid->bkgwi", grouped, own_keys)  # [B, kv, group, W, i]: its own steps
    weights = torch.cat([scores, diagonal], dim=-1).softmax(-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout)
    first, own = weights.split([width, own_keys.shape[3]], dim=-1)
    out = first @ values[:, :, None] + torch.einsum("bkgwi,bkwid->bkgwd", own, own_values)
    return out.reshape(batch, heads, width, dim)


def flat_length(positions: int) -> int:
    """The flat layout's length for `positions` positions: the next power of two, at least BLOCK."""
    return max(BLOCK, 1 << (positions - 1).bit_length())


class FlexLayout:
    """A micro-batch's rows laid end to end for flex attention, and the BlockMasks of steps 1..S-1.

    `segments` [B, W] long: the segment of every position (positions attend within theirs only; a
    segment is contiguous within its row); `start` [B, W] step 0's RoPE positions; `window` the sliding
    window or None. In the flat row, position p = r·W + t; past B·W every position is a segment of its
    own (it sees itself). A step-0 key k is visible to a step-i query q when they share a segment, k <= q
    and (with a window) start[k] > start[q] + i - window; step j's key at q itself (j = 1..i) always."""

    def __init__(self, segments: torch.Tensor, start: torch.Tensor, window: Optional[int], steps: int):
        rows, width = segments.shape
        device = segments.device
        self.rows, self.width, self.steps, self.window = rows, width, steps, window
        self.length = length = flat_length(rows * width)
        tail = torch.arange(length - rows * width, device=device)
        flat = segments.flatten()
        new = torch.ones_like(flat, dtype=torch.bool)
        new[1:] = flat[1:] != flat[:-1]
        new[::width] = True  # a row starts a segment
        # ids increasing along the flat row, so a block's segments are a range [first, last]
        self.segment = torch.cat([new.long().cumsum(0), rows * width + 1 + tail])
        self.position = torch.cat([start.flatten(), torch.zeros_like(tail)])
        self.masks = self.block_masks()

    def block_masks(self) -> list:
        """The BlockMask of each step 1..S-1 over [L queries, S·L keys], from per-block minima and maxima."""
        from torch.nn.attention.flex_attention import BlockMask

        blocks, regions = self.length // BLOCK, self.steps
        device = self.segment.device
        segment, position = self.segment.view(blocks, BLOCK), self.position.view(blocks, BLOCK)
        first_seg, last_seg = segment[:, 0], segment[:, -1]
        low, high = position.amin(1), position.amax(1)
        q, k = torch.arange(blocks, device=device)[:, None], torch.arange(blocks, device=device)[None, :]
        some = (k <= q) & (last_seg[None, :] >= first_seg[:, None])  # kb <= qb: k's ids <= q's
        every = (k < q) & (first_seg[None, :] == last_seg[:, None])  # one segment across both blocks
        diagonal = torch.eye(blocks, dtype=torch.bool, device=device)
        masks = []
        for step in range(1, regions):
            partial_first, full = some, every
            if self.window is not None:  # start[k] > start[q] + step - window, for some / every pair
                partial_first = some & (high[None, :] > low[:, None] + step - self.window)
                full = every & (low[None, :] > high[:, None] + step - self.window)
            later = [diagonal if j <= step else torch.zeros_like(diagonal) for j in range(1, regions)]
            partial = torch.cat([partial_first & ~full, *later], dim=1)
            full = torch.cat([full, *[torch.zeros_like(diagonal)] * (regions - 1)], dim=1)
            masks.append(
                BlockMask.from_kv_blocks(
                    *block_indices(partial),
                    *block_indices(full),
                    BLOCK_SIZE=BLOCK,
                    mask_mod=self.mask_mod(step),
                    seq_lengths=(self.length, regions * self.length),
                )
            )
        return masks

    def mask_mod(self, step: int):
        segment, position, length, window = self.segment, self.position, self.length, self.window
        query_position = position + step  # the window moves with the query's draft depth
        # the regions of steps 0..step (those past it hold zeros): a tensor, so that every step shares one graph
        keys = segment.new_full((), (step + 1) * length)

        def visible(b, h, q_idx, kv_idx):
            # whole on its own, as flex's unfused path reads it, not only within the BlockMask's blocks
            key = kv_idx % length
            first = (segment[key] == segment[q_idx]) & (key <= q_idx)
            if window is not None:
                first = first & (position[key] > query_position[q_idx] - window)
            return torch.where(kv_idx < length, first, (key == q_idx) & (kv_idx < keys))

        return visible

    def flat(self, x: torch.Tensor) -> torch.Tensor:
        """[B, heads, W, d] -> [1, heads, L, d]: the rows end to end, zeros past them."""
        batch, heads, width, dim = x.shape
        laid = x.transpose(0, 1).reshape(1, heads, batch * width, dim)
        return nn.functional.pad(laid, (0, 0, 0, self.length - batch * width))

    def unflat(self, x: torch.Tensor) -> torch.Tensor:
        """[1, heads, L, d] -> [B, heads, W, d]."""
        heads, dim = x.shape[1], x.shape[3]
        return x[0, :, : self.rows * self.width].view(heads, self.rows, self.width, dim).transpose(0, 1)

    def regions(self, first: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """Step 0's [B, kv, W, d] and steps 1..i's [B, kv, W, i, d] -> [1, kv, S·L, d], zeros past step i."""
        laid = [self.flat(first)] + [self.flat(own[:, :, :, j]) for j in range(own.shape[3])]
        missing = self.steps - len(laid)
        if missing:
            laid.append(first.new_zeros(1, first.shape[1], missing * self.length, first.shape[3]))
        return torch.cat(laid, dim=2)


def block_indices(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[Q blocks, KV blocks] bool -> (kv_num_blocks [1, 1, Q], kv_indices [1, 1, Q, KV]) int32, each
    query block's flagged key blocks first, in increasing order."""
    order = torch.sort(flags.to(torch.int8), dim=1, descending=True, stable=True).indices
    return flags.sum(1, dtype=torch.int32)[None, None], order.to(torch.int32)[None, None]


def flex_step(query, keys, values, own_keys, own_values, layout: FlexLayout, step: int, scaling) -> torch.Tensor:
    """Step `step` > 0 through compiled flex attention on the micro-batch's flat layout: [B, heads, W, d]."""
    out = compiled_flex(
        layout.flat(query),
        layout.regions(keys, own_keys),
        layout.regions(values, own_values),
        block_mask=layout.masks[step - 1],
        scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
    return layout.unflat(out)


def compiled_flex(*args, **kwargs) -> torch.Tensor:
    """flex_attention compiled (uncompiled it materialises every score), at most FLEX_RECOMPILE_LIMIT
    graphs: past them torch would fall back to that unfused path without a word; here it raises. Inside a
    compiled draft layer (train.compile_drafter) it is traced into the layer's graph instead."""
    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(*args, **kwargs)
    with torch._dynamo.config.patch(recompile_limit=FLEX_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        return _compiled_flex()(*args, **kwargs)


@lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


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
    from transformers import AttentionInterface

    if ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION, ttt_attention)
