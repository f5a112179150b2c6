"""Prompt-lookup decoding: the baseline drafter that needs no training, as vLLM's n-gram proposer drafts.

Find the longest trailing n-gram of the committed tokens (n = ngram_max down to PROMPT_LOOKUP_MIN) earlier in the
context, its earliest occurrence among the longest (vLLM's `_find_longest_matched_ngram_and_propose_tokens`), and
propose the tokens that followed it. Repetitive outputs (code that echoes the prompt, quoted documents, lists) get
long accepted chains for free; a drafter worth training beats it. It took n down to 1 and the most recent
occurrence, and 3 as its longest, which vLLM as served (2 to 4, export/free_methods.py) does not draft.
"""

from __future__ import annotations

from typing import Optional

from draftsmith.engines import PROMPT_LOOKUP_MIN
from draftsmith.errors import UserError
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.target import FeatureRequest


class NGramDrafter(Proposer):
    """A deterministic chain drafter (q one-hot). It may propose fewer than asked, or nothing (then
    the loop runs a plain step)."""

    features = FeatureRequest(final=True)

    def __init__(self, ngram_max: int):
        if ngram_max < PROMPT_LOOKUP_MIN:  # it would never draft
            raise UserError(f"eval.ngram_max={ngram_max} must be >= {PROMPT_LOOKUP_MIN} (vLLM's prompt_lookup_min)")
        self.ngram_max = ngram_max

    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None:
            raise UserError("the n-gram drafter proposes chains only")
        tokens = state.tokens
        for n in range(min(self.ngram_max, len(tokens) - 1), PROMPT_LOOKUP_MIN - 1, -1):
            # Windows starting before len - n: the trailing n-gram itself is excluded, and every
            # earlier match has at least one token after it.
            windows = tokens[:-1].unfold(0, n, 1)
            hits = (windows == tokens[-n:]).all(dim=1).nonzero()
            if len(hits):
                start = int(hits[0]) + n  # the earliest match, as vLLM's proposer takes
                return DraftTree.chain(tokens[start : start + num_tokens])
        return DraftTree.chain(tokens[:0])
