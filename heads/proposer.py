"""The decoding contract: what the eval loop (eval/loop.py) hands a drafter's `Proposer` each decode cycle
(`DraftState`), what it asks for (a chain or a `Tree`) and what it gets back (`DraftTree`). Apart from the
training side (heads/base.py) because the eval and the proposers that are no drafter (n-gram, suffix) need only this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Optional, Union

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.target import FeatureRequest


@dataclass
class DraftState:
    """What the decode loop knows when it asks for a proposal.

    `tokens` are all committed tokens; the last one (the root) came from the target's own
    distribution and is verified by construction. `final`/`layers` are the target's hidden states
    at the position *before* the root, i.e. the position whose logits produced the root.

    Drafters with their own KV cache over the sequence (EAGLE) also need the target's hidden states
    at every committed position they have not seen yet: `new_final` / `new_layers` hold them for the
    last m positions before the root (positions len(tokens)-1-m .. len(tokens)-2; the last row is
    `final`), i.e. everything committed since this sequence's previous proposal, the whole prompt but
    its last token at the first one. `fresh` marks that first proposal of a new sequence: state kept
    from an earlier sequence must be dropped. A drafter that reads only `final` ignores all three.
    """

    tokens: torch.Tensor  # [n] long
    final: torch.Tensor  # [H]
    layers: dict[int, torch.Tensor]
    new_final: Optional[torch.Tensor] = None  # [m, H]
    new_layers: dict[int, torch.Tensor] = field(default_factory=dict)  # layer id -> [m, H]
    fresh: bool = True
    new_streams: Optional[torch.Tensor] = None  # [m, S, H]: the same positions' last-layer streams (FeatureRequest)


@dataclass(frozen=True)
class DynamicTree:
    """A tree that the drafter grows per step from its own scores (EAGLE-2), as opposed to a static
    tree given as paths: up to `nodes` nodes, at most `depth` deep, expanding `topk` children of the
    `topk` best nodes per step. `default_tree` returns one from drafters that draft this way."""

    nodes: int
    depth: int
    topk: int

    def cut(self, max_depth: int) -> DynamicTree:
        return replace(self, depth=min(self.depth, max_depth))


# A tree request: a static tree as paths of per-depth candidate ranks (parents first), or a DynamicTree.
Tree = Union[Sequence[tuple[int, ...]], DynamicTree]


@dataclass
class DraftTree:
    """A proposal: node i holds `tokens[i]` and hangs below `parents[i]` (-1 = the root token).

    A chain is the tree with parents [-1, 0, 1, ...]. Parents always precede their children.
    `probs[i]` is the draft distribution node i's token was sampled from; None means the drafter
    is deterministic (q is one-hot on the proposed token), which the exact sampling rule relies on.
    """

    tokens: torch.Tensor  # [N] long
    parents: torch.Tensor  # [N] long
    probs: Optional[torch.Tensor] = None  # [N, V] float

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: Optional[torch.Tensor] = None) -> DraftTree:
        parents = torch.arange(-1, len(tokens) - 1, device=tokens.device)
        return cls(tokens=tokens, parents=parents, probs=probs)

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass(frozen=True)
class StepCosts:
    """One request's step costs as an engine that weighs them holds them (vLLM's adaptive verification's cost
    tables): its draft step, and the verify forward by target tokens, `verify_ms[n - 1]` for n tokens (1 .. γ+1),
    non-decreasing."""

    draft_ms: float
    verify_ms: tuple[float, ...]


class Proposer:
    """The decoding side of a drafter: one sequence's drafting state.

    `features` is what it reads from the target at decode time; `verifier`, when not None, is the
    model that must verify its proposals instead of the target (Medusa-2's adapted target)."""

    features: FeatureRequest = FeatureRequest()
    verifier: Optional[nn.Module] = None
    # Forward passes of the draft model so far (a chain of k from an autoregressive drafter costs k;
    # Medusa's heads and DFlash's block cost 1 per proposal): what a proposal costs besides tau.
    draft_forwards: int = 0
    # True where the engine verifies only the drafts its step costs pay for (DSpark's adaptive verification): the
    # eval profiles them (eval/step_costs.py) into `step_costs`, and the proposer cuts its proposals by them
    cut_by_step_costs: bool = False
    step_costs: Optional[StepCosts] = None

    def start(self, seed: int) -> None:
        """A new sequence begins, its row seeded with `seed`: a proposer that samples its drafts seeds its
        own stream from it (`draft_stream`), so a prompt draws the same whatever batch it decodes in."""

    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        """A chain of `num_tokens` tokens, or (if the drafter supports it) a tree: the `tree` that
        `default_tree` returned, possibly cut to a smaller depth by the decode loop. A proposer may
        propose fewer tokens than asked, or none (the loop then runs a plain step)."""
        raise NotImplementedError

    def default_tree(self, size: int) -> Tree:
        """The drafter's tree of about `size` nodes (eval.tree): static paths or a DynamicTree."""
        raise UserError("this drafter proposes chains only; set eval.tree=0")


def draft_stream(seed: int, device: torch.device) -> torch.Generator:
    """A sampling proposer's own random stream for the sequence seeded `seed` (`Proposer.start`). The loop
    draws that row's acceptance tests from a stream seeded `seed` too (eval/loop.py): a proposer seeded
    alike would draw the same numbers, its proposals tied to the draws that test them, and the output would
    stop following the target (tests/test_dflash.py's chi-square failed at p = 6e-25 so). So the seed is
    mixed into another 32-bit value (torch's CPU generator keeps 32 bits of a seed), far from the loop's
    seeds, which count up from eval.seed."""
    return torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + 0x632BE5AB) % 2**32)
