"""An MTP block whose decoder layer convolves its inputs over the last few tokens beside its attention (Inkling's,
`Layout.convolved`), run on the drafter's masks and its own cache, as vLLM 0.32's InklingMTP computes it
(models/inkling/nvidia/mtp.py: the depth's `transformer_block`, an InklingDecoderLayer with a dense MLP).

transformers' layer reads its convolutions' past from the cache's slots in order and its relative position bias from
the slots' indices, which holds for one forward over a sequence, not for the training-time test's masks (a later draft
step sees step 0's entries up to its position and its own earlier steps', stored after them) nor a tree's. Here the
mask says which entries a query sees; in every mask draftsmith builds those are its document's positions 0..p in the
cache's order, the query's own last, so an entry's rank among them is its position (heads/mtp_blocks.py). Per query at
position p, with x_s an entry's input to a convolution (its own, and the seen entries' kept in the cache):

    conv(x)_p          = x_p + sum_{j < W} w[:, W-1-j] * x_{p-j}         W = conv_kernel_size; missing taps are 0
    k_p, v_p           = k_norm(conv_k(k_proj(a_p))), conv_v(v_proj(a_p))   a = input_layernorm(h)
    score(p, s)        = q_norm(q_proj(a_p)) . k_s / head_dim + bias_p[p - s]   bias_p = r_proj(a_p) @ rel_logits_proj
    h'                 = h + conv_attn(o_proj(attention))                       bias 0 from rel_extent on
    out                = h' + conv_mlp(mlp(post_attention_layernorm(h')))

a sliding depth (`hybrid_sliding`) sees the last `sliding_window_size` positions, its bias over as many. vLLM's MTP
block is given no log-scaling of its full attention (its depth layer passes none), so none is applied here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from draftsmith.heads import mtp_pooled

# The decoder layer's modules the block runs, by name (as the checkpoint names their tensors)
KEPT = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "attn_sconv", "mlp_sconv")
# The cache layer's attribute holding each convolution's inputs per entry, [B, entries, C], beside its keys and values
STREAMS = "convolution_inputs"


def new_cache():
    """The drafter's cache: transformers' plain keys and values (the convolved, normed keys attention reads), its
    layer keeping the convolutions' inputs per entry beside them (`ConvolvedBlock`)."""
    from transformers import DynamicCache

    return DynamicCache()


class ConvolvedBlock(nn.Module):
    """The family's decoder layer (attention, MLP, norms, short convolutions) on the drafter's masks."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name in KEPT:
            setattr(self, name, getattr(layer, name))

    def forward(
        self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor], cache=None, **kwargs
    ) -> torch.Tensor:
        """`attention_mask`: boolean, what may be seen, [B, 1, Q, cached + Q]; None: causal within the call."""
        rows, length = hidden_states.shape[:2]
        past: dict[str, torch.Tensor] = {}
        if cache is not None and cache.layers:
            # the inputs of the entries the cache keeps: a rejected draft's were cut off with its keys
            kept = cache.get_seq_length()
            past = {name: value[:, :kept] for name, value in getattr(cache.layers[0], STREAMS, {}).items()}
        if attention_mask is None:
            attention_mask = torch.ones(length, length, dtype=torch.bool, device=hidden_states.device).tril()
            attention_mask = attention_mask.expand(rows, 1, length, length)
        seen = attention_mask[:, 0].expand(rows, -1, -1)
        taps, present = conv_taps(seen, self.attn_sconv.conv_kernel_size)
        new: dict[str, torch.Tensor] = {}

        def convolve(name: str, conv: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
            new[name] = inputs
            every = torch.cat([past[name], inputs], dim=1) if name in past else inputs
            return convolution(conv, every, taps, present).to(inputs.dtype)

        attn = self.self_attn
        normed = self.input_layernorm(hidden_states)
        heads, kv_heads, dim = attn.num_heads, attn.num_key_value_heads, attn.head_dim
        queries = attn.q_norm(attn.q_proj(normed).view(rows, length, heads, dim)).transpose(1, 2)
        keys = convolve("k", attn.k_sconv, attn.k_proj(normed)).view(rows, length, kv_heads, dim)
        keys = attn.k_norm(keys).transpose(1, 2)
        values = convolve("v", attn.v_sconv, attn.v_proj(normed)).view(rows, length, kv_heads, dim).transpose(1, 2)
        if cache is not None:
            keys, values = cache.update(keys, values, 0)
        relative = attn.r_proj(normed).view(rows, length, heads, -1) @ attn.rel_logits_proj.proj  # [B, Q, heads, E]
        relative = relative.transpose(1, 2)

        def attended_by(part: slice) -> torch.Tensor:  # [B, C, heads, d]: the scores of a chunk of queries at a time
            chunk = attention(attn, queries[:, :, part], keys, values, relative[:, :, part], seen[:, part])
            return chunk.transpose(1, 2)

        attended = mtp_pooled.by_query_chunks(attended_by, length, heads * keys.shape[2]).transpose(1, 2)
        output = attn.o_proj(attended.transpose(1, 2).reshape(rows, length, heads * dim))
        hidden_states = hidden_states + convolve("attn", self.attn_sconv, output)
        mixed = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = hidden_states + convolve("mlp", self.mlp_sconv, mixed)
        if cache is not None:
            streams = {name: torch.cat([past[name], t], 1) if name in past else t for name, t in new.items()}
            setattr(cache.layers[0], STREAMS, streams)
        return hidden_states


def conv_taps(seen: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's last `width` seen entries, itself first: their indices [B, Q, width] among the mask's entries,
    and whether each exists [B, Q, width] (a document's first positions have fewer)."""
    counts = seen.int().cumsum(-1)  # how many entries a query sees up to each: the entry of rank r first counts r + 1
    wanted = counts[..., -1:] - torch.arange(width, device=seen.device, dtype=counts.dtype)  # [B, Q, width]: r + 1
    return torch.searchsorted(counts, wanted.clamp(min=1)), wanted > 0


def convolution(conv: nn.Module, inputs: torch.Tensor, taps: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """transformers' short convolution with its residual, in float32 as it computes it, over each query's taps of
    `inputs` [B, entries, C] (every entry's input to it): [B, Q, C]."""
    weight = conv.conv1d.weight.squeeze(1).float()  # [C, W], the last tap the query's own
    rows, queries, width = taps.shape
    gathered = inputs.float().gather(1, taps.reshape(rows, -1, 1).expand(-1, -1, inputs.shape[-1]))
    gathered = gathered.view(rows, queries, width, -1) * present[..., None]
    out = (gathered * weight.T.flip(0)).sum(2)
    return out + gathered[:, :, 0]


def attention(attn: nn.Module, queries, keys, values, relative, seen: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with the layer's relative position bias, on the mask `seen` [B, Q, K]: queries
    [B, heads, Q, d], keys and values [B, kv heads, K, d], relative [B, heads, Q, extent] -> [B, heads, Q, d]."""
    groups = attn.num_key_value_groups
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    rank = seen.long().cumsum(-1) - 1
    distance = (seen.sum(-1, keepdim=True) - 1 - rank)[:, None]  # [B, 1, Q, K]: positions back from the query's
    extent = relative.shape[-1]
    bias = relative.float().gather(-1, distance.clamp(0, extent - 1).expand(-1, relative.shape[1], -1, -1))
    bias = bias.masked_fill(distance >= extent, 0.0)
    visible = seen[:, None]
    if attn.sliding_window is not None:
        visible = visible & (distance < attn.sliding_window)
    scores = (queries.float() @ keys.float().transpose(-1, -2)) * attn.scaling + bias
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ values.float()).to(queries.dtype)
