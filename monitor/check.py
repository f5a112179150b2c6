"""One check: measure, decide, record, and retrain when the drift is real.

Measured: the engine's counters over the window since the previous check (monitor/metrics.py), and
draftsmith's eval of the deployed drafter on a sample of recent traffic, per domain
(monitor/traffic.py). Decided (monitor/drift.py): drift when either is significantly below the
baseline; the streak must reach `monitor.consecutive` and the cooldown must be over before the
retraining pipeline starts (monitor/pipeline.py). Unless the engine is not the one the export was
checked in (monitor/reverify.py): then the check judges nothing and says how to check the export in the
new engine (Outcome.REVERIFY). Recorded: `<state_dir>/checks/<n>.json` with
everything measured and decided, TensorBoard scalars in `<state_dir>/tb`, and the state file.

The whole check holds `<state_dir>` (DirectoryLock): two checks, or two retrainings, never overlap.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.engines import SERVING_ENGINES
from draftsmith.errors import UserError
from draftsmith.files import write_text_atomic
from draftsmith.formats.folder import require_outside_published
from draftsmith.monitor import Outcome
from draftsmith.monitor.deployed import deployed_of, load_baseline, require_baseline_drafting
from draftsmith.monitor.drift import (
    DRIFT,
    HEALTHY,
    REVERIFY,
    TOO_FEW,
    Baseline,
    combined,
    domain_tests,
    drift_reason,
    engine_tests,
    free_against_drafter,
    judge_on_mix,
    measured_summary,
    new_evidence,
    request_tests,
    verdict_of,
)
from draftsmith.monitor.metrics import collect, engine_version, window
from draftsmith.monitor.redeploy import AWAITING, awaiting_action, note_restarts
from draftsmith.monitor.reverify import engine_change, faulty_sampling, reverify_action
from draftsmith.monitor.state import State, check_record_paths, iso_seconds, set_stateless_checks_aside, write_record
from draftsmith.monitor.traffic import require_traffic_dir, sample, write_conversations
from draftsmith.outputs import EVAL_DIR, REPORT_NAME, DirectoryLock
from draftsmith.recipe import derived

log = logging.getLogger("draftsmith.monitor")


def state_dir_of(cfg: DictConfig) -> Path:
    """Absolute: every path the state records is under it, and a later check may run from another directory."""
    return Path(cfg.monitor.state_dir or Path(cfg.output_dir) / "monitor").absolute()


def check(cfg: DictConfig, now: Optional[float] = None, held: Callable[[Outcome], None] = lambda _: None) -> Outcome:
    """One check; `held(outcome)` runs while the check still holds the state directory (the line it prints, the
    redeploy command a promotion runs: no other check starts before they are done)."""
    require_inputs(cfg.monitor)
    directory = state_dir_of(cfg)
    deployed = Path(cfg.checkpoint) if cfg.checkpoint else None  # inside it, the state was removed by a re-export
    require_outside_published(directory, deployed, "monitor.state_dir", "the monitor knows it by", give="another")
    with DirectoryLock(directory, key="monitor.state_dir"):
        set_stateless_checks_aside(directory)
        state = State.load(directory)
        deployed = deployed_of(cfg, state, directory)
        if state.pipeline is not None and cfg.monitor.retrain:  # a retraining was interrupted: finish it first
            outcome = retrain(cfg, directory, state)
        else:
            if state.pipeline is not None:
                log.info(
                    "the retraining %s in %s is left unfinished (monitor.retrain=false): the next check with "
                    "monitor.retrain=true resumes it",
                    state.pipeline["id"],
                    directory,
                )
            outcome = measure_and_decide(cfg, directory, state, deployed, time.time() if now is None else now)
        held(outcome)
        return outcome


def require_inputs(settings: DictConfig) -> None:
    """What a check reads, refused before the state directory is touched: something to measure, and the
    prompts a retraining regenerates and trains on (monitor.traffic), unless it only reports."""
    if not settings.metrics and not settings.traffic:
        raise UserError(
            "nothing to monitor: set monitor.metrics=[<engine /metrics URLs>] and/or monitor.traffic=<request log "
            "directory>"
        )
    if settings.retrain and not settings.traffic:
        raise UserError(
            "monitor.retrain=true needs monitor.traffic: the retraining reads its prompts from the request logs; set "
            "monitor.traffic=<request log directory>, or monitor.retrain=false to only report drift"
        )
    if settings.traffic:  # a setting to fix: not hidden by a scrape's 69
        require_traffic_dir(Path(settings.traffic))


def summary(cfg: DictConfig, outcome: Outcome) -> str:
    """The one line `python -m monitor` prints for a check: its outcome and why; for a drift (exit 10) the
    figures that drifted and what the check waits for (for an abandoned retraining, the figures of the check that
    started it), for a retraining (exit 11, 12) the gate's τ and, when promoted, what to serve, and for a
    re-verify what to run."""
    state = State.load(state_dir_of(cfg))
    last = state.last_check or {}
    if outcome == Outcome.REVERIFY:
        return f"monitor: {last['action']}"
    # exit 0 is "no drift found": healthy only when everything measured was judged so, else the verdict
    said = last.get("verdict", HEALTHY) if outcome == Outcome.HEALTHY else outcome.name.lower()
    why = []
    if outcome == Outcome.DRIFT and last.get("abandoned"):
        # a check with monitor.retrain=false may have run since the one that started the retraining: its figures
        # and action are not what the retraining answered (none recorded: a retraining from an older draftsmith)
        why.append(state.last_retrain.get("drift"))
    elif outcome == Outcome.DRIFT:
        why.append(last.get("reason"))
        if last.get("action") != "retrain":  # a drift that started a retraining ended with it (the note says how)
            why.append(last.get("action"))
    elif last.get("verdict") == AWAITING:  # a check since the promotion, before the engine serves its drafter
        why.append(last.get("action"))
    elif outcome in (Outcome.REJECTED, Outcome.PROMOTED):
        why.append(state.last_retrain.get("reason"))
    elif outcome == Outcome.HEALTHY and last.get("record") and Path(last["record"]).is_file():
        why.append(measured_summary(json.loads(Path(last["record"]).read_text())))
    said += f": {'; '.join(part for part in why if part)}" if any(why) else ""
    return f"monitor: {said}" + (f" ({last['note']})" if last.get("note") else "")


def measure_and_decide(cfg: DictConfig, directory: Path, state: State, deployed: dict[str, Any], now: float) -> Outcome:
    """One check of the `deployed` drafter: measure (the engine's counters, the traffic sample), decide,
    record, and run the retraining when that is the decision."""
    settings = cfg.monitor
    baseline = load_baseline(deployed)
    require_baseline_drafting(deployed["export"], baseline)
    state.checks += 1
    record: dict[str, Any] = {
        "check": state.checks,
        "time": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
        "deployed": deployed,
        "baseline": asdict(baseline),
        "settings": {
            key: settings[key]
            for key in ("min_drafts", "max_drop", "confidence", "consecutive", "cooldown_s", "traffic_window_s")
        },
    }
    if state.last_check and datetime.datetime.fromisoformat(state.last_check["time"]).timestamp() > now:
        log.warning(
            "the previous check is dated %s, after this machine's clock (%s): a clock moved back, or the state was "
            "written on a machine whose clock ran ahead; the engine's window and the streak read it as given",
            state.last_check["time"],
            record["time"],
        )
    folder, record_path = check_record_paths(directory, state.checks)
    # a check killed before its record was saved left its folder under the number this one takes; nothing reads it
    shutil.rmtree(folder, ignore_errors=True)
    try:
        verdicts, change, waiting, judged = [], None, [], []
        if settings.metrics:
            record["engine"], judged, change = measure_engine(cfg, state, deployed, baseline, now)
            verdicts += judged
            waiting = record["engine"].get("waiting_for", [])
            if change is not None and not waiting:
                record["engine"]["verdict"] = REVERIFY  # its tests stay recorded, as measured
                record["engine_change"] = change
        if waiting:  # the engine serves the replaced drafter: nothing it served is the deployed one's
            outcome, action, drift = Outcome.PROMOTED, awaiting_action(state, waiting), False
            record["verdict"] = AWAITING
        else:
            if settings.traffic:
                scraped = (record.get("engine") or {}).get("since")
                record["traffic"] = measure_traffic(cfg, folder, deployed, baseline, now, state.judged_since, scraped)
                if judged:  # the counters against the baseline over the mix of domains logged in their window
                    judge_on_mix(record["engine"], baseline, record["traffic"].get("since_scrape", {}), settings)
                    verdicts[:1] = [record["engine"]["verdict"]]
                verdicts.append(record["traffic"]["verdict"])
            fresh = new_evidence(record, state.last_check)
            drift = count_drift(state, verdicts, change, fresh)
            recent = (record.get("traffic") or {}).get("in_window", 0)
            outcome, action = decide(cfg, state, drift, change, now, recent, fresh)
            # in an engine the export was not checked in nothing is judged (count_drift): the check's verdict says
            # so, what was measured staying in the engine's and the traffic's tests
            record["verdict"] = REVERIFY if change is not None else combined(verdicts)
        record_check(directory, state, record, drift, outcome, action, now)
    except BaseException:
        # a check that did not finish (a Hub or an engine out of reach, bad input, Ctrl-C, a full disk) leaves nothing:
        # the state file does not count it, and the next check takes its number
        shutil.rmtree(folder, ignore_errors=True)
        record_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # `checks/` made for this check alone; one with earlier checks stays
            folder.parent.rmdir()
        raise
    if action == "retrain":
        return retrain(cfg, directory, state)
    return outcome


def retrain(cfg: DictConfig, directory: Path, state: State) -> Outcome:
    """The retraining in state.pipeline, run or resumed; its outcome (the exit code) written back as the outcome
    of the check that started it, which recorded DRIFT before the retraining ran."""
    from draftsmith.monitor.pipeline import run_pipeline

    started_by = check_record_paths(directory, int(state.pipeline["id"].rsplit("_", 1)[1]))[1]
    outcome = run_pipeline(cfg, directory, state)
    if started_by.is_file():  # else a state from before the check records (nothing to write back to)
        record = json.loads(started_by.read_text())
        record["decision"]["outcome"] = outcome.name
        write_text_atomic(started_by, json.dumps(record, indent=2, default=str) + "\n")
    if state.last_check is not None and state.last_check.get("record") == str(started_by):
        state.last_check["outcome"] = outcome.name
        state.save(directory)
    return outcome


def measure_engine(
    cfg: DictConfig, state: State, deployed: dict[str, Any], baseline: Baseline, now: float
) -> tuple[dict[str, Any], list[str], Optional[dict[str, Any]]]:
    """The engine's side of a check: its record, its verdict on the counters over the window since the
    previous check (none on the first scrape of a deployment, which only starts the window, nor while the
    engine serves a drafter the monitor replaced: monitor/redeploy.py), and the version it reports against the
    one the export was checked in (`engine_change`). Keeps this scrape as the next window's start."""
    settings = cfg.monitor
    urls = list(settings.metrics)
    current = collect(urls, settings.engine)
    serving = SERVING_ENGINES[settings.engine]
    judged = []
    awaited = state.awaiting_redeploy is not None
    waiting = note_restarts(state, current, urls, now) if awaited else []
    if waiting:
        engine = {"verdict": AWAITING, "waiting_for": waiting, "note": "the engine serves the replaced drafter"}
    elif awaited:  # the redeploy showed in this scrape: the promoted drafter's window starts
        engine = {"verdict": TOO_FEW, "note": "redeployed with the promoted drafter: the window starts now"}
    elif state.counters is None:
        engine = {"verdict": TOO_FEW, "note": "first scrape of this deployment: the window starts now"}
    elif (measured := window(state.counters, current)).accepted > measured.draft_tokens:
        # each scrape had accepted <= drafted, so the previous one was of other counters under the same URLs and
        # labels (a replica replaced by another that had counted further): no window to judge; it starts now
        note = (
            f"the window's counts are not one engine's ({measured.accepted:g} accepted of {measured.draft_tokens:g} "
            "draft tokens since the previous scrape): the window starts now"
        )
        log.warning("monitor: %s", note)
        engine = {**measured.as_dict(), "verdict": TOO_FEW, "note": note}
    else:
        tests = engine_tests(measured.as_dict(), baseline, settings) if serving.counts_drafts else {}
        engine = {
            **measured.as_dict(),
            "since": state.last_check["time"],  # the check that saved the counters this window starts from
            "tests": tests,
            "verdict": verdict_of(tests) if tests else TOO_FEW,
        }
        judged.append(engine["verdict"])
    change = None
    if serving.reports_version:
        engine["versions"] = {url: engine_version(url) for url in urls}
        change = engine_change(deployed, engine["versions"])
    if engine["verdict"] == DRIFT and change is None and (fault := faulty_sampling(deployed)):
        engine["sampling_fault"] = fault
    state.counters = current
    return engine, judged, change


def count_drift(state: State, verdicts: list[str], change: Optional[dict[str, Any]], fresh: bool = True) -> bool:
    """Whether this check found drift, counted into the streak of checks in a row that did (only where it rests
    on new evidence: `fresh`, new_evidence); a check that found everything healthy ends the streak.

    In an engine the export was not checked in, a drop is not drift (nor a healthy window a
    recovery): the streak stays where it was until the export is checked in that engine. The
    per-request counts of the traffic come from the same engine, and a retraining's export would be
    checked in export.vllm_python, not in it, so the whole check waits for the re-verification."""
    drift = change is None and DRIFT in verdicts
    if drift and fresh:
        state.consecutive_drift += 1
    elif change is None and verdicts and all(verdict == HEALTHY for verdict in verdicts):
        state.consecutive_drift = 0
    return drift


def record_check(
    directory: Path, state: State, record: dict[str, Any], drift: bool, outcome: Outcome, action: str, now: float
) -> None:
    """The check's decision into its record (`checks/<n>.json`, TensorBoard) and the state file, with
    the retraining to run when that is the action, with the figures that started it."""
    reason = drift_reason(record) if drift else None
    if action == "retrain":
        state.pipeline = {
            "id": f"retrain_{state.checks:05d}",
            "started": record["time"],
            "drift": reason,
            "domains": drifted_domains(record),
            "deployed": record["deployed"],
            "done": {},
        }
    # exit 0 is "no drift found": named healthy only when everything measured was judged so
    unjudged = outcome == Outcome.HEALTHY and record["verdict"] != HEALTHY
    named = record["verdict"].upper().replace(" ", "_") if unjudged else outcome.name
    record["decision"] = {
        "drift": drift,
        "consecutive": state.consecutive_drift,
        "action": action,
        "outcome": named,
    }
    if drift:
        record["decision"]["reason"] = reason
    path = write_record(directory, state.checks, record, now)
    state.last_check = {
        "time": record["time"],
        "record": str(path),
        "outcome": named,
        "action": action,
        "verdict": record["verdict"],
    }
    if drift:
        state.last_check["reason"] = record["decision"]["reason"]
    notes = [(record.get("traffic") or {}).get("free_baselines", {}).get("note")]
    notes.append(drift and (record.get("engine") or {}).get("sampling_fault"))
    if any(notes):
        state.last_check["note"] = "; ".join(note for note in notes if note)
    state.save(directory)


def decide(
    cfg: DictConfig,
    state: State,
    drift: bool,
    change: Optional[dict[str, Any]],
    now: float,
    recent: int,
    fresh: bool = True,
) -> tuple[Outcome, str]:
    """The check's outcome and what it does; `recent`: the logged requests in monitor.traffic_window_s,
    which a retraining samples its prompts from (none: it would have nothing to train on); `fresh`: the drift
    rests on something no earlier check judged (new_evidence)."""
    if change is not None:
        return Outcome.REVERIFY, reverify_action(change)
    if not drift:
        return Outcome.HEALTHY, "none"
    if not fresh:
        return (
            Outcome.DRIFT,
            "wait: no request of the drifted domains logged since the previous check, which judged the same ones "
            f"(drift in {state.consecutive_drift} of {cfg.monitor.consecutive} checks in a row)",
        )
    if state.consecutive_drift < cfg.monitor.consecutive:
        return Outcome.DRIFT, f"wait: drift in {state.consecutive_drift} of {cfg.monitor.consecutive} checks in a row"
    if now < state.cooldown_until:
        return (
            Outcome.DRIFT,
            f"wait: cooldown until {iso_seconds(state.cooldown_until)}",
        )
    if not cfg.monitor.retrain:
        return Outcome.DRIFT, "report only (monitor.retrain=false)"
    if not recent:
        return Outcome.DRIFT, "wait: no request in monitor.traffic within monitor.traffic_window_s to retrain on"
    return Outcome.DRIFT, "retrain"


def measure_traffic(
    cfg: DictConfig,
    check_dir: Path,
    deployed: dict[str, Any],
    baseline: Baseline,
    now: float,
    since: float,
    scraped: Optional[str] = None,
) -> dict[str, Any]:
    """Acceptance per domain of recent traffic: from the engine's per-request counts where the logged
    requests carry them (monitor/traffic.py), else by replay, draftsmith's eval of the deployed
    drafter on the latest requests of the domain (its files in `check_dir`). The requests logged before
    `since` (a replaced drafter served them: monitor/redeploy.py) are left out. `newest_request`: each
    domain's latest request time (new_evidence)."""
    from draftsmith.eval.report import run_eval

    window_start = None if scraped is None else datetime.datetime.fromisoformat(scraped).timestamp()
    requests, summary = sample(
        Path(cfg.monitor.traffic), cfg.monitor.sample_per_domain, cfg.monitor.traffic_window_s, now, since, window_start
    )
    summary["newest_request"] = {}
    for request in requests:
        newest = summary["newest_request"]
        newest[request["domain"]] = max(newest.get(request["domain"], 0.0), request["time"])
    tests = request_tests(summary["per_request_acceptance"], baseline, cfg.monitor)
    replayed = [request for request in requests if request["domain"] not in tests]
    if not replayed:
        return {**summary, "domains": tests, "verdict": verdict_of(tests) if tests else TOO_FEW}
    conversations = write_conversations(replayed, check_dir / "traffic_sample.jsonl")
    variant = derived(
        cfg,
        {
            "eval.data": [str(conversations)],
            "eval.max_prompts": cfg.monitor.sample_per_domain,
            "eval.tree": 0,  # the chain's acceptance is what a check reads; the free baselines beside it
            "eval.prompts_in_train": False,  # data.train is not read again on every check
            "output_dir": str(check_dir),
        },
        "eval",
    )
    report = run_eval(variant, deployed["export"])
    replayed_tests = domain_tests(report, baseline, cfg.monitor)
    tests |= replayed_tests
    return {
        **summary,
        "sample": str(conversations),
        "report": str(check_dir / EVAL_DIR / REPORT_NAME),
        "domains": tests,
        "verdict": verdict_of(tests),
        "free_baselines": free_against_drafter(report, judged=verdict_of(replayed_tests) != TOO_FEW),
    }


def drifted_domains(record: dict[str, Any]) -> list[str]:
    """The domains retraining targets: those the traffic sample found drifted or new; all sampled
    domains when the engine alone saw the drift."""
    domains = record.get("traffic", {}).get("domains", {})
    marked = [name for name, test in domains.items() if test["verdict"] == DRIFT or test["new_domain"]]
    return marked or sorted(domains)
