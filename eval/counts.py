"""What decoding counts: a prompt's (or many prompts') tokens, forwards, drafted and accepted positions and
wall time, and one prompt's result. Apart from eval/loop.py, which fills them, because the reports and the
export's check sum and read them without running the loop."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy

from draftsmith.eval.sampling import Verdict


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]


@dataclass
class Counts:
    """Decoding counters, of one prompt or summed over many.

    `drafted` counts draft positions (the proposal's depth: a chain's length, a tree's longest path),
    not tree nodes, so alpha = accepted/drafted compares chains and trees. `reached[d]` /
    `accepted_at[d]` count the cycles that tested / accepted a node at draft position d+1.
    `mismatched` counts prompts whose greedy output differed from plain decoding's (set by the report);
    `near_ties`, those of a target computing in fewer bits than float32 whose output parted from plain
    decoding's where the two tokens' logits were within its rounding (eval/partings.py): not mismatched.
    `per_batch` keeps each summed batch's (new tokens, wall seconds), in the order added: the prompts timed
    together (`of_batch`; a prompt decoded alone is a batch of one), since a batch's rows share one wall
    clock (generate_batch charges each an equal share) and so no row's timing is its own. Every method
    decodes the same batches in the same order (eval/report.py, decode_all), so two methods' lists pair
    batch by batch (`speedup_interval`).
    """

    prompts: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # decode forwards; the prefill is not counted
    draft_forwards: int = 0  # the drafter's forward passes (Proposer.draft_forwards)
    drafted: int = 0
    accepted: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    wall_s: float = 0.0  # prefill included
    mismatched: int = 0
    near_ties: int = 0
    per_batch: list[tuple[int, float]] = field(default_factory=list)

    def count_cycle(self, depth: int, new_tokens: int, verdict: Verdict) -> None:
        self.target_forwards += 1
        self.new_tokens += new_tokens
        self.drafted += depth
        self.accepted += len(verdict.path)
        grow = max(0, verdict.depth_reached - len(self.reached))
        self.reached += [0] * grow
        self.accepted_at += [0] * grow
        for d in range(verdict.depth_reached):
            self.reached[d] += 1
            self.accepted_at[d] += int(d < len(verdict.path))

    def add(self, other: Counts) -> None:
        for name in (
            "prompts",
            "new_tokens",
            "target_forwards",
            "draft_forwards",
            "drafted",
            "accepted",
            "wall_s",
            "mismatched",
            "near_ties",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.reached = _add_lists(self.reached, other.reached)
        self.accepted_at = _add_lists(self.accepted_at, other.accepted_at)
        if other.per_batch:
            self.per_batch += other.per_batch
        elif other.prompts == 1:  # one prompt's counts: a batch of one
            self.per_batch.append((other.new_tokens, other.wall_s))

    @classmethod
    def of_batch(cls, rows: Sequence[Counts]) -> Counts:
        """The rows of one batch (generate_batch's, decoded and timed together) summed, as one timed batch."""
        total = cls()
        for row in rows:
            total.add(row)
        total.per_batch = [(total.new_tokens, total.wall_s)]
        return total

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0


# The fewest timed batches an interval is given for. The bootstrap's draws are the multisets of the batches:
# 3 distinct ones from 2 batches, 10 from 3, 35 from 4, so its percentiles are a few speed-ups that read as a
# precise interval (2 batches gave "2.54× (2.27–3.60)" to a chain that drafted nothing); 5 give 126.
MIN_TIMED_BATCHES = 5
RESAMPLES = 2000  # the bootstrap's draws of the timed batches


def speedup_interval(counts: Counts, plain: Counts) -> Optional[list[float]]:
    """A 95% interval of `counts`' speed-up over `plain`: a paired bootstrap over the timed batches (the
    prompts, at batch size 1; each resample draws batches with replacement and takes both methods' tokens/s
    over the same draw), so a speed-up that a few batches' timings carry shows a wide interval. Seeded: the
    same counts give the same interval. None with fewer than MIN_TIMED_BATCHES batches or unpaired lists.
    The spread is the batches'; what a whole run shares (another job on the cores, a cold cache) moves both
    methods and is not in it."""
    mine, theirs = numpy.array(counts.per_batch), numpy.array(plain.per_batch)
    if len(mine) < MIN_TIMED_BATCHES or mine.shape != theirs.shape:
        return None
    draws = numpy.random.default_rng(0).integers(0, len(mine), size=(RESAMPLES, len(mine)))
    with numpy.errstate(divide="ignore", invalid="ignore"):
        rate = mine[draws, 0].sum(1) / mine[draws, 1].sum(1)
        plain_rate = theirs[draws, 0].sum(1) / theirs[draws, 1].sum(1)
        ratios = rate / plain_rate
    ratios = ratios[numpy.isfinite(ratios)]
    if len(ratios) < RESAMPLES // 2:  # walls of zero: no timing to speak of
        return None
    low, high = numpy.percentile(ratios, [2.5, 97.5])
    return [round(float(low), 4), round(float(high), 4)]


@dataclass
class Generation:
    """One prompt's new tokens and its counters."""

    tokens: list[int] = field(default_factory=list)
    counts: Counts = field(default_factory=lambda: Counts(prompts=1))


def report_row(counts: Counts, plain: Counts, greedy: bool, positions: int) -> dict[str, Any]:
    """A report row. `positions`: the method's draft depth; per-position lists always have that length."""
    reached = (counts.reached + [0] * positions)[:positions]
    accepted_at = (counts.accepted_at + [0] * positions)[:positions]
    return {
        "prompts": counts.prompts,
        "new_tokens": counts.new_tokens,
        "target_forwards": counts.target_forwards,
        "drafted": counts.drafted,
        "accepted": counts.accepted,
        "alpha": ratio(counts.accepted, counts.drafted),
        "tau": ratio(counts.new_tokens, counts.target_forwards),
        "draft_forwards_per_cycle": ratio(counts.draft_forwards, counts.target_forwards),
        "per_position": [ratio(a, r) for a, r in zip(accepted_at, reached)],
        "per_position_counts": {"reached": reached, "accepted": accepted_at},
        "tokens_per_s": round(counts.tokens_per_s, 3),
        "wall_s": round(counts.wall_s, 4),
        "speedup": ratio(counts.tokens_per_s, plain.tokens_per_s),
        "speedup_interval": speedup_interval(counts, plain),
        "lossless": (counts.mismatched == 0) if greedy else None,
        "near_ties": counts.near_ties if greedy else None,
    }


def ratio(num: float, den: float) -> Optional[float]:
    return round(num / den, 4) if den else None


def summed(per_domain: dict[str, dict[str, Counts]]) -> dict[str, Counts]:
    """Counters of every domain added up, per method: the `all` row."""
    total: dict[str, Counts] = {}
    for per_method in per_domain.values():
        for name, counts in per_method.items():
            total.setdefault(name, Counts()).add(counts)
    return total
