"""The acceptance rule of speculative decoding: how the target's next token is drawn (`Sampling`, the
same for plain and speculative decoding) and how a draft tree's nodes are accepted or rejected
against the target's distributions (`verify`, recursive rejection sampling with `exact_rule`), so the
emitted tokens follow the target's distribution exactly; greedy is the one-hot case."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from draftsmith.heads.proposer import DraftTree


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the target's logits; speculative and plain decoding share it,
    so both sample exactly the same (warped) distribution."""

    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] float32 probabilities (one-hot on the argmax when greedy)."""
        logits = logits.float()
        if self.temperature <= 0:
            return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        # the largest logit at 0 first: a tiny temperature then scales the rest towards -inf, never to inf - inf
        logits = (logits - logits.amax(-1, keepdim=True)) / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            sorted_probs = sorted_logits.softmax(-1)
            # Drop a token once the more likely ones already cover top_p; the most likely always stays.
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return logits.softmax(-1)


def exact_rule(p: torch.Tensor, q: torch.Tensor, token: int, u: torch.Tensor) -> tuple[bool, torch.Tensor]:
    """Speculative sampling: accept with min(1, p/q), else continue with norm(max(0, p - q)). It sees the
    target's current distribution p at a node, the draft distribution q of one child, the child's token and
    a uniform draw u, and returns (accepted, the p to use next if not).

    With a deterministic draft q is one-hot, so this accepts with probability p(token) and the
    residual is p with p(token) set to 0, renormalised.
    """
    if u * q[token] < p[token]:  # u < p/q without dividing by q
        return True, p
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: a rejection had probability ~0, p itself is the answer
        return False, p
    return False, residual / total


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root's child first
    bonus: Optional[int]  # the target's token after the path; None when the path ended in EOS
    depth_reached: int  # deepest draft position that was tested (a node there was accepted or rejected)


def children_of(parents: torch.Tensor) -> list[list[int]]:
    """children[0] are the root's children, children[1 + i] node i's, each in proposal order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for node, parent in enumerate(parents.tolist()):
        children[parent + 1].append(node)
    return children


def verify(
    draft: DraftTree,
    target_probs: torch.Tensor,
    generator: torch.Generator,
    eos_ids: frozenset[int] = frozenset(),
) -> Verdict:
    """Choose the accepted path and the bonus token.

    `target_probs[0]` is the target's distribution after the root, `target_probs[1 + i]` after node i.
    From the root, try the children in order: accepting one moves down to it, rejecting one replaces
    p by `exact_rule`'s residual before the next sibling; when no child is left the bonus is drawn from
    the current p. This is recursive rejection sampling (SpecInfer; EAGLE's tree sampling): each try
    is a standard speculative-sampling step w.r.t. the current p, whose output is distributed exactly
    as p, so by induction over the siblings the emitted token at every depth follows the target.
    It holds for deterministic children (q one-hot) and for children drawn independently from their
    q. With one-hot q a sibling repeating a rejected token meets p = 0 there and is rejected without
    changing p, so duplicates need no special case (a duplicate of an accepted token is never tried).
    Greedy is the same walk with p one-hot on the argmax: it accepts the child equal to the argmax
    (unique among distinct siblings), which gives the longest matching path.
    """
    vocab = target_probs.shape[-1]
    children = children_of(draft.parents)
    path: list[int] = []
    node, p = -1, target_probs[0]  # start at the root
    while True:
        for child in children[node + 1]:
            q = draft.probs[child].to(p) if draft.probs is not None else F.one_hot(draft.tokens[child], vocab).to(p)
            u = torch.rand((), generator=generator, device=generator.device)
            accepted, p = exact_rule(p, q, int(draft.tokens[child]), u.to(p.device))
            if accepted:
                break
        else:  # every child rejected, or a leaf: the bonus comes from what is left of p
            depth_reached = len(path) + (1 if children[node + 1] else 0)
            break
        path.append(child)
        node, p = child, target_probs[1 + child]
        if int(draft.tokens[child]) in eos_ids:  # nothing after an EOS is emitted
            return Verdict(path, None, len(path))
    bonus = int(torch.multinomial(p.to(generator.device), 1, generator=generator))
    return Verdict(path, bonus, depth_reached)
