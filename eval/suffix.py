"""Suffix decoding (arXiv 2411.04975): the strongest drafter that needs no training, as vLLM serves it.

Suffix trees over the request's prompt and over the answers of earlier requests propose the continuation
that most often followed the longest matching suffix of what has been written, as many tokens as the
match supports. The trees are arctic-inference's own (`SuffixDecodingCache`, the code vLLM's
`{"method": "suffix"}` runs), driven the way vLLM 0.32's proposer drives them, with its default settings;
arctic-inference ships as a source distribution only (`draftsmith.engines.arctic_build`).
"""

from __future__ import annotations

import itertools
from typing import Optional

from draftsmith.engines import SuffixSettings, arctic_build
from draftsmith.errors import UserError
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.target import FeatureRequest

INSTALL = f"build it into this environment: {arctic_build()}"


class SuffixTrees:
    """The trees every sequence of one decoding pass shares, as one vLLM engine's: each sequence's prompt,
    and the answers written so far. `forget` starts over with none (a new pass must not draft from the
    answers an earlier pass wrote for the same prompts)."""

    def __init__(self, settings: SuffixSettings = SuffixSettings()):
        self.settings = settings
        self.request_ids = itertools.count()
        self.forget()

    def forget(self) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(self.settings.max_tree_depth, self.settings.max_cached_requests)


class SuffixDrafter(Proposer):
    """One sequence's suffix-decoding proposer over `trees`: a deterministic chain (q one-hot) of up to
    the tokens asked for, as long as the match supports, or none (the loop then runs a plain step)."""

    features = FeatureRequest(final=True)

    def __init__(self, trees: SuffixTrees):
        self.trees = trees
        self.request: Optional[int] = None
        self.cache = None  # the trees' cache this sequence was started in
        self.seen = 0  # committed tokens the trees have

    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None:
            raise UserError("suffix decoding proposes chains only")
        tokens, cache = state.tokens.tolist(), self.trees.cache
        if state.fresh or cache is not self.cache:
            if self.cache is cache and self.request in cache.active_requests:
                cache.stop_request(self.request)  # its answer stays in the trees, for later sequences
            # a sequence's first proposal comes right after its prompt (the prompt's last token is the root)
            self.request, self.cache, self.seen = next(self.trees.request_ids), cache, len(tokens)
            cache.start_request(self.request, tokens)
        if len(tokens) > self.seen:
            cache.add_active_response(self.request, tokens[self.seen :])
            self.seen = len(tokens)
        settings = self.trees.settings
        draft = cache.speculate(
            self.request,
            tokens[-settings.max_tree_depth :],
            max_spec_tokens=num_tokens,
            max_spec_factor=settings.max_spec_factor,
            min_token_prob=settings.min_token_prob,
        )
        return DraftTree.chain(state.tokens.new_tensor(list(draft.token_ids)))
