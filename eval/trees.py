"""The shapes of drafts, as the verify forward needs them: each node's depth, which node sees which
(itself and its ancestors), the additive attention mask of a batch of drafts over the cache (per layer kind for the
target: `attention_masks`), and the depth a tree request fills."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from draftsmith.families import (
    CHUNKED,
    FULL,
    SLIDING,
    attention_chunk,
    layer_types,
    masks_of_every_kind,
    sliding_window,
    within_chunk,
    within_window,
)
from draftsmith.heads.proposer import DraftTree, DynamicTree, Tree


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of [root] + nodes: 0 for the root, parent's depth + 1 for a node."""
    depths = [0]
    for parent in parents.tolist():
        depths.append(depths[parent + 1] + 1)
    return torch.tensor(depths, device=parents.device)


def draft_depth(draft: DraftTree) -> int:
    """Draft positions a proposal fills: a chain's length, a tree's longest path."""
    return int(tree_depths(draft.parents).max())


def tree_visibility(parents: torch.Tensor) -> torch.Tensor:
    """[1+N, 1+N] bool over [root] + nodes: each sees itself and its ancestors (the root is every
    node's ancestor)."""
    size = len(parents) + 1
    sees = torch.zeros(size, size, dtype=torch.bool, device=parents.device)
    sees[0, 0] = True
    for node, parent in enumerate(parents.tolist()):
        sees[node + 1] = sees[parent + 1]  # parents precede children, so this row is complete
        sees[node + 1, node + 1] = True
    return sees


def additive_mask(sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean [B, Q, K] visibility -> additive [B, 1, Q, K] mask (0 / min): eager attention adds the
    mask and SDPA reads an additive one the same way."""
    return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill(~sees, torch.finfo(dtype).min)[:, None]


def verify_visibility(drafts: Sequence[DraftTree], cached: Sequence[int], width: int) -> torch.Tensor:
    """[B, Q, width+Q] bool for a verify forward over [root] + draft per row, Q = 1 + the largest
    draft: row b's queries see its `cached[b]` right-aligned cache entries and, among the new
    tokens, themselves and their ancestors. Queries past a row's draft (batch padding) see only
    themselves, so every row of the softmax stays finite."""
    queries = 1 + max(len(draft) for draft in drafts)
    device = drafts[0].tokens.device
    sees = torch.zeros(len(drafts), queries, width + queries, dtype=torch.bool, device=device)
    diagonal = torch.arange(queries, device=device)
    for b, (draft, length) in enumerate(zip(drafts, cached)):
        size = len(draft) + 1
        sees[b, :, width - length : width] = True
        sees[b, :size, width : width + size] = tree_visibility(draft.parents)
        sees[b, diagonal[size:], width + diagonal[size:]] = True
    return sees


def cache_positions(cached: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """[B, width] the position of every right-aligned cache entry (row b's `cached[b]` entries hold
    positions 0..cached[b]-1; the padding before them gets negative positions no query sees)."""
    column = torch.arange(width, device=device)
    return column[None] - (width - torch.tensor(list(cached), device=device))[:, None]


def is_chain(parents: torch.Tensor) -> bool:
    return bool(torch.equal(parents, torch.arange(-1, len(parents) - 1, device=parents.device)))


def tree_depth(tree: Tree) -> int:
    """Draft positions a tree request fills at most: its longest path."""
    return tree.depth if isinstance(tree, DynamicTree) else max(map(len, tree))


def cut_tree(tree: Tree, max_depth: int) -> Tree:
    """The request no deeper than `max_depth` (a prefix-closed cut of static paths stays a tree)."""
    return tree.cut(max_depth) if isinstance(tree, DynamicTree) else [path for path in tree if len(path) <= max_depth]


def attention_masks(model, sees: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor):
    """The attention mask(s) of a forward whose queries see keys as `sees` [B, Q, K] says, at
    `query_positions` [B, Q] and `key_positions` [B, K]: one additive mask where every layer attends
    alike, and for a target with full and sliding-window or chunked layers one per kind (transformers' mapping by
    layer type), the sliding-window one also hiding keys `sliding_window` or more positions back, the chunked one
    keys of another chunk."""
    kinds = set(layer_types(model.config))
    queries, keys = query_positions[:, :, None], key_positions[:, None, :]
    narrowed = {}  # the kinds that see fewer keys than full attention: which of them
    if SLIDING in kinds:
        narrowed[SLIDING] = within_window(queries, keys, sliding_window(model.config))
    if CHUNKED in kinds:
        narrowed[CHUNKED] = within_chunk(queries, keys, attention_chunk(model.config))
    if not narrowed:
        return additive_mask(sees, model.dtype)
    masks = {kind: additive_mask(sees & near, model.dtype) for kind, near in narrowed.items()}
    if len(kinds) == 1:
        return masks[kinds.pop()]
    # a kind of the model's own name (indexed attention beside sliding layers) attends as full attention does
    return masks_of_every_kind(model.config, {FULL: additive_mask(sees, model.dtype), **masks})
