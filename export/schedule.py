"""A γ per batch size for vLLM (`num_speculative_tokens_per_batch_size`), from a load sweep.

Speculation pays while the target's step is memory-bound: at batch size 1 a verify forward of γ + 1
tokens costs about what a plain step does, at large batch sizes it costs up to γ + 1 times as much.
A load sweep (`draftsmith sweep`, export/sweep.py) serves the target in vLLM at several concurrencies,
plain and with this drafter at each γ, and writes a JSONL row per (method, γ, concurrency) with the
wall time, engine steps, decoded tokens and the engine's acceptance counters. From it, per concurrency c:

- the step cost s(c, γ): the run's wall time per request and engine step (steps x the mean requests
  per step), which does not depend on how much that run's drafts happened to be accepted;
- the drafter's acceptance, pooled over every run of this drafter (it depends on the text, not on the
  batch): P(accepted >= k) = accepted at position k / drafts, over runs with γ >= k, and the share d
  of request-steps that drafted at all (1 for a drafter model; less for n-gram lookup, which drafts
  only where it finds a match), so a chain of γ gains E(γ) = 1 + d · sum_{k <= γ} P(accepted >= k)
  tokens per request and step;
- the predicted throughput per request, E(γ) / s(c, γ), against plain's 1 / s(c, 0).

K(c) is the γ with the highest prediction, or 0 (no speculation) unless it beats K = 0 by the margin:
MIN_GAIN (2%), or the sweep's own noise where that is larger. A sweep that measured plain twice (rows
`plain-rerun`) shows how far two runs of one setting differ on its machine; a predicted gain smaller
than that is not a gain, and a schedule built on it would chase the noise.
K = 0 in a schedule is not plain decoding: vLLM 0.32 keeps an EAGLE-style drafter's forward running at
K = 0 (to keep its KV cache in step) and only returns no drafts. Where the sweep measured this drafter
with a schedule of K = 0 everywhere (its rows of γ 0), that cost is K = 0's prediction; otherwise
plain's. Served at all, the drafter must beat plain decoding (without it) by
the margin somewhere, or the export is refused; the concurrencies where even the best K is predicted
more than the margin below plain are named (`below_plain_at`): at that load, serve the target alone; and since
a loaded drafter's cost at γ 0 can keep the schedule below plain by less than a noisy margin, the concurrencies
predicted below plain at all (`predicted_below_plain_at`) and the load up to which it is predicted at least
plain at every measured concurrency (`pays_up_to`) are named too: above that, serve the target without it.
Against thrash at a range edge (vLLM keys the lookup on the requests scheduled in a step, prefills
included, so a batch near an edge alternates between two K; vLLM issue #49548), K changes between
neighbouring measured concurrencies only where the new K gains the margin over keeping the previous
one, and ranges with the same K are merged. Batch sizes between two measured concurrencies take the
nearer one's K (geometric midpoint); past the largest measured one vLLM carries the last K forward.
vLLM ignores the schedule under data parallelism (it warns and drafts the full γ on every rank).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.errors import UserError
from draftsmith.export.sweep_results import PLAIN, PLAIN_AGAIN, at_one_gamma, read_sweep, rerun_noise

log = logging.getLogger("draftsmith.export")

MIN_GAIN = 0.02  # the margin a predicted gain must clear where the sweep's own noise is smaller


class NoSchedule(UserError):
    """A sweep by whose rows the drafter beats plain decoding at no measured concurrency: the input to fix (serve the
    target alone, or measure again where the margin was the sweep's noise), exit 2. It was exit 3, a correctness
    check's code, which says to report it and not retry."""


def pooled_acceptance(runs: list[dict[str, Any]]) -> list[float]:
    """P(accepted >= k) for k = 1.. the longest γ measured, over every run of one drafter."""
    longest = max(int(row["gamma"]) for row in runs)
    rates = []
    for position in range(longest):
        drafts = sum(row["drafts"] for row in runs if int(row["gamma"]) > position)
        accepted = sum(row["accepted_per_position"][position] for row in runs if int(row["gamma"]) > position)
        rates.append(accepted / drafts if drafts else 0.0)
    return rates


def predicted_rates(rows: list[dict[str, Any]], method: str, acceptance: list[float]) -> dict[int, dict[int, float]]:
    """concurrency -> γ -> predicted tokens/s of the whole batch: E(γ) tokens per request and step over
    the measured seconds per request and step (steps x the mean requests per step). γ 0 is this
    drafter's own γ-0 row where the sweep has one (the drafter loaded, drafting nowhere), else plain's."""
    plain = {int(r["concurrency"]): r for r in rows if r["method"] == PLAIN}
    mine = [r for r in rows if r["method"] == method]
    drafting = [r for r in mine if int(r["gamma"]) > 0]
    # A proposer may skip steps (n-gram lookup drafts only where it finds a match): the share of
    # request-steps that drafted scales what the accepted tokens add, pooled like the acceptance.
    drafted = sum(r["drafts"] for r in drafting) / max(1.0, sum(r["steps"] * r["mean_batch"] for r in drafting))
    expected = [1.0]
    for rate in acceptance:
        expected.append(expected[-1] + min(1.0, drafted) * rate)
    rates = {concurrency: {0: row["tokens"] / row["seconds"]} for concurrency, row in plain.items()}
    for row in mine:
        concurrency, gamma = int(row["concurrency"]), int(row["gamma"])
        if concurrency in rates and row["steps"] and row["mean_batch"]:
            rates[concurrency][gamma] = expected[gamma] * row["steps"] * row["mean_batch"] / row["seconds"]
    return rates


def sweep_noise(rows: list[dict[str, Any]]) -> float | None:
    """How far the sweep's second plain run strays from its first, at worst over the concurrencies both
    measured (|tok/s ratio - 1|); None without a second run."""
    first = {int(r["concurrency"]): r["tokens"] / r["seconds"] for r in rows if r["method"] == PLAIN}
    again = {int(r["concurrency"]): r["tokens"] / r["seconds"] for r in rows if r["method"] == PLAIN_AGAIN}
    return rerun_noise(first, again)


def batch_schedule(rows: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """The schedule, the choice at each measured concurrency and what it rests on."""
    plain, mine = [r for r in rows if r["method"] == PLAIN], [r for r in rows if r["method"] == method]
    if not plain or not any(int(r["gamma"]) > 0 for r in mine):
        raise UserError(f"the load sweep has no {'plain' if not plain else repr(method)} rows")
    noise = sweep_noise(rows)
    margin = max(MIN_GAIN, noise or 0.0)
    acceptance = pooled_acceptance(mine)
    rates = predicted_rates(rows, method, acceptance)
    plain_rate = {int(r["concurrency"]): r["tokens"] / r["seconds"] for r in plain}
    levels = sorted(rates)
    chosen: dict[int, int] = {}
    previous = None
    for concurrency in levels:
        options = rates[concurrency]
        best = max(options, key=options.get)
        if best and options[best] < options[0] * (1 + margin):
            best = 0
        if previous is not None and previous in options and previous != best:
            if options[best] < options[previous] * (1 + margin):
                best = previous  # not worth an edge
        chosen[concurrency] = previous = best
    if not any(rates[c][chosen[c]] >= plain_rate[c] * (1 + margin) for c in levels if chosen[c]):
        summary = ", ".join(f"c={c}: {max(rates[c].values()) / plain_rate[c]:.2f}×" for c in levels)
        noisy = margin > MIN_GAIN
        raise NoSchedule(
            f"at no measured concurrency does speculation with this drafter beat plain decoding by {margin:.0%}"
            + (" (how far the sweep's two plain runs differ)" if noisy else "")
            + f": best predicted speed-up {summary}; serve the target without it"
            + (
                ", or measure again on a quieter machine or with more requests a level (export.sweep.min_requests)"
                if noisy
                else ""
            )
        )
    ranges: list[list[int]] = []
    for index, concurrency in enumerate(levels):
        start = 1 if index == 0 else math.floor(math.sqrt(levels[index - 1] * concurrency)) + 1
        end = levels[-1] if index == len(levels) - 1 else math.floor(math.sqrt(concurrency * levels[index + 1]))
        if end < start:
            continue
        if ranges and ranges[-1][2] == chosen[concurrency]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, chosen[concurrency]])
    measured = {(r["method"], int(r["gamma"]), int(r["concurrency"])): r for r in rows}
    over_plain = {c: rates[c][chosen[c]] / plain_rate[c] for c in levels}
    below_plain = [c for c in levels if over_plain[c] < 1]
    return {
        "num_speculative_tokens": max(chosen.values()),
        "num_speculative_tokens_per_batch_size": ranges,
        "per_concurrency": {
            str(c): {
                "chosen": chosen[c],
                "predicted_tok_s": {str(g): round(v, 2) for g, v in sorted(rates[c].items())},
                "predicted_vs_plain": round(over_plain[c], 4),
                **measured_pair(measured.get((method, chosen[c], c)), measured[PLAIN, 0, c]),
            }
            for c in levels
        },
        "gamma_0_measured": sorted(c for (m, g, c) in measured if m == method and g == 0),
        "below_plain_at": [c for c in levels if over_plain[c] < 1 - margin],
        # Without the margin: where the prediction is below plain at all, and the load up to which it is
        # at least plain everywhere (None: not even at the lowest); above it, serve the target alone.
        "predicted_below_plain_at": below_plain,
        "pays_up_to": max((c for c in levels if not below_plain or c < below_plain[0]), default=None),
        "min_gain": MIN_GAIN,
        "noise": None if noise is None else round(noise, 4),
        "margin": round(margin, 4),
        "acceptance": [round(r, 4) for r in acceptance],
    }


def pays_again_above(schedule: dict[str, Any]) -> list[int]:
    """The measured concurrencies above the first one predicted below plain that are predicted at or above plain
    again: levels that do not fall with the load, as a drafter's cost does, are the sweep's noise more than the
    drafter's (too few requests a level), so `pays_up_to` says nothing of the loads above it."""
    slower = schedule["predicted_below_plain_at"]
    return [int(c) for c in schedule["per_concurrency"] if slower and int(c) > slower[0] and int(c) not in slower]


def pays_line(schedule: dict[str, Any]) -> str:
    """Up to which load the drafter pays (the card's and the export's line), or that the sweep cannot tell."""
    if again := pays_again_above(schedule):
        return (
            f"at or above plain again at concurrency {', '.join(map(str, again))}: the levels do not fall with the "
            "load, as a drafter's cost does, so the timings' noise decides them; measure again with more requests a "
            "level (export.sweep.min_requests, export.sweep.requests_per_slot) before serving it "
            + (f"above concurrency {schedule['pays_up_to']}" if schedule["pays_up_to"] else "at all")
        )
    if schedule["pays_up_to"] is None:
        return "it does not pay at the lowest measured concurrency; serve the target without it"
    return (
        f"it pays at every measured concurrency up to {schedule['pays_up_to']}; with more requests in flight, serve "
        "the target without it"
    )


def measured_pair(run: dict[str, Any] | None, plain: dict[str, Any]) -> dict[str, Any]:
    """τ and speed-up over plain as the sweep measured them at the chosen γ (γ 0 with the drafter
    loaded where the sweep has that row; none measured: plain's)."""
    if run is None:
        return {"tau": None, "speedup": 1.0}
    drafts = run["drafts"]
    tau = 1 + sum(run["accepted_per_position"]) / drafts if drafts else None
    speedup = (run["tokens"] / run["seconds"]) / (plain["tokens"] / plain["seconds"])
    return {"tau": None if tau is None else round(tau, 4), "speedup": round(speedup, 4)}


def batch_schedule_of(cfg: DictConfig, digest: str, serving=None) -> Optional[dict[str, Any]]:
    """The γ per batch size that export.batch_sweep's measurement of this checkpoint's export gives
    (`batch_schedule`), with what it rests on; None without a sweep. Its rows served the drafter with the SERVED
    settings `serving` where given."""
    if not cfg.export.batch_sweep:
        return None
    from draftsmith.export.sweep import NO_SCHEDULE
    from draftsmith.formats import exporter_for
    from draftsmith.formats.folder import require_same_serving

    path = Path(cfg.export.batch_sweep).resolve()
    if path.is_dir():
        raise UserError(
            f"export.batch_sweep={cfg.export.batch_sweep} is a directory: give the sweep's JSONL file in it"
        )
    exporter = exporter_for(cfg.drafter.type)
    if not exporter.vllm_takes_schedule:
        reason = NO_SCHEDULE.format(method=exporter.vllm_method)
        raise UserError(f"export.batch_sweep={cfg.export.batch_sweep}: {reason}")
    rows = read_sweep(path)
    if not rows:
        raise UserError(
            f"export.batch_sweep={cfg.export.batch_sweep} holds no rows: sweep the checkpoint (draftsmith sweep)"
        )
    rows = [row for row in rows if at_one_gamma(row)]  # a served schedule's rows are left out
    methods = sorted({row["method"] for row in rows if row.get("source_sha256") == digest})
    if len(methods) != 1:
        found = f"measures it as {', '.join(methods)}" if methods else "measured no export of it"
        raise UserError(
            f"export.batch_sweep={cfg.export.batch_sweep}: the sweep {found} (checkpoint sha256 {digest[:12]}); "
            "sweep this checkpoint (draftsmith sweep)"
        )
    measured = [row for row in rows if row["method"] in (PLAIN, PLAIN_AGAIN) or row.get("source_sha256") == digest]
    for row in measured if serving is not None else []:
        advice = "sweep the checkpoint with those (draftsmith sweep)"
        require_same_serving(row.get("load", {}).get("drafter") or {}, serving, f"export.batch_sweep={path}", advice)
    try:
        schedule = batch_schedule(measured, methods[0])
    except NoSchedule as refused:
        raise NoSchedule(f"export.batch_sweep={cfg.export.batch_sweep}: {refused}") from None
    require_schedule_served(cfg, schedule["num_speculative_tokens_per_batch_size"])
    engines = {json.dumps(row.get("engine"), sort_keys=True) for row in measured}
    log.info(
        "γ per batch size from %s (%s): %s; vLLM ignores it under data parallelism (--data-parallel-size > 1)",
        path, methods[0], schedule["num_speculative_tokens_per_batch_size"],
    )  # fmt: skip
    if schedule["predicted_below_plain_at"]:  # below_plain_at (beyond the margin) is a subset of it
        log.warning(
            "predicted below plain decoding at concurrency %s "
            "(beyond the margin at %s; the drafter's cost at γ 0%s): %s",
            ", ".join(map(str, schedule["predicted_below_plain_at"])),
            ", ".join(map(str, schedule["below_plain_at"])) or "none",
            " was measured" if schedule["gamma_0_measured"] else " was not measured: sweep it, draftsmith sweep",
            pays_line(schedule),
        )
    return {**schedule, "sweep": str(path), "method": methods[0], "engine": [json.loads(e) for e in sorted(engines)]}


def require_schedule_served(cfg: DictConfig, per_batch_size: list[list[int]]) -> None:
    """A schedule that drafts fewer than its largest γ at some batch size, for a target whose export check's vLLM
    verifies only steps of γ + 1 tokens (formats/versions.py `varied_drafts_limit`: the CPU build's linear-attention
    verify): refused before the target loads, where the check's scheduled run would stop the engine or part its
    output."""
    from draftsmith.formats.versions import varied_drafts_limit
    from draftsmith.target_loading import load_config

    gammas = [gamma for *_, gamma in per_batch_size]
    if not cfg.export.vllm_python or "vllm" not in cfg.export.engines or min(gammas) == max(gammas):
        return
    reason = varied_drafts_limit(load_config(cfg.target), cfg.export.vllm_python)  # as the sweep reads it
    if reason:
        raise UserError(
            f"export.batch_sweep={cfg.export.batch_sweep}: its schedule drafts {min(gammas)} to {max(gammas)} tokens "
            f"by batch size, and {reason}; export without export.batch_sweep, or check the export with a GPU build"
        )
