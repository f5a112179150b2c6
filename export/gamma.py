"""The γ an export recommends, from what the checkpoint's eval report measured.

The report's greedy chain row over all domains gives the conditional acceptance per draft position
a_k, so a chain of γ is expected to emit E(γ) = 1 + sum_{k<=γ} prod_{i<=k} a_i tokens per cycle. A
cycle costs one target forward plus the drafter's forwards: d(γ) = γ of them for a drafter that drafts
one token per forward (EAGLE, a draft model), one for a drafter that proposes the whole chain at once
(Medusa, DFlash), read off the report's draft_forwards_per_cycle. Their cost c relative to a target
forward comes from the same report: the chain's extra wall time per cycle over plain decoding's, per
draft forward (so it also carries the wider verify forward). The recommendation is the γ in 1..(the
report's γ) with the most tokens per unit of cost, E(γ) / (1 + c·d(γ)) (below 1 at every γ: the loop decodes faster
without the drafter, which the card says); longer chains were not
measured, so they are not recommended. Every engine verifies the same chain, so the choice is the same
for each engine that serves the drafter's chains (`chain_engines`: an MTP drafter's is vLLM alone); the
costs are draftsmith's loop's on the eval's device, which an engine changes
(benchmarks/standard_protocol.py chooses γ by tokens/s inside vLLM instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from draftsmith.formats import Source, refusals


def chain_engines(source: Source) -> list[str]:
    """The engines that serve this drafter's chains for this target: those its kind names for chains
    (Drafter.SERVED_BY) whose export does not refuse it (formats.Exporter.refuse), as the eval's report says."""
    chains = refusals(source.drafter, source.target, source.vllm_format).get("chain", {})
    return [engine for engine, why in chains.items() if why is None]


def recommended_gamma(report: Optional[dict[str, Any]], engines: Sequence[str]) -> Optional[dict[str, Any]]:
    """The recommendation for each of `engines` and what it rests on, or None without a greedy chain row to read."""
    if not report or report.get("temperature", 1) > 0 or "chain" not in report.get("domains", {}).get("all", {}):
        return None
    chain, plain = report["domains"]["all"]["chain"], report["baselines"]["all"]["plain"]
    measured = int(report["methods"]["chain"]["gamma"])
    per_position = chain["per_position"]
    if not chain["target_forwards"] or not plain["target_forwards"] or not chain["draft_forwards_per_cycle"]:
        return None
    reach, expected = 1.0, [1.0]  # expected[γ] = E(γ)
    for rate in per_position[:measured]:
        reach *= rate or 0.0
        expected.append(expected[-1] + reach)
    per_cycle_forwards = chain["draft_forwards_per_cycle"]
    sequential = per_cycle_forwards > 1.5  # about γ draft forwards per cycle, not one

    def draft_forwards(gamma: int) -> float:
        return per_cycle_forwards * gamma / measured if sequential else per_cycle_forwards

    target_s = plain["wall_s"] / plain["target_forwards"]
    extra_s = chain["wall_s"] / chain["target_forwards"] - target_s
    cost = max(0.0, extra_s / (per_cycle_forwards * target_s))
    value = {gamma: expected[gamma] / (1 + cost * draft_forwards(gamma)) for gamma in range(1, len(expected))}
    best = max(value, key=value.get)
    return {
        **dict.fromkeys(engines, best),
        "tokens_per_cycle": {str(g): round(expected[g], 4) for g in value},
        "draft_forward_cost": round(cost, 4),
        "expected_speedup": round(value[best], 4),  # the best γ's tokens per unit of cost: below 1, slower than plain
        "draft_forwards_per_cycle": "γ" if sequential else round(per_cycle_forwards, 4),
        "rule": "argmax over γ <= the measured γ of E(γ) / (1 + cost·draft forwards); costs from draftsmith's eval on "
        + str(report.get("device")),
    }
