"""The retraining pipeline a drift starts, each step resumable and recorded in the state file:

    sample      recent traffic of the drifted and new domains, split 80/20 (whole conversations, by a hash of
                how they open; at least one each way) into data to retrain on and held-out prompts to judge on
    regenerate  the target's own answers to those requests (data_prep.regenerate: resumable by parts)
    train       warm start from the deployed drafter (train.init_from: its weights and draft vocabulary),
                on the regenerated traffic, listed monitor.new_data_weight times, mixed with data.train
                (train.resume=true: a killed run continues from its last checkpoint)
    evaluate    the deployed and the new drafter on the old domains (the recipe's eval data) and the
                new ones (the held-out traffic), same prompts, chains, greedy
    gate        promote only if τ on the new domains rises by >= monitor.gate_min_gain and τ on the old
                domains falls by <= monitor.gate_max_loss (counts summed over each group's domains)
    export      the new drafter for export.engines into <state_dir>/exports/rev_<n> (pushed when
                export.push.repo_id is set: a new commit, i.e. a new Hub revision)
    record      the new export becomes the deployed one, with its eval as the baseline; cooldown starts

A step that finished is never run again; a killed pipeline resumes at the first unfinished step the
next time `check` runs. One whose sample finds fewer than two requests of the drifted domains in the traffic
window (they aged out before it resumed, or only a trickle was logged) is abandoned: exit 10, no cooldown, the
drift streak starting again.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.data_prep.overlap import turns_digest
from draftsmith.errors import Preempted
from draftsmith.files import checkpoint_digest, file_sha256
from draftsmith.heads.base import WEIGHTS_NAME
from draftsmith.monitor import Outcome
from draftsmith.monitor.redeploy import after_promotion
from draftsmith.monitor.state import State, iso_seconds
from draftsmith.monitor.traffic import sample, write_conversations
from draftsmith.outputs import EVAL_DIR, REPORT_NAME
from draftsmith.recipe import derived

HELD_OUT = 0.2
log = logging.getLogger("draftsmith.monitor")


def run_pipeline(cfg: DictConfig, directory: Path, state: State) -> Outcome:
    pipeline = state.pipeline
    run_dir = directory / "retrain" / pipeline["id"]
    for step, run_step in STEPS.items():
        if step in pipeline["done"]:
            continue
        if step == "export" and not pipeline["done"]["gate"]["promote"]:
            return reject(directory, state, cfg.monitor)
        result = run_step(cfg, directory, state, run_dir)
        if step == "sample" and isinstance(result, str):  # too little traffic: the retraining cannot start
            return abandon(directory, state, result)
        if step == "record":
            return Outcome.PROMOTED
        pipeline["done"][step] = result
        state.save(directory)
    raise AssertionError("the record step ends every pipeline")


def step_sample(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> dict[str, Any] | str:
    """The requests to retrain and judge on; or why the retraining cannot start, when the window holds fewer than
    two requests of the drifted domains (one to train on, one to judge on: a retraining resumed after they left
    it, or started on a trickle, would fail the same way on every check)."""
    requests, summary = sample(Path(cfg.monitor.traffic), cfg.monitor.retrain_samples, cfg.monitor.traffic_window_s)
    # no domain: a retraining recorded by a check that read no traffic (before the retraining needed
    # monitor.traffic), which the engine's counters alone started: every domain of the recent traffic
    wanted = set(state.pipeline["domains"]) or {r["domain"] for r in requests}
    requests = [r for r in requests if r["domain"] in wanted]
    if len(requests) < 2:
        state.pipeline["domains"] = sorted(wanted)
        found = "no traffic" if not requests else "a single request"
        return (
            f"{found} of the drifted domains {sorted(wanted)} in {cfg.monitor.traffic} within "
            "monitor.traffic_window_s to retrain on (it takes two: one to train on, one to judge on)"
        )
    split = split_held_out(requests)
    if split is None:
        state.pipeline["domains"] = sorted(wanted)
        return (
            f"the {len(requests)} requests of the drifted domains {sorted(wanted)} in {cfg.monitor.traffic} within "
            "monitor.traffic_window_s open alike (one prompt asked again, or one chat's turns): none can be held out "
            "to judge on without training on its prompt"
        )
    kept, held = split
    train = write_conversations(kept, run_dir / "traffic_train.jsonl")
    judge = write_conversations(held, run_dir / "traffic_eval.jsonl")
    return {"train": str(train), "eval": str(judge), "domains": sorted(wanted), "read": summary}


def split_held_out(requests: list[dict[str, Any]]) -> Optional[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Requests as (to train on, held out to judge on), whole conversations to one side: requests that open alike
    (their turns up to the first user turn: a prompt asked again, or a chat's later turns, which hold its earlier
    prompts) are kept or held out together, else the regenerated answers trained on would hold the held-out
    prompts' own and the gate would judge on what the drafter trained on. The HELD_OUT share of the requests, in
    each domain's conversations with the lowest hashes of their openings, the others kept; at least one
    conversation each way (a share of a few requests by hash alone may hold none out, and the evaluate step would
    then fail on every check); the same requests give the same split. None where all open alike: nothing can be
    held out."""

    def opening(request: dict[str, Any]) -> str:
        messages = request["messages"]
        first_user = next((i for i, turn in enumerate(messages) if turn["role"] == "user"), len(messages) - 1)
        return turns_digest(messages[: first_user + 1])

    conversations: dict[str, list[int]] = defaultdict(list)
    for index, request in enumerate(requests):
        conversations[opening(request)].append(index)
    if len(conversations) < 2:
        return None
    by_domain: dict[str, list[str]] = defaultdict(list)  # a conversation's domain: its first request's
    for key, members in conversations.items():
        by_domain[requests[members[0]]["domain"]].append(key)
    held: set[int] = set()
    for keys in by_domain.values():  # each domain's share, so that the gate judges every domain it can
        share, taken = max(1, round(sum(len(conversations[key]) for key in keys) * HELD_OUT)), 0
        for key in sorted(keys)[:-1]:  # never a domain's every conversation: it would not be retrained on
            if taken >= share:
                break
            held.update(conversations[key])
            taken += len(conversations[key])
    if not held:  # every domain one conversation: one held out all the same, the gate's judge
        held.update(conversations[min(conversations)])
    return (
        [r for index, r in enumerate(requests) if index not in held],
        [r for index, r in enumerate(requests) if index in held],
    )


def step_regenerate(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> dict[str, Any]:
    from draftsmith.data_prep.regenerate import regenerate

    variant = derived(
        cfg,
        {
            "data.train": [state.pipeline["done"]["sample"]["train"]],
            "data.max_conversations": None,
            "data.regenerate.output": str(run_dir / "regenerated"),
        },
    )
    result = regenerate(variant)
    return {"output": str(result.directory), "conversations": result.conversations}


def warm_start_of(state: State) -> str:
    """What the retraining starts from: the draftsmith checkpoint the deployed export came from (its
    sha256 checked), or, when that is gone or changed, the export folder itself (train.init_from reads
    both)."""
    deployed = state.pipeline["deployed"]
    checkpoint = Path(deployed["checkpoint"])
    if (checkpoint / WEIGHTS_NAME).is_file() and checkpoint_digest(checkpoint) == deployed["sha256"]:
        return str(checkpoint)
    return deployed["export"]


def step_train(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> dict[str, Any]:
    from accelerate import PartialState

    from draftsmith.trainer.checkpoint import claim_output_dir
    from draftsmith.trainer.loop import train

    regenerated = state.pipeline["done"]["regenerate"]["output"]
    start = warm_start_of(state)
    changes = {
        "data.train": [regenerated] * cfg.monitor.new_data_weight + list(cfg.data.train),
        "data.features": None,
        "data.eval": [],
        "checkpoint": None,  # the monitor's, the deployed export, is no training input: the run's recipe reads final/
        "train.init_from": start,
        "train.resume": "true",
        "train.overwrite": False,
        "eval.enabled": False,
        "output_dir": str(run_dir / "train"),
    }
    variant = derived(cfg, changes)
    with claim_output_dir(variant, PartialState()):
        try:
            final = train(variant).final
        except Preempted:  # the trainer's line says to resume it by hand: the monitor's next check does
            raise Preempted(
                f"stopped on SIGTERM in the training of the retraining {state.pipeline['id']} (its checkpoint is "
                f"in {run_dir / 'train'}); run the same monitor command again: it resumes the retraining"
            ) from None
    return {"checkpoint": str(final), "warm_start": start, "steps": variant.train.max_steps}


def step_evaluate(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> dict[str, Any]:
    from draftsmith.eval.report import run_eval
    from draftsmith.recipe_schema import EvalSection

    prompts = [state.pipeline["done"]["sample"]["eval"], *old_domain_prompts(cfg, state, run_dir)]
    reports = {}
    for name, drafter in (
        ("deployed", state.pipeline["deployed"]["export"]),
        ("candidate", state.pipeline["done"]["train"]["checkpoint"]),
    ):
        chain_only = {  # the chains' τ (the n-gram baseline off, its settings unused)
            "eval.tree": 0, "eval.ngram_baseline": False, "eval.ngram_max": EvalSection.ngram_max,
            "eval.suffix_baseline": False,
        }  # fmt: skip
        changes = {"eval.data": prompts, **chain_only, "output_dir": str(run_dir / f"eval_{name}")}
        variant = derived(cfg, changes, "eval")
        run_eval(variant, drafter)  # the deployed one is an export folder
        reports[name] = str(run_dir / f"eval_{name}" / EVAL_DIR / REPORT_NAME)
    return reports


def old_domain_prompts(cfg: DictConfig, state: State, run_dir: Path) -> list[str]:
    """The recipe's eval prompts of the domains that did not drift, as a file of this run's (none where every domain
    drifted): the drifted ones are judged on the held-out traffic alone, which the eval's first prompts of a domain
    (eval.max_prompts) would otherwise leave out for the recipe's own of that domain."""
    from draftsmith.data_prep.conversations import load_conversations

    drifted = set(state.pipeline["domains"])
    recipe = load_conversations(list(cfg.eval.data) or list(cfg.data.eval), prompts_only=True)
    kept = [row for row in recipe if row["domain"] not in drifted]
    return [str(write_conversations(kept, run_dir / "eval_old_domains.jsonl"))] if kept else []


def group_tau(report: dict[str, Any], domains: list[str]) -> float:
    rows = [report["domains"][d]["chain"] for d in domains if d in report["domains"]]
    forwards = sum(row["target_forwards"] for row in rows)
    return sum(row["new_tokens"] for row in rows) / forwards if forwards else 0.0


def step_gate(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> dict[str, Any]:
    reports = {name: json.loads(Path(path).read_text()) for name, path in state.pipeline["done"]["evaluate"].items()}
    new = list(state.pipeline["domains"])
    old = [d for d in reports["deployed"]["domains"] if d != "all" and d not in new]
    judged = [d for d in new if d in reports["deployed"]["domains"]]  # a domain of one conversation is not held out
    tau = {name: {"new": group_tau(report, new), "old": group_tau(report, old)} for name, report in reports.items()}
    gain = tau["candidate"]["new"] / tau["deployed"]["new"] - 1 if tau["deployed"]["new"] else 0.0
    change_old = tau["candidate"]["old"] / tau["deployed"]["old"] - 1 if old and tau["deployed"]["old"] else 0.0
    promote = gain >= cfg.monitor.gate_min_gain and change_old >= -cfg.monitor.gate_max_loss
    per_domain = {
        d: {name: report["domains"][d]["chain"]["tau"] for name, report in reports.items()}
        for d in reports["deployed"]["domains"]
    }
    return {
        "promote": promote,
        "new_domains": judged,
        "not_held_out": [d for d in new if d not in judged],
        "old_domains": old,
        "prompts": {
            group: sum(reports["deployed"]["domains"][d]["chain"]["prompts"] for d in domains)
            for group, domains in (("new", judged), ("old", old))
        },  # fmt: skip
        "tau": tau,
        "gain_new": round(gain, 4),
        "change_old": round(change_old, 4),
        "per_domain": per_domain,
    }


def step_export(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> dict[str, Any]:
    from draftsmith.export.run import export_checkpoint

    revision = len(state.revisions) + 1
    output = directory / "exports" / f"rev_{revision:04d}"
    report = state.pipeline["done"]["evaluate"]["candidate"]
    variant = derived(
        cfg,
        {
            "export.output": str(output),
            "export.report": report,
            "export.overwrite": True,
            "output_dir": str(run_dir / "train"),
        },
        "export",
    )
    folders = export_checkpoint(variant, Path(state.pipeline["done"]["train"]["checkpoint"]))
    return {
        "revision": revision,
        "folders": {engine: str(folder) for engine, folder in folders.items()},
        "report": report,
    }


def step_record(cfg: DictConfig, directory: Path, state: State, run_dir: Path) -> None:
    exported, train = state.pipeline["done"]["export"], state.pipeline["done"]["train"]
    engine = cfg.monitor.engine if cfg.monitor.engine in exported["folders"] else next(iter(exported["folders"]))
    checkpoint = Path(train["checkpoint"])
    state.deployed = {
        "export": exported["folders"][engine], "revision": exported["revision"], "baseline": exported["report"],
        "baseline_sha256": file_sha256(Path(exported["report"])),
        "checkpoint": str(checkpoint), "sha256": checkpoint_digest(checkpoint),
    }  # fmt: skip
    replaced = state.pipeline["deployed"]
    finish(state, promoted=True, cooldown_s=cfg.monitor.cooldown_s)
    after_promotion(state, cfg.monitor, time.time())
    state.last_retrain["reason"] = promotion_reason(state, replaced, cfg.monitor)
    state.revisions.append({**state.deployed, "folders": exported["folders"], "gate": state.last_retrain["gate"]})
    state.save(directory)


def promotion_reason(state: State, replaced: dict[str, Any], settings: DictConfig) -> str:
    """The check's line for a promoted retraining (exit 12): the revision and where it is, the gate's τ that
    promoted it, and what to serve in place of the drafter it replaced."""
    deployed, gate = state.deployed, state.last_retrain["gate"]
    return (
        f"revision {deployed['revision']} in {Path(deployed['export']).parent}: {gate_taus(gate, settings)}: serve "
        f"{deployed['export']} in place of {replaced['export']} (state.json's deployed.export, which a redeploy hook "
        f"on exit 12 rolls out); no retraining starts before {iso_seconds(state.cooldown_until)} (monitor.cooldown_s)"
    )


def reject(directory: Path, state: State, settings: DictConfig) -> Outcome:
    """End a retraining whose drafter failed the gate (exit 11), `last_retrain.reason` saying by how much."""
    gate = state.pipeline["done"]["gate"]
    finish(state, promoted=False, cooldown_s=settings.cooldown_s)
    state.last_retrain["reason"] = gate_reason(gate, settings, state.cooldown_until)
    state.save(directory)
    return Outcome.REJECTED


def gate_reason(gate: dict[str, Any], settings: DictConfig, cooldown_until: float) -> str:
    """The check's line for a rejected retraining (exit 11): the gate's τ, and until when no retraining starts."""
    return (
        f"{gate_taus(gate, settings)}: the deployed drafter stays, and no retraining starts before "
        f"{iso_seconds(cooldown_until)} (monitor.cooldown_s)"
    )


def gate_taus(gate: dict[str, Any], settings: DictConfig) -> str:
    """The gate's measure: τ (tokens per target forward) of the deployed and the retrained drafter on the drifted
    and new domains and on the old ones, against what it needs."""
    tau = gate["tau"]
    prompts = gate.get("prompts", {})  # absent from a gate recorded before it was counted
    missing = gate.get("not_held_out")
    said = (
        f"the retrained drafter's τ on the drifted and new domains ({', '.join(gate['new_domains'])}"
        + (f"; {', '.join(missing)}: one conversation, none held out" if missing else "")
        + ")"
        + (f" over {prompts['new']} held-out prompts" if "new" in prompts else "")
        + f" {tau['deployed']['new']:.3f} → {tau['candidate']['new']:.3f} ({gate['gain_new']:+.1%}; the gate needs "
        f"{settings.gate_min_gain:+.1%} or more)"
    )
    if gate["old_domains"]:
        said += (
            f", on the old domains ({', '.join(gate['old_domains'])}) {tau['deployed']['old']:.3f} → "
            f"{tau['candidate']['old']:.3f} ({gate['change_old']:+.1%}; the gate needs {-settings.gate_max_loss:+.1%} "
            "or more)"
        )
    return said


def abandon(directory: Path, state: State, reason: str) -> Outcome:
    """End a retraining that cannot start (`reason`): no cooldown, since nothing was retrained; the drift streak
    starts again, and the check's line says why (exit 10: drift, no retraining now)."""
    pipeline = state.pipeline
    log.warning("the retraining %s is abandoned: %s", pipeline["id"], reason)
    state.last_retrain = {"id": pipeline["id"], "promoted": False, "abandoned": reason,
                          "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                          "domains": pipeline["domains"], "drift": pipeline.get("drift")}  # fmt: skip
    state.consecutive_drift = 0
    state.pipeline = None
    if state.last_check is not None:  # the check's line: the drift that started the retraining, and why it ended
        state.last_check["abandoned"] = pipeline["id"]
        state.last_check["note"] = f"retraining {pipeline['id']} abandoned: {reason}"
    state.save(directory)
    return Outcome.DRIFT


def finish(state: State, promoted: bool, cooldown_s: float) -> None:
    """End the pipeline: keep its summary, start the cooldown, and, but for a promotion, start a fresh counter
    window (the unchanged server is measured from here on). After a promotion the last scrape is kept: the
    redeploy shows as the counters' restart since it (monitor/redeploy.py)."""
    now = time.time()
    pipeline = state.pipeline
    state.last_retrain = {"id": pipeline["id"], "promoted": promoted,
                          "finished": datetime.datetime.fromtimestamp(now, datetime.timezone.utc).isoformat(),
                          "domains": pipeline["domains"], "gate": pipeline["done"].get("gate")}  # fmt: skip
    state.cooldown_until = now + cooldown_s
    state.consecutive_drift = 0
    if not promoted:
        state.counters = None
    state.pipeline = None


STEPS = {
    "sample": step_sample,
    "regenerate": step_regenerate,
    "train": step_train,
    "evaluate": step_evaluate,
    "gate": step_gate,
    "export": step_export,
    "record": step_record,
}
