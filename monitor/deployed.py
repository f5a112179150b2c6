"""Which drafter a check watches, and the baseline it is judged against.

The recipe's `checkpoint=` names the deployed export until the monitor promotes a retrained drafter,
which is then the deployed one (state.json's `deployed`). The state directory belongs to the drafter
its first check watched and the revisions the monitor promoted from it (`first_deployed`,
`revisions`): a check of another drafter there would carry on with that one's streak, counter window
and cooldown, and is refused. The baseline report must have measured the deployed weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.errors import UserError, one_line
from draftsmith.files import file_sha256
from draftsmith.formats.repo import EXPORT_INFO, VLLM_CPU_SAMPLING_FAULT
from draftsmith.formats.versions import CPU_BUILD
from draftsmith.monitor.drift import Baseline
from draftsmith.monitor.state import State
from draftsmith.outputs import REPLACED_DIR

log = logging.getLogger("draftsmith.monitor")


def deployed_of(cfg: DictConfig, state: State, directory: Path) -> dict[str, Any]:
    """The deployed export and the report its baseline comes from: once the monitor has promoted a
    retrained drafter, that one (state.json's `deployed`: the recipe's checkpoint is what was deployed
    before it); else the recipe's checkpoint. The state belongs to the drafter it was started with and
    the revisions it promoted (by the sha256 of the checkpoint each was exported from): a checkpoint of
    another drafter is refused, as its streak, window and cooldown are not this one's."""
    if state.deployed is not None and cfg.monitor.baseline and cfg.monitor.baseline != state.deployed["baseline"]:
        log.warning(
            "monitor.baseline=%s is not read: revision %d, which this monitor promoted, is judged against its own "
            "eval by the gate (%s, state.json's deployed.baseline)",
            cfg.monitor.baseline,
            state.deployed["revision"],
            state.deployed["baseline"],
        )
    if state.deployed is not None and not cfg.checkpoint:  # after a promotion the state names what is deployed
        return promoted(cfg, state)
    named = recipe_drafter(cfg)
    if state.first_deployed is None:
        state.first_deployed = {"export": named["export"], "sha256": named["sha256"]}
    own = [state.first_deployed, *state.revisions]
    if named["sha256"] not in {drafter["sha256"] for drafter in own}:
        raise UserError(
            f"monitor.state_dir={str(directory)!r} holds the monitoring of another drafter (the export "
            f"{state.first_deployed['export']}, weights sha256 {state.first_deployed['sha256'][:12]}), not of "
            f"checkpoint={cfg.checkpoint} (sha256 {named['sha256'][:12]}): give each deployed drafter its own "
            "monitor.state_dir"
        )
    if state.deployed is None:
        return named
    if named["sha256"] != state.deployed["sha256"]:
        log.info(
            "checkpoint=%s was deployed before revision %d, which this monitor promoted: the check watches %s "
            "(state.json's deployed.export)",
            cfg.checkpoint,
            state.deployed["revision"],
            state.deployed["export"],
        )
    return promoted(cfg, state)


def promoted(cfg: DictConfig, state: State) -> dict[str, Any]:
    """The revision this monitor promoted, judged against the gate's report as the promotion recorded it; or as it is
    now, where monitor.baseline names that report (an eval written over it since)."""
    if cfg.monitor.baseline == state.deployed["baseline"]:
        return {**state.deployed, "baseline_sha256": None}
    return state.deployed


def recipe_drafter(cfg: DictConfig) -> dict[str, Any]:
    """The export the recipe's checkpoint names and the report its baseline comes from."""
    folder = cfg.checkpoint
    if folder is None:
        raise UserError(
            "the monitor watches a deployed export: give checkpoint=DIR, the export's vllm/ or sglang/ folder"
        )
    if not Path(folder).exists():
        raise UserError(f"checkpoint={folder!r} does not exist: give the deployed export's vllm/ or sglang/ folder")
    if not (Path(folder) / EXPORT_INFO).is_file():
        raise UserError(
            f"checkpoint={folder!r} is not an export folder (an export's vllm/ or sglang/ holding {EXPORT_INFO})"
        )
    info = read_export_info(folder)
    recorded = info.get("eval_report") or {}
    report = cfg.monitor.baseline or recorded.get("path")
    if not report:
        raise UserError(
            f"{folder} was exported without an eval report: set monitor.baseline=<report.json> (evaluate the "
            "checkpoint and export again)"
        )
    return {
        "export": str(Path(folder).resolve()),
        "revision": 0,
        "baseline": str(report),
        # the report as the export recorded it (absent from an export of an earlier draftsmith); a baseline given
        # by monitor.baseline is taken as it is
        "baseline_sha256": None if cfg.monitor.baseline else recorded.get("sha256"),
        "checkpoint": info["source"]["checkpoint"],
        "sha256": info["source"]["sha256"],
    }


def read_export_info(folder: str) -> dict[str, Any]:
    path = Path(folder) / EXPORT_INFO
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read the deployed export's {path}: {err}") from None


def load_baseline(deployed: dict[str, Any]) -> Baseline:
    """The `deployed` drafter's baseline report, which must have measured its weights and, where the export or the
    promotion recorded the report's sha256, be that report still: an eval written over it since (other prompts,
    another temperature) would move the baseline every later check is judged against, unsaid."""
    path, weights, recorded = deployed["baseline"], deployed["sha256"], deployed.get("baseline_sha256")
    now = file_sha256(Path(path)) if recorded is not None and Path(path).is_file() else recorded
    if now != recorded:
        # the eval that replaced it moved it aside (eval/replaced/<time>/): named, the line's first choice
        aside = sorted(Path(path).parent.glob(f"{REPLACED_DIR}/*/{Path(path).name}"), reverse=True)
        kept = next((report for report in aside if file_sha256(report) == recorded), None)
        raise UserError(
            f"the baseline report {path} is not the one recorded when {deployed['export']} was deployed (sha256 "
            f"{recorded[:12]}, now {now[:12]}): an eval replaced it since; "
            + (f"the recorded one is {kept}: set monitor.baseline={kept} to judge against it, or " if kept else "set ")
            + f"monitor.baseline={path} to take it as it is"
            + ("" if deployed["revision"] else ", or export the checkpoint again to record it")
        )
    try:
        report = json.loads(Path(path).read_text())
        measured = (report.get("drafter") or {}).get("sha256")
        if not isinstance(measured, (str, type(None))):
            raise TypeError(f"drafter.sha256 {measured!r}")
        # another drafter's report is refused as that, whatever else is wrong with it for this one (acceptance 0)
        if measured is not None and measured != weights:
            raise other_weights(path, measured, weights)
        baseline = Baseline.from_report(report, path)
        if not isinstance(baseline.temperature, (int, float)):
            raise TypeError(f"temperature {baseline.temperature!r}")
        if measured != weights:
            raise other_weights(path, measured, weights)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"cannot read the baseline report {path}: {err}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as err:  # values of another kind: exit 70 before
        raise UserError(
            f"{path} is not a draftsmith eval report ({one_line(err, with_type=True)}): give the report.json the "
            "deployed drafter's eval wrote"
        ) from None
    return baseline


def other_weights(path: str, measured: Optional[str], weights: str) -> UserError:
    """The refusal of a baseline report that measured other weights than the deployed drafter's, or names none."""
    return UserError(
        f"the baseline report {path} measured "
        + (f"weights of sha256 {measured[:12]}" if measured else "weights it names no sha256 of")
        + f", not the deployed drafter's ({weights[:12]}): evaluate the deployed checkpoint (python -m eval) and set "
        "monitor.baseline to its report"
    )


def sampling_fault_build(info: dict[str, Any]) -> Optional[str]:
    """The version of vLLM's CPU build an export's record says it was checked in, where that build samples requests at
    temperature > 0 from another distribution than the target's (formats/repo.py's VLLM_CPU_SAMPLING_FAULT); else
    None."""
    verified = info.get("verified") or {}
    version = verified.get("engine_version")
    return version if verified.get("engine_build") == CPU_BUILD and version in VLLM_CPU_SAMPLING_FAULT else None


def require_baseline_drafting(export: str, baseline: Baseline) -> None:
    """A baseline at temperature > 0 is not the acceptance of an export checked in a CPU build of
    VLLM_CPU_SAMPLING_FAULT, whose card says to send it greedy requests only (the export refuses such a report as its
    own baseline: formats/repo.py require_report_served; this is `monitor.baseline=` naming one). And a baseline
    measured at temperature > 0 of a kind that samples its drafts (Drafter.SAMPLES_DRAFTS: the eval drew each draft
    from q) is what the engine serves only under vLLM's probabilistic drafting, which exports pin since 86d1c1d; an
    export that drafts the argmax (an older one pinning greedy, or SGLang's) accepts less with no drift at all, and
    every check would say drift."""
    from draftsmith.heads import drafter_class

    if baseline.temperature <= 0:
        return
    info = read_export_info(export)
    if version := sampling_fault_build(info):
        raise UserError(
            f"the baseline report {baseline.source} measured the drafter at temperature {baseline.temperature}, and "
            f"the export {export} was checked in vLLM's CPU build {version}, which is sent greedy requests only "
            "(vllm-project/vllm#55005): a greedy acceptance judged against it could fall and still read as healthy; "
            "set monitor.baseline to a report at eval.temperature=0"
        )
    if not drafter_class(info["drafter_type"]).SAMPLES_DRAFTS:
        return
    drafting = (info.get("speculative_config") or {}).get("draft_sample_method", "greedy")
    if drafting != "probabilistic":
        raise UserError(
            f"the baseline report {baseline.source} measured drafts sampled at temperature {baseline.temperature}, "
            f"and the export {export} drafts the argmax (draft_sample_method {drafting}): it accepts less with no "
            "drift; export the checkpoint again (vLLM's export pins probabilistic drafting for this kind) or set "
            "monitor.baseline to a report at eval.temperature=0"
        )
