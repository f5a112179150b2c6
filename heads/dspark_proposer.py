"""DSpark's decoding side: DFlash's context cache (heads/dflash_proposer.py), one block forward per cycle, then the
Markov head sampled left to right over the block (heads/dspark.py's docstring); with adaptive verification, the
chain cut to the drafts vLLM would verify (`draft_budget`).

vLLM 0.32's adaptive verification (speculative config `enable_adaptive_verification`, default false; its GPU model
runner V2 only: vllm/v1/worker/gpu/spec_decode/adaptive_verification.py), for a step with drafts scheduled:
- each draft slot (request r, position j) scores its survival, the running product c_r1 * ... * c_rj of the
  confidence head's sigmoids (get_num_tokens: `np.cumprod(stale_confidences)`);
- the step's draft budget is the k in 0 .. K (K the drafts scheduled) maximising (R + the k best scores summed) /
  (D[R] + V[N + k]): R the requests sampling this step, N their tokens besides drafts (one each when decoding), D
  and V the draft and verify step costs by requests and by target tokens, profiled at start-up; the first maximum
  wins (`np.argmax`);
- the scores that size the budget are a step stale: the confidences of the request's previous drafts, copied to
  the host while the next step ran (`_stale_confidences`), 1.0 for a new request (`add_request`); the budget is then
  shared out by the current drafts' survival (`_assign_draft_token_budget`, a top-k), which with one request gives
  it its first k drafts. The verify forward and the rejection sampler then see only those k: a cut chain, so greedy
  output and sampling stay exact.
The eval models one running request (R = N = 1): its chain of γ is cut to the k the previous cycle's confidences
buy at the profiled costs (eval/step_costs.py profiles them on the eval's device, as vLLM does on its own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy
import torch

from draftsmith.errors import UserError
from draftsmith.heads.dflash_proposer import DFlashProposer
from draftsmith.heads.proposer import DraftState, DraftTree, StepCosts, Tree, draft_stream

if TYPE_CHECKING:
    from draftsmith.heads.dspark import DSpark


def draft_budget(confidences: Optional[torch.Tensor], scheduled: int, costs: StepCosts) -> int:
    """How many of one decoding request's `scheduled` drafts vLLM verifies, from the confidences [≥ scheduled] of
    its previous drafts (None: a new request's, 1.0): AdaptiveVerificationManager.get_num_tokens with one request
    (module docstring). float64 as vLLM's host-side numpy."""
    stale = numpy.ones(scheduled) if confidences is None else confidences[:scheduled].double().cpu().numpy()
    scores = numpy.sort(numpy.cumprod(stale))[::-1]
    accepted = numpy.concatenate(([1.0], 1.0 + numpy.cumsum(scores)))  # the sampled token, then the drafts' scores
    cost = costs.draft_ms + numpy.asarray(costs.verify_ms[: scheduled + 1])  # V[1 + k]: the root and k drafts
    return int(numpy.argmax(accepted / cost))


class DSparkProposer(DFlashProposer):
    """A chain of γ: one forward of a block of γ queries (the root, the last committed token, and γ-1 masks), each
    position predicting the token after it; position i's logits get the Markov bias of the token before it (the
    root, then the token drafted at i-1) and its token is their argmax (T=0) or a sample from q_i (T>0), so q_i is
    the proposal conditioned on the drafted prefix, the exact rule's."""

    drafter: DSpark

    def __init__(self, drafter: DSpark, temperature: float):
        super().__init__(drafter, temperature)
        self.cut_by_step_costs = drafter.config.adaptive_verification  # step_costs None: every draft verified
        self.confidences: Optional[torch.Tensor] = None  # of the previous drafts: what sizes the next budget

    def start(self, seed: int) -> None:
        super().start(seed)
        self.confidences = None

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
        outputs = self.block_outputs(state, num_tokens)
        base = self.drafter.logits(outputs)  # [γ, V]
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
        drafted, q = torch.stack(tokens), torch.stack(probs) if probs else None
        if self.step_costs is None:
            return DraftTree.chain(drafted, q)
        verified = draft_budget(self.confidences, num_tokens, self.step_costs)
        before = torch.cat([state.tokens[-1:], drafted[:-1]])  # each position's previous token (the Markov head's)
        markov = self.drafter.markov_head.markov_w1(before)
        self.confidences = self.drafter.confidence_head(outputs, markov).sigmoid()
        return DraftTree.chain(drafted[:verified], q[:verified] if q is not None and verified else None)
