"""Prompt-lookup decoding: the baseline drafter that needs no training.

Find the longest trailing n-gram of the committed tokens (n = ngram_max down to 1) earlier in the
context and propose the tokens that followed it. Repetitive outputs (code that echoes the prompt,
quoted documents, lists) get long accepted chains for free; a drafter worth training beats it.
"""

from __future__ import annotations

from typing import Optional

from draftsmith.errors import UserError
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.target import FeatureRequest


class NGramDrafter(Proposer):
    """A deterministic chain drafter (q one-hot). It may propose fewer than asked, or nothing (then
    the loop runs a plain step)."""

    features = FeatureRequest(final=True)

    def __init__(self, ngram_max: int = 3):
        if ngram_max < 1:
            raise UserError(f"eval.ngram_max={ngram_max} must be at least 1")
        self.ngram_max = ngram_max

    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None:
            raise UserError("the n-gram drafter proposes chains only")
        tokens = state.tokens
        for n in range(min(self.ngram_max, len(tokens) - 1), 0, -1):
            # Windows starting before len - n: the trailing n-gram itself is excluded, and every
            # earlier match has at least one token after it.
            windows = tokens[:-1].unfold(0, n, 1)
            hits = (windows == tokens[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[-1]) + n  # the most recent match: closest to what is being written
                return DraftTree.chain(tokens[start : start + num_tokens])
        return DraftTree.chain(tokens[:0])
