"""An MTP layer on residual streams laid side by side and mixed by gated residuals (Qwen4-Exp's `hc_count` streams,
`Layout.gated`), as vLLM 0.32's Qwen4ExpMTP computes it (models/qwen4_exp/nvidia/mtp.py, its decoder layer and
gated residuals in model.py and hyperconnection.py): the parts heads/mtp.py's drafter takes from here.

Draft position p reads the S streams the target's last layer leaves s_p [S, H] (vLLM's `_mtp_hidden_buffer`, before
the target's final mixer) and the embedding of x_{p+1}:

    h      = fc_hidden(pre_fc_norm_hidden(s_p)) + fc_embedding(pre_fc_norm_embedding(e(x_{p+1})))   e added to each
    pre    = block(h)                                                     [S, H]: the decoder layer on its streams
    logits = lm_head(hyper_connection_mixer(pre))                         the layer's own final mixer, no norm after

pre_fc_norm_hidden normalises the S*H streams as one vector (Gemma-style, x * (1 + w)); fc_hidden projects each stream
alike; vLLM adds the embedding to every stream with unit weight (its pending combine without an injection), and
neither masks position 0. The block is the family's decoder layer without its per-layer n-gram embedding (vLLM builds
layer num_hidden_layers, which PLE skips), its attention Qwen's sparse attention (`qwen_sparse_attention`: the QSA
indexer picks blocks of keys). A later draft step reads `pre` itself (vLLM's `multi_hidden`).

transformers' QSA indexer pools the keys its query sees by rank, blocks of `indexer_compress_ratio`, each rotated at
its first key's position; in every mask draftsmith builds a key's rank among those its query sees is its position
(heads/mtp_pooled.py), so here the pools are taken over ranks, for all queries at once, on the drafter's masks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.families import family_rotation
from draftsmith.heads import mtp_pooled

# The drafter's modules around the block, by role; the layout names them as the release does.
ROLES = ("embed_norm", "hidden_norm", "embed_proj", "hidden_proj")
# The layer's own final mixer (transformers' gated residual without its injection) -> the release's tensors
COLLAPSE_NAMES = {
    f"collapse.{name}.weight": f"hyper_connection_mixer.{name}.weight"
    for name in ("hc_norm", "input_mix_weight_down", "input_mix_weight_up")
}


def build(drafter: nn.Module, hidden: int, eps: float, norm: type, collapse: type) -> None:
    """The modules around the block: the two norms (the streams' over S*H), the two projections and the mixer."""
    streams = drafter.layer_config.hc_count
    drafter.embed_norm, drafter.hidden_norm = norm(hidden, eps=eps), norm(streams * hidden, eps=eps)
    drafter.embed_proj = nn.Linear(hidden, hidden, bias=False)
    drafter.hidden_proj = nn.Linear(hidden, hidden, bias=False)
    drafter.collapse = collapse(drafter.layer_config, use_combine=False)


def combine(drafter: nn.Module, embedded: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The block's input [.., S, H] from the embedding [.., H] and the streams [.., S, H]."""
    normed = drafter.hidden_norm(streams.flatten(-2)).unflatten(-1, streams.shape[-2:])
    return drafter.hidden_proj(normed) + drafter.embed_proj(drafter.embed_norm(embedded))[..., None, :]


def block_arguments(drafter: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> dict:
    """The block's mask (boolean, what may be seen) and its queries' rotary table; its indexer rotates its pools."""
    return {"attention_mask": mask, "position_embeddings": drafter.rotary_emb(hidden, positions)}


def head_input(drafter: nn.Module, streams: torch.Tensor) -> torch.Tensor:
    """The lm_head's input [.., H] from a step's output streams [.., S, H]: the layer's own mixer."""
    return drafter.collapse(streams.flatten(-2))


class GatedBlock(nn.Module):
    """The family's decoder layer (its attention, MLP and two gated residuals) on streams [.., S, H], its attention run
    on the drafter's explicit masks."""

    def __init__(self, layer: nn.Module, rotary: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.attn_hyper_connection, self.mlp_hyper_connection = layer.attn_hyper_connection, layer.mlp_hyper_connection
        self.rotary = [rotary]  # the drafter's table, for the indexer's pools (not a submodule: not the block's)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, position_embeddings, **kwargs):
        flat = hidden_states.flatten(-2)
        mixed, hyper, weights = self.attn_hyper_connection(flat)
        attended = attention(
            self.self_attn, mixed, attention_mask, position_embeddings, self.rotary[0], kwargs.get("cache")
        )
        flat = hyper + (attended[..., None, :] * weights[..., None]).flatten(-2)
        mixed, hyper, weights = self.mlp_hyper_connection(flat)
        flat = hyper + (self.mlp(mixed)[..., None, :] * weights[..., None]).flatten(-2)
        return flat.unflatten(-1, hidden_states.shape[-2:])


def attention(attn: nn.Module, hidden: torch.Tensor, seen: torch.Tensor, rope, rotary: nn.Module, cache=None):
    """Qwen4ExpTextAttention `attn` on `hidden` [B, Q, H] (its gated output), `seen` [B, 1, Q, K] (boolean: which of
    the cache's keys, these queries' own last, each query may see), `rope` its queries' (cos, sin)."""
    batch, length = hidden.shape[:2]
    shape = (batch, length, -1, attn.head_dim)
    query, gate = torch.chunk(attn.q_proj(hidden).view(*shape[:2], -1, 2 * attn.head_dim), 2, dim=-1)
    query = attn.q_norm(query).transpose(1, 2)
    key = attn.k_norm(attn.k_proj(hidden).view(shape)).transpose(1, 2)
    value = attn.v_proj(hidden).view(shape).transpose(1, 2)
    query, key = family_rotation(attn)(query, key, *rope)
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx)
    attended = seen & selection(attn, hidden, rope, seen[:, 0], rotary, cache)[:, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attended, scale=attn.scaling, enable_gqa=True)
    return attn.o_proj(out.transpose(1, 2).reshape(batch, length, -1) * torch.sigmoid(gate.reshape(batch, length, -1)))


@torch.no_grad()
def selection(attn: nn.Module, hidden: torch.Tensor, rope, seen: torch.Tensor, rotary: nn.Module, cache):
    """The keys the QSA indexer picks for each query, [B, Q, K] boolean, from `seen` [B, Q, K]; its raw keys kept on
    the cache's indexer state."""
    indexer = attn.indexer
    batch, length = hidden.shape[:2]
    dim = indexer.index_head_dim
    queries, keys = indexer.index_qk_proj(hidden).split([indexer.index_n_heads * dim, dim], dim=-1)
    queries = family_rotation(attn)(indexer.q_layernorm(queries.view(batch, length, -1, dim)), cos=rope[0], sin=rope[1],
                           unsqueeze_dim=2)  # fmt: skip
    if cache is not None:
        keys = cache.update_indexer(keys, indexer.layer_idx)
    ratio = indexer.compress_ratio
    starts = torch.arange(keys.shape[1] // ratio + 1, device=keys.device)[None] * ratio  # each pool's first rank
    pool_rope = rotary(keys, starts)
    return mtp_pooled.by_query_chunks(
        lambda part: pooled_pick(attn, keys, queries[:, part], seen[:, part], pool_rope),
        length,
        batch * keys.shape[1] * dim,
    )


def pooled_pick(attn: nn.Module, keys: torch.Tensor, queries: torch.Tensor, seen: torch.Tensor, pool_rope):
    """`selection` for a chunk of queries: keys [B, K, D], queries [B, C, heads, D], seen [B, C, K]."""
    indexer = attn.indexer
    ratio, dim = indexer.compress_ratio, keys.shape[-1]
    rank, complete, pool, member = mtp_pooled.rank_pools(seen, ratio)
    pools = pool_rope[0].shape[1]  # the last one collects the keys in no complete pool
    slot = torch.where(member, pool, pools - 1)[..., None].expand(*member.shape, dim)
    summed = keys.new_zeros((*member.shape[:2], pools, dim), dtype=torch.float32)
    summed = summed.scatter_add(2, slot, keys.float()[:, None].expand(*member.shape, dim) * member[..., None])
    pooled = indexer.k_layernorm((summed / ratio).to(keys.dtype))
    pooled = family_rotation(attn)(pooled, cos=pool_rope[0], sin=pool_rope[1], unsqueeze_dim=1)
    scores = F.relu(torch.einsum("bchd,bcpd->bcph", queries.float(), pooled.float())).sum(-1) / dim**0.5
    chosen = mtp_pooled.best_pools(scores, complete, pool, member, indexer.block_topk)
    return chosen | (seen & (rank >= complete * ratio))  # and the unfinished pool's keys
