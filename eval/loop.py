"""The draft-verify loop: chain and tree drafts, greedy and exact sampling, one prompt or a batch.

One cycle, for every row of the batch at once:

    cache = prefix                    the committed tokens except the last one (the root)
    draft = drafter.propose(...)      N nodes hanging below the root (a chain is a tree), per row
    forward([root] + draft)           ONE target forward for the batch; node i sees its row's prefix,
                                      its ancestors and itself
    path, bonus = verify(...)         per row: walk down from the root accepting children; the target
                                      picks the bonus
    cache = prefix + root + path      drop the rejected nodes, packing the accepted ones into place
    root = bonus                      it is not in the cache yet: the next forward starts with it

The prefill runs over the prompt minus its last token, which becomes the first root. So every new
token comes out of a decode forward, and tau (new tokens per target forward, bonus included) is exact
with the prefill not counted as a forward. Plain decoding is the same loop with an empty draft: one
forward, one token.

Batches: rows accept different numbers of tokens, so their committed lengths drift apart. The cache
keeps each row right-aligned (left padding that no query sees) and positions are given explicitly, so
every row is attended and positioned exactly as if it were decoded alone; a finished row (EOS or its
token budget) leaves the batch. Each row has its own proposer (its own drafting state) and its own
random stream, seeded as it would be alone, so a batch changes nothing but the arithmetic's grouping.

Recurrent layers (the linear attention of hybrid targets such as Qwen3.5 and Qwen3-Next) fold every
token fed into one state that cannot be cut back to a prefix the way keys can. Where the family's transformers
code keeps those states at every position of a forward (`keeps_each_position`, proven once per model), a verify
forward keeps them and the loop drops those of the rejected positions, as an engine does. Elsewhere the loop
keeps a copy of the states before a verify forward; when a draft is rejected it puts the copies back, cuts the
keys to the same point, and feeds the accepted tokens again at the head of the next cycle's forward (the row's
`pending` tokens: still one target forward a cycle, only a wider one). While drafts keep being rejected those
tokens are never kept, so past REFEED_LIMIT of them they are fed on their own (`commit_pending`): without it a
drafter that is never right makes each forward as wide as the answer so far.
A recurrent state sees its tokens in sequence, so such a target verifies chains only, and decodes a batch's
rows one at a time (no padding may pass through a state). Mamba-2 layers scanning in PyTorch take narrow
chunks in these forwards (draftsmith/scans.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import DynamicCache

from draftsmith.caches import (
    RecordedStates,
    RecurrentCheckpoint,
    cached_length,
    cut_keys,
    gather_positions,
    key_layers,
    move_positions,
    new_cache,
    recordable_layers,
    select_rows,
)
from draftsmith.errors import UserError
from draftsmith.eval.counts import Generation
from draftsmith.eval.sampling import Sampling, Verdict, verify
from draftsmith.eval.target_checks import check_target, keeps_each_position
from draftsmith.eval.trees import (
    attention_masks,
    cache_positions,
    cut_tree,
    draft_depth,
    is_chain,
    tree_depths,
    verify_visibility,
)
from draftsmith.families import (
    reads_in_order,
)
from draftsmith.heads.packing import causal_document_mask
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.scans import scan_chunks
from draftsmith.target import FeatureRequest, run_target


@dataclass
class RowState:
    """One sequence: everything committed so far. `final`/`layers` are the target's hidden states at
    the position before the root; `new_final` / `new_layers` are those at the positions committed since
    the drafter last proposed (see DraftState), `fresh` is True until it first has. The cache holds the
    first `cached` tokens; the rest (`pending`: the root, and on a recurrent target the tokens accepted
    by a cycle whose draft was cut short) go into the next forward."""

    tokens: list[int]
    cached: int
    final: torch.Tensor  # [H]
    layers: dict[int, torch.Tensor]
    new_final: torch.Tensor  # [m, H]
    new_layers: dict[int, torch.Tensor]  # layer id -> [m, H]
    fresh: bool = True
    new_streams: Optional[torch.Tensor] = None  # [m, S, H], where the drafter reads the target's streams

    def draft_state(self) -> DraftState:
        return DraftState(
            tokens=torch.tensor(self.tokens, device=self.final.device),
            final=self.final,
            layers=self.layers,
            new_final=self.new_final,
            new_layers=self.new_layers,
            fresh=self.fresh,
            new_streams=self.new_streams,
        )

    def commit_hidden(
        self, final: torch.Tensor, layers: dict[int, torch.Tensor], streams: Optional[torch.Tensor] = None
    ) -> None:
        """Record the target's hidden states [k, H] (streams [k, S, H]) at newly committed positions (oldest first)."""
        self.final = final[-1]
        self.layers = {layer: hidden[-1] for layer, hidden in layers.items()}
        self.new_final = torch.cat([self.new_final, final])
        self.new_layers = {layer: torch.cat([self.new_layers[layer], hidden]) for layer, hidden in layers.items()}
        if streams is not None:
            self.new_streams = torch.cat([self.new_streams, streams])

    def mark_proposed(self) -> None:
        """The drafter has seen everything committed so far."""
        self.new_final = self.new_final[:0]
        self.new_layers = {layer: hidden[:0] for layer, hidden in self.new_layers.items()}
        self.new_streams = None if self.new_streams is None else self.new_streams[:0]
        self.fresh = False

    @property
    def pending(self) -> list[int]:
        return self.tokens[self.cached :]


@dataclass
class DecodeState:
    """Rows decoded together over one KV cache. Invariant: row b's cache entries are the last
    `rows[b].cached` of the cache's `width` positions (right-aligned); the positions before them are
    padding, masked for every query."""

    rows: list[RowState]
    cache: DynamicCache
    recorded: list = field(default_factory=list)  # layers whose states each verify forward keeps per position

    @property
    def width(self) -> int:
        return cached_length(self.cache)

    def keep_rows(self, keep: Sequence[int]) -> None:
        """Drop the other rows (finished sequences), and the left padding nobody needs any more."""
        self.rows = [self.rows[b] for b in keep]
        width = max(row.cached for row in self.rows)
        select_rows(self.cache, torch.tensor(list(keep), device=key_layers(self.cache)[0].keys.device), width)


# the tokens a prompt has at least: all but its last are cached, and the last is the first root
SHORTEST_PROMPT = 2


@torch.no_grad()
def prefill(model, prompts: Sequence[Sequence[int]], request: FeatureRequest = FeatureRequest()) -> DecodeState:
    """Cache every prompt except its last token, which becomes the row's first root. Shorter prompts
    are left-padded; a prompt token sees its own row's causal prefix, padding only padding."""
    if any(len(prompt) < SHORTEST_PROMPT for prompt in prompts):
        raise UserError(f"a prompt needs at least {SHORTEST_PROMPT} tokens (the chat template alone gives more)")
    if len(prompts) > 1 and reads_in_order(model.config):
        raise ValueError(
            "a target with linear, compressed, block-sparse or convolved attention decodes rows one at a time "
            "(generate_batch)"
        )
    device = model.get_output_embeddings().weight.device
    cache = new_cache(model)
    lengths = [len(prompt) - 1 for prompt in prompts]
    width = max(lengths)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for b, prompt in enumerate(prompts):
        ids[b, width - lengths[b] :] = torch.tensor(list(prompt[:-1]), device=device)
    mask = positions = None  # one prompt: no padding, the model's own causal mask
    if len(prompts) > 1:
        pad = torch.tensor([width - n for n in lengths], device=device)[:, None]
        column = torch.arange(width, device=device)
        positions = (column - pad).clamp(min=0)
        # The padding is a document of its own (-1), so its queries stay finite and no prompt sees it.
        documents = torch.where(column >= pad, 0, -1)
        mask = attention_masks(model, causal_document_mask(documents)[:, 0], positions, positions)
    with scan_chunks(model, width):
        out = run_target(model, ids, mask, request, positions, cache, use_cache=True)
    rows = []
    for b, (prompt, n) in enumerate(zip(prompts, lengths)):
        layers = {layer: hidden[b, width - n :] for layer, hidden in out.layers.items()}
        rows.append(
            RowState(
                tokens=list(prompt),
                cached=n,
                final=out.final[b, -1],
                layers={layer: hidden[-1] for layer, hidden in layers.items()},
                new_final=out.final[b, width - n :],  # every cached position is new to the drafter
                new_layers=layers,
                new_streams=None if out.streams is None else out.streams[b, width - n :],
            )
        )
    return DecodeState(rows=rows, cache=cache)


def keep_in_cache(cache: DynamicCache, start: int, keep: torch.Tensor) -> None:
    """One row: the cache holds [prefix | new positions] with the prefix `start` long; keep the new
    positions `keep` (relative to `start`, in order) packed right after the prefix and drop the rest."""
    kept = len(keep)
    if not torch.equal(keep, torch.arange(kept, device=keep.device)):  # a chain's path is already in place
        move_positions(cache, start, keep)
    cut_keys(cache, start + kept)


def gather_cache(cache: DynamicCache, width: int, cached: Sequence[int], keeps: Sequence[torch.Tensor]) -> None:
    """Several rows: the cache holds [right-aligned prefixes (`width`) | new positions]; row b keeps its
    `cached[b]` prefix entries and the new positions `keeps[b]`, right-aligned again in a cache as wide
    as the longest row. Padding slots point at entry 0 (finite, and masked)."""
    device = keeps[0].device
    lengths = [n + len(keep) for n, keep in zip(cached, keeps)]
    new_width = max(lengths)
    index = torch.zeros(len(keeps), new_width, dtype=torch.long, device=device)
    for b, (n, keep) in enumerate(zip(cached, keeps)):
        index[b, new_width - lengths[b] :] = torch.cat([torch.arange(width - n, width, device=device), keep + width])
    gather_positions(cache, index)


def empty_draft(device: torch.device) -> DraftTree:
    return DraftTree.chain(torch.empty(0, dtype=torch.long, device=device))


def propose(
    drafter: Optional[Proposer], state: RowState, gamma: int, tree: Optional[Tree], max_depth: int
) -> DraftTree:
    """The drafter's proposal, no deeper than `max_depth` (so a cycle never emits past the budget)."""
    device = state.final.device
    if drafter is None:
        state.mark_proposed()  # nobody will read them: plain decoding must not pile up hidden states
        return empty_draft(device)
    if max_depth < 1:
        return empty_draft(device)
    if tree is not None:
        draft = drafter.propose(state.draft_state(), gamma, cut_tree(tree, max_depth))
    else:
        draft = drafter.propose(state.draft_state(), min(gamma, max_depth))
    state.mark_proposed()
    probs = None if draft.probs is None else draft.probs.to(device)
    return DraftTree(tokens=draft.tokens.to(device), parents=draft.parents.to(device), probs=probs)


@torch.no_grad()
def verify_step(
    model,
    state: DecodeState,
    drafts: Sequence[DraftTree],
    sampling: Sampling,
    generators: Sequence[torch.Generator],
    eos_ids: frozenset[int] = frozenset(),
    request: FeatureRequest = FeatureRequest(),
) -> list[Verdict]:
    """One target forward over [pending] + draft of every row (the pending tokens end with the root),
    then per row verification and cache rollback; updates `state`."""
    width, rows = state.width, state.rows
    cached = [row.cached for row in rows]
    pending = [len(row.pending) for row in rows]
    queries = max(p + len(draft) for p, draft in zip(pending, drafts))
    device = drafts[0].tokens.device
    ids = torch.zeros(len(rows), queries, dtype=torch.long, device=device)
    positions = torch.zeros(len(rows), queries, dtype=torch.long, device=device)
    for b, (row, draft, p) in enumerate(zip(rows, drafts, pending)):
        ids[b, : p + len(draft)] = torch.cat([torch.tensor(row.pending, device=device), draft.tokens])
        positions[b] = row.cached + p - 1
        positions[b, : p - 1] = row.cached + torch.arange(p - 1, device=device)
        positions[b, p - 1 : p + len(draft)] += tree_depths(draft.parents)
    # One row with a chain: the tree mask is the causal mask, so let the model build it, which keeps
    # SDPA on the same kernels as plain decoding (an explicit mask would make plain decoding slower,
    # inflating speedups). A batch always needs the explicit mask (padding), plain decoding included;
    # its rows have one pending token each (only a recurrent target has more, and it decodes rows alone).
    single_chain = len(rows) == 1 and is_chain(drafts[0].parents)
    mask = None
    if not single_chain:
        keys = torch.cat([cache_positions(cached, width, device), positions], dim=1)
        mask = attention_masks(model, verify_visibility(drafts, cached, width), positions, keys)
    rollback = None
    if state.recorded:  # every forward while a drafter decodes: the history of each is dropped after it
        rollback = RecordedStates(state.recorded, queries)
    elif any(len(draft) for draft in drafts):
        rollback = RecurrentCheckpoint(state.cache)
    with scan_chunks(model, queries):
        out = run_target(model, ids, mask, request, positions, state.cache, use_cache=True)

    verdicts, keeps = [], []
    for b, (row, draft, p) in enumerate(zip(rows, drafts, pending)):
        verdict = verify(draft, sampling.probs(out.logits[b, p - 1 : p + len(draft)]), generators[b], eos_ids)
        path = torch.tensor(verdict.path, dtype=torch.long, device=device)
        keep = torch.cat([torch.arange(p, device=device), p + path])
        # Committed now: the root and the path (the tokens pending before the root were committed
        # earlier); the last of them produced the bonus.
        hidden = keep[p - 1 :]
        row.commit_hidden(
            out.final[b, hidden],
            {layer: hidden_states[b, hidden] for layer, hidden_states in out.layers.items()},
            None if out.streams is None else out.streams[b, hidden],
        )
        row.tokens.extend(int(draft.tokens[node]) for node in verdict.path)
        if verdict.bonus is not None:
            row.tokens.append(verdict.bonus)
        if rollback is not None and rollback.put_back(len(draft) - len(verdict.path)):
            # The states are back to before the forward, and the accepted tokens go into the next forward (one
            # row: a recurrent target decodes rows alone).
            keep = keep[:0]
        else:
            row.cached = len(row.tokens) - 1
        verdicts.append(verdict)
        keeps.append(keep)
    if len(rows) == 1:
        keep_in_cache(state.cache, width, keeps[0])
        if len(rows[0].pending) > REFEED_LIMIT:
            commit_pending(model, rows[0], state.cache)
    else:
        gather_cache(state.cache, width, cached, keeps)
    return verdicts


REFEED_LIMIT = 16  # the most tokens a row of a recurrent target takes into a verify forward before its draft


def commit_pending(model, row: RowState, cache: DynamicCache) -> None:
    """Feed the row's pending tokens before its root to the target in a forward of their own, into its cache and
    recurrent states for good. Their hidden states were committed by the forward that verified them, so its output
    is not read; it is not a cycle (an engine keeps the states at every draft position and never feeds a token
    twice), though its time counts in the method's wall time."""
    tokens = row.pending[:-1]
    device = row.final.device
    positions = row.cached + torch.arange(len(tokens), device=device)[None]
    ids = torch.tensor([tokens], device=device)
    with scan_chunks(model, len(tokens)):
        run_target(model, ids, None, FeatureRequest(), positions, cache, use_cache=True)
    row.cached += len(tokens)


@torch.no_grad()
def generate(
    model,
    prompt: Sequence[int],
    max_new_tokens: int,
    drafter: Optional[Proposer] = None,
    gamma: int = 0,
    tree: Optional[Tree] = None,
    sampling: Sampling = Sampling(),
    eos_ids: frozenset[int] = frozenset(),
    seed: int = 0,
) -> Generation:
    """Decode one prompt: `generate_batch` with a batch of one."""
    return generate_batch(model, [prompt], max_new_tokens, [drafter], gamma, tree, sampling, eos_ids, [seed])[0]


@torch.no_grad()
def generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    drafters: Optional[Sequence[Optional[Proposer]]] = None,
    gamma: int = 0,
    tree: Optional[Tree] = None,
    sampling: Sampling = Sampling(),
    eos_ids: frozenset[int] = frozenset(),
    seeds: Optional[Sequence[int]] = None,
) -> list[Generation]:
    """Decode the prompts together, up to `max_new_tokens` each (a row stops after an EOS), with a
    chain of `gamma` draft tokens, a `tree` (static paths or a DynamicTree), or no drafter at all
    (plain decoding). `drafters[b]` is row b's own proposer (None for all: plain); `seeds[b]` seeds its
    random stream (default 0 for every row). Each row's counters are charged an equal share of the
    batch's wall time, so summed counters give the batch's tokens/s. A target with recurrent layers
    decodes the rows one at a time (the same tokens and counters, without a batch's speed)."""
    size = len(prompts)
    drafters = list(drafters) if drafters is not None else [None] * size
    if len(drafters) != size or (drafters[0] is not None and len({id(d) for d in drafters}) != size):
        raise ValueError(
            "generate_batch needs one proposer of its own per prompt (a proposer holds one sequence's state)"
        )
    check_target(model, tree is not None, size > 1, max(map(len, prompts)) + max_new_tokens)
    seeds = list(seeds or [0] * size)
    if size > 1 and reads_in_order(model.config):
        return [
            generate_batch(model, [prompt], max_new_tokens, [drafter], gamma, tree, sampling, eos_ids, [seed])[0]
            for prompt, drafter, seed in zip(prompts, drafters, seeds)
        ]
    records = drafters[0] is not None and reads_in_order(model.config) and keeps_each_position(model)  # proven once
    start = time.perf_counter()
    device = model.get_output_embeddings().weight.device
    generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
    for drafter, seed in zip(drafters, seeds):
        if drafter is not None:
            drafter.start(seed)
    request = drafters[0].features if drafters[0] is not None else FeatureRequest()
    forwards_before = [d.draft_forwards if d is not None else 0 for d in drafters]
    results = [Generation() for _ in range(size)]
    state = prefill(model, prompts, request)
    if records:
        state.recorded = recordable_layers(state.cache)
    active = list(range(size)) if max_new_tokens > 0 else []  # prompt index of each row of `state`
    while active:
        drafts = [
            propose(drafters[i], row, gamma, tree, max_new_tokens - len(results[i].tokens) - 1)
            for i, row in zip(active, state.rows)
        ]
        before = [len(row.tokens) for row in state.rows]
        verdicts = verify_step(model, state, drafts, sampling, [generators[i] for i in active], eos_ids, request)
        going = []
        for b, i in enumerate(active):
            new = state.rows[b].tokens[before[b] :]
            results[i].tokens += new
            results[i].counts.count_cycle(draft_depth(drafts[b]), len(new), verdicts[b])
            if not (
                verdicts[b].bonus is None or verdicts[b].bonus in eos_ids or len(results[i].tokens) >= max_new_tokens
            ):
                going.append(b)
        if going and len(going) < len(active):
            state.keep_rows(going)
        active = [active[b] for b in going]
    for result, drafter, before in zip(results, drafters, forwards_before):
        if drafter is not None:
            result.counts.draft_forwards = drafter.draft_forwards - before
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    for result in results:
        result.counts.wall_s = wall / size
    return results
