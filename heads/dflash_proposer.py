"""DFlash's decoding side: `DFlashProposer` (the context keys and values of the committed sequence, one
block forward per cycle) and DDTree's best-first tree over the block's distributions. Apart from the
drafter's model and training (heads/dflash.py, whose docstring describes the decoding).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.heads.proposer import DraftState, DraftTree, DynamicTree, Proposer, Tree, draft_stream

if TYPE_CHECKING:
    from draftsmith.heads.dflash import DFlash


class DFlashProposer(Proposer):
    """DFlash decoding for one sequence at a time: the context keys/values of the committed sequence
    per layer (`catch_up`), one block forward per cycle, a chain or DDTree from its distributions."""

    def __init__(self, drafter: DFlash, temperature: float):
        self.drafter = drafter
        self.features = drafter.request
        self.temperature = float(temperature)
        self.seed = 0  # the sequence's (`start`)
        self.generator: Optional[torch.Generator] = None  # its draws: `draft_stream`
        self.cache: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None  # per layer [1, kv, committed-1, d]

    def start(self, seed: int) -> None:
        self.seed, self.generator = seed, None

    def default_tree(self, size: int) -> DynamicTree:
        return DynamicTree(nodes=size, depth=self.drafter.config.block_size - 1, topk=self.drafter.config.tree_topk)

    def cached(self) -> int:
        return 0 if self.cache is None else int(self.cache[0][0].shape[2])

    def catch_up(self, state: DraftState) -> None:
        """Bring the per-layer context keys/values to positions 0 .. n-2 of the n committed tokens
        (everything before the root, which is the next block's anchor). The state carries the
        target's layers for the last m of them; entries from position n-1-m on are cropped (they were
        never there, or a previous sequence's) and rebuilt."""
        missing = [layer for layer in self.drafter.config.target_layers if layer not in state.new_layers]
        if missing:
            raise ValueError(
                f"dflash needs the target's layers {missing} at the newly committed positions (DraftState.new_layers)"
            )
        count = len(next(iter(state.new_layers.values())))
        committed = len(state.tokens) - 1
        start = committed - count
        if state.fresh or self.cache is None:
            self.cache = None
        if self.cached() < start:
            raise RuntimeError(
                f"dflash context cache holds {self.cached()} positions, the committed sequence needs {start}"
            )
        if count == 0:
            return
        device = state.tokens.device
        context = self.drafter.context({layer: state.new_layers[layer] for layer in self.drafter.config.target_layers})[
            None
        ]
        fresh = self.drafter.context_keys(context, torch.arange(start, committed, device=device)[None])
        if self.cache is None:
            self.cache = fresh
        else:
            self.cache = [
                (torch.cat([k[:, :, :start], nk], dim=2), torch.cat([v[:, :, :start], nv], dim=2))
                for (k, v), (nk, nv) in zip(self.cache, fresh)
            ]

    @torch.no_grad()
    def block_logits(self, state: DraftState, size: Optional[int] = None) -> torch.Tensor:
        """The draft's logits [size-1, V] for the tokens after the root, from one forward of a block
        of `size` queries (the root and size-1 masks; default the trained block_size)."""
        self.catch_up(state)
        self.draft_forwards += 1
        drafter = self.drafter
        committed = len(state.tokens) - 1
        device = state.tokens.device
        positions = (committed + torch.arange(size or drafter.config.block_size, device=device))[None, None]
        visible = torch.ones(1, 1, self.cached(), dtype=torch.bool, device=device)
        outputs = drafter.denoise(state.tokens[-1:][None], positions, self.cache, visible)
        return drafter.logits(outputs[0, 0, 1:])

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None and not isinstance(tree, DynamicTree):
            raise UserError(
                "the dflash drafter builds its tree (DDTree) from its block: pass eval.tree=<node budget>, not a "
                "static tree"
            )
        if tree is not None:
            logits = self.block_logits(state)
            log_q = (logits / self.temperature if self.temperature > 0 else logits).log_softmax(-1)
            return best_first_tree(log_q[: tree.depth], tree.nodes, tree.topk)
        logits = self.block_logits(state, num_tokens + 1)  # the block vLLM runs for a chain of num_tokens
        device = logits.device
        if self.temperature <= 0:
            return DraftTree.chain(logits.argmax(-1))
        q = (logits / self.temperature).softmax(-1)
        if self.generator is None or self.generator.device != device:
            self.generator = draft_stream(self.seed, device)
        # Each position is sampled from its own q, independently: the exact rule's proposal.
        return DraftTree.chain(torch.multinomial(q, 1, generator=self.generator)[:, 0], q)


def best_first_tree(log_q: torch.Tensor, nodes: int, topk: int) -> DraftTree:
    """DDTree: the `nodes` most likely prefixes under the block's per-position distributions, where a
    prefix (t_1..t_d) scores sum_k log q_k(t_k) and position k offers its `topk` best tokens.

    Best-first with a heap: popping a node adds it to the tree and offers its best child (the next
    position's top token) and its next sibling (same parent, the next-ranked token), so candidates
    enter the heap in score order and the kept set is exactly the best `nodes` prefixes; every
    node's parent is kept before it. Deterministic (ties by insertion order): q one-hot for the loop."""
    values, ids = log_q.topk(min(topk, log_q.shape[-1]), dim=-1)
    values, ids = values.tolist(), ids.tolist()
    depth, width = len(values), len(values[0]) if values else 0
    tokens: list[int] = []
    parents: list[int] = []
    heap = [(-values[0][0], 0, 0, 0, -1)] if depth and nodes > 0 else []  # (-score, order, position, rank, parent)
    order = 1
    while heap and len(tokens) < nodes:
        negative, _, position, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[position][rank])
        parents.append(parent)
        score = -negative
        if position + 1 < depth:
            heapq.heappush(heap, (-(score + values[position + 1][0]), order, position + 1, 0, node))
            order += 1
        if rank + 1 < width and not math.isinf(values[position][rank + 1]):
            heapq.heappush(
                heap,
                (-(score - values[position][rank] + values[position][rank + 1]), order, position, rank + 1, parent),
            )
            order += 1
    device = log_q.device
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
    )
