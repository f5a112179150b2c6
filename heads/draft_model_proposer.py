"""The draft model's decoding side: autoregressive drafting with its own KV cache, cropped to what is still
committed, or PARD's one forward per chain (heads/draft_model.py's docstring, "Decoding").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from draftsmith.caches import RecurrentCheckpoint, cut_keys, new_cache
from draftsmith.errors import UserError
from draftsmith.families import reads_in_order
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, draft_stream
from draftsmith.scans import scan_chunks
from draftsmith.target import FeatureRequest

if TYPE_CHECKING:
    from transformers import DynamicCache

    from draftsmith.heads.draft_model import DraftModel  # an annotation only: that module imports this one


class DraftModelProposer(Proposer):
    """Autoregressive drafting with the draft model's own KV cache, or PARD's one forward per chain
    (see the module docstring)."""

    features = FeatureRequest(final=False)

    def __init__(self, drafter: DraftModel, temperature: float):
        self.model = drafter.model
        self.mask_token_id = drafter.config.mask_token_id if drafter.config.parallel_drafting else None
        self.temperature = float(temperature)
        self.seed = 0  # the sequence's (`start`)
        self._generator: Optional[torch.Generator] = None  # its draws: `draft_stream`
        self._cache: Optional[DynamicCache] = None
        self._cached: list[int] = []  # the tokens whose keys/values `_cache` holds
        self._checkpoint: Optional[RecurrentCheckpoint] = None  # recurrent states after `_checkpointed` tokens
        self._checkpointed = 0

    def start(self, seed: int) -> None:
        self.seed, self._generator = seed, None

    @torch.no_grad()
    def propose(self, state: DraftState, num_tokens: int, tree=None) -> DraftTree:
        if tree is not None:
            raise UserError("a draft_model drafter proposes chains only; set eval.tree=0")
        device = self.model.get_output_embeddings().weight.device
        committed = state.tokens.tolist()
        if self.mask_token_id is not None:  # PARD: the committed tokens, then masks; one forward, every draft
            masks = [self.mask_token_id] * (num_tokens - 1)
            if reads_in_order(self.model.config):  # a checkpoint between them: two forwards
                parallel = self._commit(committed, device)
                if masks:
                    parallel = torch.cat([parallel, self._advance(committed + masks, device, len(masks))])
            else:
                parallel = self._advance(committed + masks, device, num_tokens)
        tokens, probs = [], []
        for step in range(num_tokens):
            if self.mask_token_id is not None:
                logits = parallel[step]
            elif step == 0:
                logits = self._commit(committed, device)[-1]
            else:
                logits = self._advance(self._cached + [tokens[-1]], device)[-1]
            if self.temperature > 0:
                q = (logits.float() / self.temperature).softmax(-1)
                tokens.append(int(torch.multinomial(q, 1, generator=self._sample_generator(device))))
                probs.append(q)
            else:
                tokens.append(int(logits.argmax()))
        token_tensor = torch.tensor(tokens, device=device)
        return DraftTree.chain(token_tensor, torch.stack(probs) if probs else None)

    def _advance(self, tokens: list[int], device: torch.device, outputs: int = 1) -> torch.Tensor:
        """The draft's next-token logits [outputs, V] at the last `outputs` of `tokens`, feeding only
        what the cache lacks.

        The cache goes back to the longest common prefix of what it holds and `tokens` (this rolls
        back rejected draft tokens and PARD's masks; a new prompt shares little or nothing), keeping at
        least the last `outputs` tokens to feed, whose logits are the answer. Recurrent layers cannot be
        cut: they go back to the checkpoint taken when the committed tokens were last fed
        (`_commit`), or start over without one."""
        common = 0
        for cached, new in zip(self._cached, tokens[:-outputs]):
            if cached != new:
                break
            common += 1
        if self._checkpoint and common < len(self._cached):
            if self._checkpointed <= common:
                self._checkpoint.restore()
                common = self._checkpointed
            else:
                common = 0
        if self._cache is None or common == 0:
            self._cache = new_cache(self.model)  # full-length layers: a sliding-window layer's keys must cut too
            self._checkpoint, common = None, 0
        cut_keys(self._cache, common)
        ids = torch.tensor([tokens[common:]], device=device)
        positions = torch.arange(common, len(tokens), device=device)[None]
        with scan_chunks(self.model, ids.shape[1]):
            out = self.model(input_ids=ids, position_ids=positions, cache=self._cache, use_cache=True)
        self.draft_forwards += 1
        self._cached = list(tokens)
        return out.logits[0, -outputs:]

    def _commit(self, committed: list[int], device: torch.device) -> torch.Tensor:
        """`_advance` over the committed tokens, then a checkpoint of the recurrent states (if any)."""
        logits = self._advance(committed, device)
        self._checkpoint, self._checkpointed = RecurrentCheckpoint(self._cache), len(committed)
        return logits

    def _sample_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = draft_stream(self.seed, device)
        return self._generator
