"""MiniMax-M3's MTP block attention: grouped-query attention whose lightning indexer picks blocks of keys, as
transformers' MiniMaxM3VLAttention and vLLM 0.32's MiniMaxM3SparseAttention compute it (models/minimax_m3/common/
ops/index_topk.py: score_type "max", no init blocks), on the explicit masks a drafter attends with (heads/mtp_plain.py's
block calls it).

transformers' indexer counts the blocks from the cache's first slot and reads causality from the positions, which holds
for one forward over a sequence, not for the training-time test's masks (a later draft step sees step 0's entries up
to its position and its own earlier steps', stored after them) nor a tree's. Here the mask says which keys a query
sees; in every mask draftsmith builds those are its document's positions 0..p in the cache's order, so a key's rank
among the keys its query sees is its position (heads/mtp_pooled.py), and the blocks are taken over ranks as vLLM takes
them over positions. Per indexer head h (one per key-value head) and query at position p:

    score of key k     = q_h(x_p) . k(x_k)                 both Gemma-normed and rotated as the attention's
    score of block j   = max over the seen keys ranked j*size .. (j+1)*size - 1
    blocks             = 0 .. p // size (the query's own, incomplete, among them)
    attended blocks    = the last `index_local_blocks` blocks, then the best others, `index_topk_blocks` in all

and each query head attends to the keys it sees in its group's attended blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.families import family_rotation
from draftsmith.heads import mtp_pooled


def attention(attn: nn.Module, hidden: torch.Tensor, seen: torch.Tensor, rope, cache=None) -> torch.Tensor:
    """MiniMaxM3VLAttention `attn` on `hidden` [B, Q, H], `seen` [B, 1, Q, K] (boolean: which of the cache's keys,
    these queries' own last, each query may see), `rope` its (cos, sin)."""
    batch, length = hidden.shape[:2]
    shape = (batch, length, -1, attn.head_dim)
    query = attn.q_norm(attn.q_proj(hidden).view(shape)).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
    value = attn.v_proj(hidden).view(shape).transpose(1, 2)
    query, key = family_rotation(attn)(query, key, *rope)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx)
    picked = selection(attn.indexer, hidden, rope, seen[:, 0], cache)  # [B, index heads, Q, K]
    # each indexer head's selection is its group's: the query heads and key-value heads it ties (the family's index
    # heads are its key-value heads), attended a group at a time so that no mask is expanded to every query head
    groups = picked.shape[1]
    out = torch.cat(
        [
            F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=seen & chosen[:, None], scale=attn.scaling, enable_gqa=True
            )
            for queries, keys, values, chosen in zip(
                query.chunk(groups, 1), key.chunk(groups, 1), value.chunk(groups, 1), picked.unbind(1)
            )
        ],
        dim=1,
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


@torch.no_grad()
def selection(indexer: nn.Module, hidden: torch.Tensor, rope, seen: torch.Tensor, cache) -> torch.Tensor:
    """The keys each indexer head picks for each query, [B, heads, Q, K] boolean, from `seen` [B, Q, K]; its keys
    kept on the cache's block-sparse layer (`update_index`)."""
    batch, length = hidden.shape[:2]
    dim = indexer.head_dim
    queries = indexer.q_norm(indexer.q_proj(hidden).view(batch, length, -1, dim)).transpose(1, 2)
    keys = indexer.k_norm(indexer.k_proj(hidden).view(batch, length, 1, dim)).transpose(1, 2)
    cos, sin = rope
    queries, keys = family_rotation(indexer)(queries, keys, cos[..., :dim], sin[..., :dim])
    if cache is not None:
        keys = cache.layers[indexer.layer_idx].update_index(keys)
    queries, keys = queries.float(), keys.float()
    return mtp_pooled.by_query_chunks(
        lambda part: block_pick(indexer, queries[:, :, part] @ keys.transpose(-1, -2), seen[:, part]).transpose(1, 2),
        length,
        batch * queries.shape[1] * keys.shape[2],
    ).transpose(1, 2)


def block_pick(indexer: nn.Module, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """`selection` for a chunk of queries: scores [B, heads, C, K] (each query's with each key), seen [B, C, K]."""
    size, total = indexer.block_size, scores.shape[-1]
    blocks = total // size + 1  # the most any query has; one more slot collects the keys a query does not see
    rank = seen.long().cumsum(-1) - 1
    block = torch.where(seen, rank // size, blocks)[:, None].expand_as(scores)
    lowest = torch.finfo(torch.float32).min
    grouped = scores.new_full((*scores.shape[:-1], blocks + 1), lowest).scatter_reduce(-1, block, scores, "amax")
    grouped = grouped[..., :blocks]
    own = (seen.sum(-1, keepdim=True) - 1)[:, None] // size  # [B, 1, C, 1]: the query's block (its position's)
    number = torch.arange(blocks, device=scores.device)
    candidate = number <= own
    grouped = grouped.masked_fill(candidate & (number > own - indexer.local_blocks), float("inf"))
    best = grouped.masked_fill(~candidate, float("-inf")).topk(min(indexer.topk_blocks, blocks), dim=-1).indices
    chosen = torch.zeros_like(grouped, dtype=torch.bool).scatter(-1, best, True) & candidate
    return seen[:, None] & chosen.gather(-1, block.clamp(max=blocks - 1))
