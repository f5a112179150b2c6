"""Is acceptance significantly below the baseline?

The baseline is the eval report recorded with the deployed export: overall acceptance α (accepted /
drafted), P(accepted >= k) per draft position, and α per domain. A measured rate drifts when even
its optimistic bound is below the baseline by more than `monitor.max_drop` (relative): the one-sided
Wilson upper bound at `monitor.confidence` < baseline x (1 - max_drop). It is healthy when its
pessimistic bound clears that line, and undecided in between or below `monitor.min_drafts` samples.

The trials are verify steps ("drafts"), not draft tokens: the positions of one draft are not
independent (position k is tested only after k-1 was accepted), so a draft is the unit that is, and
the test is conservative for α. Two drafts of one request are not independent either; the minimum
sample and the confidence absorb that, and the hysteresis (a drift must persist over
`monitor.consecutive` checks) guards the rest.
"""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from statistics import NormalDist
from typing import Any, Optional

from draftsmith.errors import UserError
from draftsmith.monitor.state import iso_seconds

log = logging.getLogger("draftsmith.monitor")

DRIFT, HEALTHY, UNDECIDED, TOO_FEW = "drift", "healthy", "undecided", "too few samples"
# The engine's verdict when it is not the engine the export was checked in (monitor/check.py): its
# acceptance can differ from the baseline for reasons that are not drift, so nothing is judged.
REVERIFY = "reverify"


@dataclass
class Judgement:
    measured: Optional[float]
    baseline: float
    threshold: float  # baseline x (1 - max_drop)
    upper: Optional[float]
    lower: Optional[float]
    trials: float
    verdict: str


def wilson(rate: float, trials: float, z: float) -> tuple[float, float]:
    """The Wilson score interval of a proportion observed over `trials` (z: the normal quantile)."""
    centre = rate + z * z / (2 * trials)
    spread = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials))
    scale = 1 + z * z / trials
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def judge(measured: Optional[float], trials: float, baseline: float, settings) -> Judgement:
    threshold = baseline * (1 - settings.max_drop)
    if measured is None or trials < settings.min_drafts:
        return Judgement(measured, baseline, threshold, None, None, trials, TOO_FEW)
    z = NormalDist().inv_cdf(settings.confidence)
    lower, upper = wilson(min(max(measured, 0.0), 1.0), trials, z)
    verdict = DRIFT if upper < threshold else HEALTHY if lower >= threshold else UNDECIDED
    return Judgement(measured, baseline, threshold, upper, lower, trials, verdict)


def plural(count: float, noun: str) -> str:
    """`count` `noun`s, a single one without the s ("1 logged request")."""
    return f"{count:g} {noun}{'' if count == 1 else 's'}"


@dataclass
class Baseline:
    """What the deployed drafter accepted in its eval (chain rows of the report)."""

    alpha: float
    at_least: list[float]  # P(accepted >= k) per draft
    domains: dict[str, float]  # domain -> α
    temperature: float
    source: str
    weights: Optional[str] = None  # the sha256 of the weights the report measured (draftsmith.formats.folder)
    # each domain's chain counts per eval prompt ("all" too): what the eval would count on another mix of them
    per_prompt: dict[str, dict[str, Any]] = field(default_factory=dict)

    def on_mix(self, requests: dict[str, int]) -> Baseline:
        """The baseline over the traffic's own mix of domains (`requests`: logged requests per domain): each domain's
        counts per eval prompt weighted by its requests, a domain the eval never measured counted as the whole eval.
        Against the eval's own mix, a check after a retraining for new domains found drift on the old domains'
        traffic with every domain at its own baseline: their held-out prompts had raised the overall one."""
        rows = [(count, self.per_prompt.get(domain, self.per_prompt.get("all"))) for domain, count in requests.items()]
        rows = [(count, row) for count, row in rows if count and row]
        drafted, cycles = (sum(count * row[key] for count, row in rows) for key in ("drafted", "cycles"))
        if not drafted or not cycles:
            return self
        at = [sum(count * row["accepted_at"][k] for count, row in rows) / cycles for k in range(len(self.at_least))]
        return replace(self, alpha=sum(count * row["accepted"] for count, row in rows) / drafted, at_least=at)

    @classmethod
    def from_report(cls, report: dict[str, Any], source: str) -> Baseline:
        def alpha(row: dict[str, Any]) -> float:
            if not row.get("drafted"):
                raise UserError(f"the baseline report {source} has no drafted tokens in a chain row")
            if not 0 <= row["accepted"] <= row["drafted"]:  # counts no eval makes: a baseline no check can fall below
                raise UserError(
                    f"the baseline report {source} counts {row['accepted']:g} accepted of {row['drafted']:g} drafted "
                    "tokens in a chain row, which no eval counts: give the report.json the deployed drafter's eval "
                    "wrote"
                )
            return row["accepted"] / row["drafted"]

        if "domains" not in report or "all" not in report["domains"]:
            raise UserError(f"{source} is not a draftsmith eval report (no domains.all)")
        try:
            overall = report["domains"]["all"]["chain"]
            counts = overall["per_position_counts"]
            cycles = counts["reached"][0] if counts["reached"] else 0
            at_least = [accepted / cycles for accepted in counts["accepted"]] if cycles else []
            domains = {
                name: alpha(rows["chain"])
                for name, rows in report["domains"].items()
                if name != "all" and rows["chain"].get("drafted")
            }
            per_prompt = {name: counts_per_prompt(rows["chain"]) for name, rows in report["domains"].items()}
        except (KeyError, TypeError, AttributeError) as err:  # a report of another shape, or an edited one
            raise UserError(
                f"{source} is not a draftsmith eval report with chain rows ({type(err).__name__}: {err}): give the "
                "report.json the deployed drafter's eval wrote"
            ) from None
        if alpha(overall) == 0:  # the threshold is 0 as well: no measured rate falls below it
            raise UserError(
                f"the baseline report {source} measured acceptance 0 (the drafter accepted none of its "
                f"{overall['drafted']:g} drafted tokens): no drift can be seen below it; monitor a drafter that "
                "accepts tokens, evaluated on its traffic (python -m eval)"
            )
        if unjudged := sorted(name for name, rate in domains.items() if rate == 0):
            log.warning(
                "the baseline report %s measured acceptance 0 in domain(s) %s: their own drift cannot be seen, only "
                "the overall acceptance's",
                source,
                ", ".join(unjudged),
            )
        return cls(
            alpha=alpha(overall),
            at_least=at_least,
            domains=domains,
            temperature=report.get("temperature", 0.0),
            source=source,
            weights=(report.get("drafter") or {}).get("sha256"),
            per_prompt={name: counts for name, counts in per_prompt.items() if counts},
        )


def counts_per_prompt(chain: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A chain row's drafted and accepted tokens, verify steps and acceptances at each draft position, per prompt."""
    prompts, counts = chain.get("prompts") or 0, chain.get("per_position_counts") or {}
    if not prompts or not chain.get("drafted") or not counts.get("reached"):  # a report of an earlier draftsmith
        return None
    share = {"drafted": chain["drafted"], "accepted": chain["accepted"], "cycles": counts["reached"][0]}
    return {key: value / prompts for key, value in share.items()} | {
        "accepted_at": [accepted / prompts for accepted in counts["accepted"]]
    }


def judge_on_mix(engine: dict[str, Any], baseline: Baseline, requests: dict[str, int], settings) -> None:
    """The engine's tests (`engine`, its record) judged again against the baseline over the mix of domains the
    request logs hold for its window (`requests`: logged requests per domain since the previous scrape), which they
    record; left as judged where no request was logged in it."""
    if not engine.get("tests") or not any(requests.values()) or not baseline.per_prompt:
        return
    engine["tests"] = engine_tests(engine, baseline.on_mix(requests), settings)
    engine["verdict"], engine["baseline_mix"] = verdict_of(engine["tests"]), dict(requests)


def engine_tests(window: dict[str, Any], baseline: Baseline, settings) -> dict[str, dict[str, Any]]:
    """α and each position's P(accepted >= k), from the engine's counters over the window (its record's figures)."""
    tests = {"alpha": judge(window["alpha"], window["drafts"], baseline.alpha, settings)}
    for position, rate in enumerate(window["at_least"]):
        if position < len(baseline.at_least):
            tests[f"at_least_{position + 1}"] = judge(rate, window["drafts"], baseline.at_least[position], settings)
    return {name: asdict(test) for name, test in tests.items()}


def domain_tests(report: dict[str, Any], baseline: Baseline, settings) -> dict[str, dict[str, Any]]:
    """α per domain of the traffic sample (draftsmith's eval of the deployed drafter on it) against
    that domain's baseline, or the overall baseline for a domain the drafter was never evaluated on."""
    tests = {}
    for domain, rows in report["domains"].items():
        if domain == "all":
            continue
        row = rows["chain"]
        cycles = row["per_position_counts"]["reached"][0] if row["per_position_counts"]["reached"] else 0
        measured = row["accepted"] / row["drafted"] if row["drafted"] else None
        new = domain not in baseline.domains
        test = judge(measured, cycles, baseline.alpha if new else baseline.domains[domain], settings)
        tests[domain] = {
            **asdict(test),
            "new_domain": new,
            "prompts": row["prompts"],
            "tau": row["tau"],
            "source": "replay",
        }
    return tests


def request_tests(per_domain: dict[str, dict[str, Any]], baseline: Baseline, settings) -> dict[str, dict[str, Any]]:
    """α per domain from the engine's per-request counts (monitor/traffic.py `per_request_acceptance`),
    against that domain's baseline or the overall one for a new domain; trials are verify steps."""
    tests = {}
    for domain, counts in per_domain.items():
        measured = counts["accepted"] / counts["draft_tokens"] if counts["draft_tokens"] else None
        new = domain not in baseline.domains
        test = judge(measured, counts["drafts"], baseline.alpha if new else baseline.domains[domain], settings)
        tau = 1 + counts["accepted"] / counts["drafts"]
        tests[domain] = {
            **asdict(test),
            "new_domain": new,
            "requests": counts["requests"],
            "tau": tau,
            "at_least": counts["at_least"],
            "source": "engine per-request",
        }
    return tests


def verdict_of(tests: dict[str, dict[str, Any]]) -> str:
    return combined(test["verdict"] for test in tests.values())


def combined(verdicts: Iterable[str]) -> str:
    """Several verdicts as one: drift if any drifted, healthy if all were, too few samples if none
    had enough, else undecided."""
    verdicts = set(verdicts)
    if DRIFT in verdicts:
        return DRIFT
    if verdicts and verdicts <= {HEALTHY}:
        return HEALTHY
    return TOO_FEW if verdicts <= {TOO_FEW} else UNDECIDED


def new_evidence(record: dict[str, Any], previous_check: Optional[dict[str, Any]]) -> bool:
    """Whether a drift a check found (its `record`) rests on something no earlier check judged: the engine's
    counters (their window starts at the previous scrape) or requests of a drifted domain logged since the previous
    check. The traffic's figures are over monitor.traffic_window_s, so a check soon after another, with no request,
    judges the same requests again: that is not a second check in a row that found drift."""
    if previous_check is None or (record.get("engine") or {}).get("verdict") == DRIFT:
        return True
    previous = datetime.datetime.fromisoformat(previous_check["time"]).timestamp()
    if previous > datetime.datetime.fromisoformat(record["time"]).timestamp():  # a clock moved back: nothing to tell
        return True
    traffic = record.get("traffic") or {}
    newest = traffic.get("newest_request", {})
    drifted = [domain for domain, test in traffic.get("domains", {}).items() if test["verdict"] == DRIFT]
    return any(newest.get(domain, 0.0) > previous for domain in drifted)


def drift_reason(record: dict[str, Any]) -> str:
    """Why a check found drift, for its line and its record: each figure that drifted, the baseline it fell below,
    over how many drafts (verify steps: the test's trials) and since when. A figure drifts when even its one-sided
    upper bound at monitor.confidence is more than monitor.max_drop below the baseline (monitor/drift.py)."""
    settings = record["settings"]
    drop, confidence = f"{settings['max_drop'] * 100:g}%", f"{settings['confidence'] * 100:g}%"

    def figure(name: str, test: dict[str, Any], baseline: str = "baseline") -> str:
        return (
            f"{name} {test['measured']:.3f} (its {confidence} upper bound {test['upper']:.3f}) < {baseline} "
            f"{test['baseline']:.3f} - {drop}"
        )

    parts = []
    engine = record.get("engine") or {}
    if engine.get("verdict") == DRIFT:
        figures = ", ".join(
            figure("α" if name == "alpha" else f"P(accepted ≥ {name.rsplit('_', 1)[1]})", test)
            for name, test in engine["tests"].items()
            if test["verdict"] == DRIFT
        )
        mix = engine.get("baseline_mix")
        over = f", the baseline over the logged requests' domains ({mix_said(mix)})" if mix else ""
        parts.append(
            f"{figures} in the engine's counters over {engine['drafts']:.0f} drafts since {engine['since']}{over}"
        )
    for domain, test in (record.get("traffic") or {}).get("domains", {}).items():
        if test["verdict"] != DRIFT:
            continue
        requests = (
            f"{test['prompts']} replayed requests"
            if test["source"] == "replay"
            else f"{plural(test['requests'], 'logged request')} (the engine's own counts)"
        )
        new = " (a domain new to the drafter)" if test["new_domain"] else ""
        parts.append(
            f"{figure(f'α of {domain}', test, 'the overall baseline' if new else 'its baseline')}{new} over "
            f"{test['trials']:.0f} drafts of {requests} in the last {settings['traffic_window_s']:g} s"
        )
    return "; ".join(parts)


def mix_said(requests: dict[str, int]) -> str:
    """Logged requests per domain, for a line: `code 12, docs 9`."""
    return ", ".join(f"{domain} {count}" for domain, count in sorted(requests.items()))


def measured_summary(record: dict[str, Any]) -> str:
    """What a check that found no drift measured, for its line (exit 0): the engine's α over its window's drafts
    against the baseline, and each traffic domain's verdict over the requests in the window; where too few drafts
    were judged, the minimum they fell short of."""
    settings, parts = record["settings"], []
    engine = record.get("engine") or {}
    if engine.get("alpha") is not None:
        baseline = (engine.get("tests") or {}).get("alpha", {}).get("baseline", record["baseline"]["alpha"])
        mix = (
            f" over the logged requests' domains ({mix_said(engine['baseline_mix'])})"
            if "baseline_mix" in engine
            else ""
        )
        parts.append(
            f"the engine's α {engine['alpha']:.3f} (baseline {baseline:.3f}{mix}) over "
            f"{engine['drafts']:.0f} drafts"
            + (f", fewer than monitor.min_drafts={settings['min_drafts']}" if engine["verdict"] == TOO_FEW else "")
        )
    elif engine.get("note"):
        parts.append(f"the engine: {engine['note']}")
    elif "drafts" in engine:  # a window without a draft (no request served since the last scrape)
        minimum = settings["min_drafts"]
        parts.append(f"the engine: {engine['drafts']:.0f} drafts, fewer than monitor.min_drafts={minimum}")
    traffic = record.get("traffic")
    if traffic is not None:
        verdicts = ", ".join(f"{domain} {test['verdict']}" for domain, test in traffic.get("domains", {}).items())
        since = traffic.get("judged_since")  # the redeploy: the requests before it are not the promoted drafter's
        over = f"since {iso_seconds(since)} (those before, the replaced drafter's, not judged)" if since else ""
        parts.append(
            f"{plural(traffic.get('in_window', 0), 'logged request')} "
            + (over or f"in the last {settings['traffic_window_s']:g} s")
            + (f" ({verdicts})" if verdicts else "")
        )
    return "; ".join(parts)


def free_against_drafter(report: dict[str, Any], judged: bool = True) -> dict[str, Any]:
    """Over the replayed sample, τ (tokens per target forward) of the deployed drafter's chain and of each
    free baseline the replay ran (n-gram lookup, suffix decoding); `faster` names the strongest free one
    where its τ is above the drafter's: it drafts with no forward of its own, so it is then the faster
    method on any engine, and retraining the drafter on this traffic is not what would pay. The note
    says so only where the sample was large enough to judge (`judged`): on a few drafts τ is noise."""
    from draftsmith.eval.render import FREE_BASELINES, FREE_FASTER

    rows = report["baselines"]["all"]
    free = {name: rows[name]["tau"] for name in FREE_BASELINES if name in rows and rows[name]["tau"] is not None}
    drafter = report["domains"]["all"]["chain"]["tau"]
    strongest = max(free, key=free.get, default=None)
    faster = strongest if strongest is not None and drafter is not None and free[strongest] > drafter else None
    return {
        "drafter_tau": drafter,
        "tau": free,
        "faster": faster,
        "not_measured": report.get("not_measured", {}),
        "note": f"{FREE_FASTER}: {FREE_BASELINES[faster]}'s τ {free[faster]:.2f} against the drafter's {drafter:.2f}"
        if faster and judged
        else None,
    }
