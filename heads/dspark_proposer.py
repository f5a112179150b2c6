"""DSpark's decoding side: DFlash's context cache (heads/dflash_proposer.py), one block forward per cycle, then the
Markov head sampled left to right over the block (heads/dspark.py's docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from draftsmith.errors import UserError
from draftsmith.heads.dflash_proposer import DFlashProposer
from draftsmith.heads.proposer import DraftState, DraftTree, Tree, draft_stream

if TYPE_CHECKING:
    from draftsmith.heads.dspark import DSpark


class DSparkProposer(DFlashProposer):
    """A chain of γ: one forward of a block of γ queries (the root, the last committed token, and γ-1 masks), each
    position predicting the token after it; position i's logits get the Markov bias of the token before it (the
    root, then the token drafted at i-1) and its token is their argmax (T=0) or a sample from q_i (T>0), so q_i is
    the proposal conditioned on the drafted prefix, the exact rule's."""

    drafter: DSpark

    @torch.no_grad()
    def block_outputs(self, state: DraftState, size: int) -> torch.Tensor:
        """The block's final-norm outputs [size, H] after the committed tokens (DFlash's cached context)."""
        self.catch_up(state)
        self.draft_forwards += 1
        committed = len(state.tokens) - 1
        device = state.tokens.device
        positions = (committed + torch.arange(size, device=device))[None, None]
        visible = torch.ones(1, 1, self.cached(), dtype=torch.bool, device=device)
        return self.drafter.denoise(state.tokens[-1:][None], positions, self.cache, visible)[0, 0]

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        if tree is not None:
            raise UserError("the dspark drafter proposes chains only (its Markov head samples left to right)")
        base = self.drafter.logits(self.block_outputs(state, num_tokens))  # [γ, V]
        previous = state.tokens[-1]
        if self.temperature > 0 and (self.generator is None or self.generator.device != base.device):
            self.generator = draft_stream(self.seed, base.device)
        tokens, probs = [], []
        for position in range(num_tokens):
            logits = base[position] + self.drafter.markov_head.bias(previous)
            if self.temperature <= 0:
                previous = logits.argmax(-1)
            else:
                q = (logits / self.temperature).softmax(-1)
                previous = torch.multinomial(q, 1, generator=self.generator)[0]
                probs.append(q)
            tokens.append(previous)
        return DraftTree.chain(torch.stack(tokens), torch.stack(probs) if probs else None)
