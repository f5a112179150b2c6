"""The step costs an engine weighs where it verifies only the drafts they pay for (`Proposer.cut_by_step_costs`:
vLLM's adaptive verification of DSpark, heads/dspark_proposer.py), profiled on the eval's device as vLLM profiles
them on its own at start-up (AdaptiveVerificationManager.batches_to_profile and set_initial_cost_curves,
vllm/v1/worker/gpu/spec_decode/adaptive_verification.py): each size run 5 times (`_PROFILE_REPLAYS`) over a pretend
context, the median kept, the verify curve made non-decreasing. For one request: its draft step (the drafter
catching up one committed token, then its block and Markov sampling) and the target's verify forward of 1 .. γ+1
tokens. vLLM's context is VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN (8192); the eval's about data.max_length,
the conversations it was given. The costs are this device's: the verified length the report gives is the one vLLM
would choose where steps cost what they cost here."""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import replace
from typing import Any, Callable

import numpy
import torch

from draftsmith.eval.loop import prefill
from draftsmith.heads.proposer import Proposer, StepCosts
from draftsmith.target import run_target

REPLAYS = 5  # vLLM's _PROFILE_REPLAYS


def _median_ms(run: Callable[[Any], object], device: torch.device, given: Callable[[], Any] = lambda: None) -> float:
    """The median time of `run(given())`, `given` (a fresh input) left out of it, after one untimed run (vLLM's
    profile runs after its warm-up and graph capture). On CUDA the device's queue is drained before the clock starts:
    `given`'s copies (a KV cache's) and the warm-up run asynchronously, and would be timed with the run."""

    def drained() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run(given())
    times = []
    for _ in range(REPLAYS):
        argument = given()
        drained()
        start = time.perf_counter()
        run(argument)
        drained()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def profile_costs(model, proposer: Proposer, gamma: int, context: int) -> StepCosts:
    """One request's step costs at a context of `context` tokens: `proposer` (one without step costs, so drafting
    every token; used up here) drafts γ, and `model` verifies."""
    weight = model.get_output_embeddings().weight
    device, vocab = weight.device, weight.shape[0]
    tokens = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0))
    state = prefill(model, [tokens.tolist()], proposer.features)
    row = state.rows[0]
    proposer.start(0)
    proposer.propose(row.draft_state(), gamma)  # the whole context once; each timed step then catches up one token
    decoding = replace(
        row.draft_state(),
        new_final=row.new_final[-1:],
        new_layers={layer: hidden[-1:] for layer, hidden in row.new_layers.items()},
        new_streams=None if row.new_streams is None else row.new_streams[-1:],
        fresh=False,
    )
    draft_ms = _median_ms(lambda _: proposer.propose(decoding, gamma), device)
    verify_ms = []
    for size in range(1, gamma + 2):
        ids = torch.randint(0, vocab, (1, size), generator=torch.Generator().manual_seed(size)).to(device)
        positions = torch.arange(context - 1, context - 1 + size, device=device)[None]

        def verify(cache, ids=ids, positions=positions):
            run_target(model, ids, None, proposer.features, positions, cache, use_cache=True)

        verify_ms.append(_median_ms(verify, device, lambda: copy.deepcopy(state.cache)))  # each on the context alone
    return StepCosts(round(draft_ms, 4), tuple(round(float(v), 4) for v in numpy.maximum.accumulate(verify_ms)))


def priced(new_proposer: Callable[[], Proposer], model, gamma: int, context: int):
    """`(new_proposer, None)` for proposals no step cost cuts; else a factory of proposers given the step costs
    profiled here (for γ, at a context of `context` tokens, `model` verifying), and the costs."""
    probe = new_proposer()
    if not probe.cut_by_step_costs:
        return new_proposer, None
    costs = profile_costs(model, probe, gamma, context)

    def with_costs() -> Proposer:
        proposer = new_proposer()
        proposer.step_costs = costs
        return proposer

    return with_costs, costs
