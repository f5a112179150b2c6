"""GLM-5-Next's MTP block attention: V3.2's sparse attention whose indexer scores pools of keys (`index_kpool`
consecutive positions, each pool's keys averaged by learnt weights), as transformers' Glm5NextTextAttention computes
it, on the explicit masks a drafter attends with (heads/mtp_plain.py's block calls it).

transformers' attention takes a padding mask only and reads causality from the cache's length: what one forward over
a sequence needs, not the training-time test's masks (a later draft step sees step 0's entries up to its position and
its own earlier steps', stored after them) nor a tree's. Here the mask says which keys a query sees; in every mask
draftsmith builds those are its document's positions 0..p in the cache's order, so a key's rank among the keys its
query sees is its position, and the pools are taken over ranks as vLLM takes them over positions:

    pool j of a query  = the keys it sees ranked j*kpool .. (j+1)*kpool - 1, complete pools only
    pooled key         = sum over the pool of softmax(gate(x_k) + ape[rank % kpool]) * k_k     (per channel)
    score of pool j    = sum_h w_h(x_q) * relu(q_h . pooled key_j / sqrt(d))
    attended keys      = the keys of its top index_topk // kpool pools, and the incomplete pool's (the tail)

The query attends to the attended keys it sees (full attention where a query sees no more keys than that). The pools
differ by query (a draft step's own entries fill its last ones), so they are built per query, a chunk of queries at a
time. GLM-5-Next's attention has no rotary embedding (NoPE): the drafter's table is heads/eagle_base.py's `NoPositions`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Elements of one chunk's per-query pool tensors [B, chunk, keys, index_head_dim]: bounds the memory the pools take
CHUNK_ELEMENTS = 1 << 26


def attention(attn: nn.Module, hidden: torch.Tensor, seen: torch.Tensor, cache=None) -> torch.Tensor:
    """Glm5NextTextAttention `attn` on `hidden` [B, Q, H], `seen` [B, 1, Q, K] (boolean: which of the cache's keys,
    these queries' own last, each query may see)."""
    batch, length = hidden.shape[:2]
    q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
    query = attn.q_b_proj(q_resid).view(batch, length, -1, attn.qk_head_dim).transpose(1, 2)
    latent, k_rot = torch.split(attn.kv_a_proj_with_mqa(hidden), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm(latent).view(batch, 1, length, attn.kv_lora_rank)
    k_rot = k_rot.view(batch, 1, length, attn.qk_rope_head_dim)
    if cache is not None:
        latent, k_rot = cache.update(latent, k_rot, attn.layer_idx)
    keys, values = attn.expand_kv(latent, k_rot)
    attended = seen & selection(attn.indexer, hidden, q_resid, seen[:, 0], cache)[:, None]
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=attended, scale=attn.scaling)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


@torch.no_grad()
def selection(
    indexer: nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, seen: torch.Tensor, cache
) -> torch.Tensor:
    """The keys the indexer picks for each query, [B, Q, K] boolean, from `seen` [B, Q, K]; its keys and gate scores
    kept on the cache's indexer state."""
    batch, length = hidden.shape[:2]
    dim = indexer.head_dim
    state = torch.cat([indexer.k_norm(indexer.wk(hidden)), F.linear(hidden, indexer.index_kpool_compress_gate)], -1)
    if cache is not None:
        state = cache.update_indexer(state, indexer.layer_idx)
    keys, gates = state.float().split(dim, dim=-1)
    queries = indexer.wq_b(q_resid).view(batch, length, -1, dim).float()
    weights = indexer.weights_proj(hidden).float() * indexer.n_heads**-0.5
    return by_query_chunks(
        lambda part: pooled_pick(indexer, keys, gates, queries[:, part], weights[:, part], seen[:, part]),
        length,
        batch * keys.shape[1] * dim,
    )


def pooled_pick(
    indexer: nn.Module,
    keys: torch.Tensor,
    gates: torch.Tensor,
    queries: torch.Tensor,
    weights: torch.Tensor,
    seen: torch.Tensor,
) -> torch.Tensor:
    """`selection` for a chunk of queries: keys, gates [B, K, D], queries [B, C, heads, D], weights [B, C, heads],
    seen [B, C, K]."""
    kpool, total = indexer.index_kpool, keys.shape[1]
    rank, complete, pool, member = rank_pools(seen, kpool)
    pools = total // kpool + 1  # the last one collects the keys in no complete pool
    slot = torch.where(member, pool, pools - 1)[..., None].expand(*member.shape, keys.shape[-1])
    # each pool's softmax over its keys, per channel: the pool's largest logit taken out first
    logits = gates[:, None] + indexer.index_kpool_compress_ape.float()[rank.clamp(min=0) % kpool]
    logits = logits.masked_fill(~member[..., None], torch.finfo(torch.float32).min)
    grouped = logits.new_full((*member.shape[:2], pools, keys.shape[-1]), torch.finfo(torch.float32).min)
    peak = grouped.scatter_reduce(2, slot, logits, "amax")
    share = (logits - peak.gather(2, slot)).exp() * member[..., None]
    total_share = torch.zeros_like(grouped).scatter_add(2, slot, share)
    pooled = torch.zeros_like(grouped).scatter_add(2, slot, share * keys[:, None]) / total_share.clamp_min(1e-30)
    scores = F.relu(torch.einsum("bchd,bcpd->bchp", queries, pooled) * indexer.softmax_scale)
    scores = torch.einsum("bch,bchp->bcp", weights, scores)
    chosen = best_pools(scores, complete, pool, member, indexer.index_topk // kpool)
    if indexer.index_kpool_always_select_tail:
        chosen |= seen & (rank >= complete * kpool)
    return chosen


def by_query_chunks(pick, length: int, elements_per_query: int) -> torch.Tensor:
    """`pick(part)` [B, C, K] over the queries in chunks (`part` a slice of them), concatenated: a chunk's per-query
    pool tensors hold about CHUNK_ELEMENTS elements."""
    chunk = max(1, CHUNK_ELEMENTS // elements_per_query)
    return torch.cat([pick(slice(start, start + chunk)) for start in range(0, length, chunk)], dim=1)


def rank_pools(seen: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pools of `size` keys by rank among the keys each query sees (`seen` [B, C, K]): each key's rank [B, C, K], the
    query's complete pools [B, C, 1], each key's pool [B, C, K], and whether that pool is complete [B, C, K]."""
    rank = seen.long().cumsum(-1) - 1
    complete = seen.sum(-1, keepdim=True) // size
    pool = rank.clamp(min=0) // size
    return rank, complete, pool, seen & (pool < complete)


def best_pools(scores: torch.Tensor, complete, pool, member, count: int) -> torch.Tensor:
    """The keys [B, C, K] of each query's `count` best complete pools by `scores` [B, C, P] (`rank_pools`' parts)."""
    pools = scores.shape[-1]
    candidate = torch.arange(pools, device=scores.device) < complete
    scores = scores.masked_fill(~candidate, torch.finfo(torch.float32).min)
    best = scores.topk(min(count, pools), dim=-1).indices
    picked = torch.zeros_like(candidate).scatter(-1, best, True) & candidate
    return member & picked.gather(-1, pool.clamp(max=pools - 1))
