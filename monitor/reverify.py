"""A new engine is a re-verify, not a drift: the vLLM version each replica reports against the one the deployed
export was checked in (`engine_change`), and what the check's line advises then (monitor/check.py decides). And in
the engine it was checked in, a drift that engine itself may cause (`faulty_sampling`).

What it advises is the export of the same checkpoint checked in the new engine, for the versions that serve the
drafter's kind; for those that do not (vLLM 0.33 removed Medusa), what serves it, from the table the export
refuses by (formats/versions.py), not a command the export would refuse.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any, Optional

from packaging.version import InvalidVersion

from draftsmith.formats import exporter_for
from draftsmith.formats.repo import VLLM_PINNED
from draftsmith.formats.versions import Releases, served_by, serves
from draftsmith.monitor.deployed import read_export_info, sampling_fault_build
from draftsmith.monitor.metrics import UNKNOWN


def engine_change(deployed: dict[str, Any], versions: dict[str, str]) -> Optional[dict[str, Any]]:
    """What the deployed export records of the engine it was checked in against what the replicas
    report, when one reports another version; None when they agree, and when there is nothing to
    compare: a replica without /version (UNKNOWN), or an export never checked in an engine (exported
    without export.vllm_python: its baseline is draftsmith's eval alone, judged as before).

    vLLM's /metrics and /version do not report the speculative config, so the settings that move τ
    cannot be read from a running engine: the version stands for them. An export pins the sampling
    settings in its served config (VLLM_PINNED), so a new engine cannot move them; for an older export
    that does not, the change says that the engine's defaults decide them.

    The command it advises is the export checked in the new engine, named only for the versions that serve the
    drafter's kind (formats/versions.py, the table the export refuses by: vLLM 0.33 serves no Medusa); for the
    others `unserved` says what serves it instead."""
    info = read_export_info(deployed["export"])
    checked = info.get("engine_settings") or {}
    recorded = checked.get("vllm_version") or (info.get("verified") or {}).get("engine_version")
    reported = {url: version for url, version in versions.items() if version not in (recorded, UNKNOWN)}
    if recorded is None or not reported:
        return None
    by_version: dict[str, list[str]] = {}
    for url, version in reported.items():
        by_version.setdefault(version, []).append(url)
    served = "; ".join(f"vLLM {version} at {', '.join(urls)}" for version, urls in by_version.items())
    reason = f"the export {deployed['export']} was checked in vLLM {recorded} and is served by {served}"
    pinned = info.get("speculative_config") or {}
    unpinned = [key for key in VLLM_PINNED if key not in pinned]
    if unpinned:
        sampling = f"the export does not pin {', '.join(unpinned)}: the engine's defaults decide them"
        reason += f"; {sampling}"
    else:
        sampling = f"pinned in the served config: {', '.join(f'{key}={pinned[key]}' for key in VLLM_PINNED)}"
    exporter = exporter_for(info["drafter_type"])
    recorded_range = info.get("vllm_release_range")
    if recorded_range:  # the export's own reading (an MTP layer's records its model, which drafter_config omits)
        releases, releases_line = Releases(**recorded_range), info["vllm_releases"]
    else:  # an earlier export's: the table's reading of its drafter config
        releases = exporter.releases(info.get("drafter_config") or {}, info.get("num_speculative_tokens"))
        releases_line = served_by(exporter.vllm_method, releases)
    unserved = [version for version in by_version if not serves_version(releases, version)]
    serving = [version for version in by_version if version not in unserved]
    engines = " / ".join(f"vLLM {version}" for version in serving)
    return {
        "recorded": recorded,
        "reported": reported,
        "sampling": sampling,
        "reason": reason,
        "unserved": (
            f"No export of this {info['drafter_type']} drafter can be checked in vLLM {' / '.join(unserved)}: "
            f"{releases_line}"
            if unserved
            else None
        ),
        "command": (
            f"{reverify_command(deployed, info)} (RECIPE: this monitor's recipe; PYTHON: a Python with {engines})"
            if serving
            else None
        ),
    }


def faulty_sampling(deployed: dict[str, Any]) -> Optional[str]:
    """Where the deployed export was checked in a vLLM CPU build that samples speculative requests at temperature > 0
    from another distribution than the target's (formats/repo.py's VLLM_CPU_SAMPLING_FAULT), what a drift there may be
    instead: the replicas report that build's version (no re-verify), and neither /metrics nor the request logs say
    the build or the requests' temperature. Measured: the draft model's τ 1.05 there against 1.36 where the kernel
    is mended, at temperature 0.8 (docs/export.md)."""
    if not (version := sampling_fault_build(read_export_info(deployed["export"]))):
        return None
    return (
        f"the export was checked in vLLM's CPU build {version}, which accepts fewer drafts of a request sampled at "
        "temperature > 0 than the drafter predicts, with no drift (vllm-project/vllm#55005): if that build serves "
        "sampled requests, send it greedy ones before retraining"
    )


def reverify_action(change: dict[str, Any]) -> str:
    """The line of a check in an engine the export was not checked in (exit 13): the change, and what to run, or
    for an engine that cannot serve the drafter what serves it."""
    advice = [change["unserved"]] if change["unserved"] else []
    if change["command"]:
        advice.append(f"Check the export in that engine before its acceptance is judged again: {change['command']}")
    else:  # no export of this drafter runs in the engines serving it: only the engine it was checked in does
        advice.append(
            f"Serve it with vLLM {change['recorded']}, the version it was checked in, for its acceptance to be judged "
            "again"
        )
    return f"reverify: {change['reason']}. {'. '.join(advice)}"


def serves_version(releases: Releases, version: str) -> bool:
    """Whether the vLLM of a replica's reported version serves the method of `releases`; a version that names no
    release (a build's own string) is not known to lack it, so its export is checked there as in any other."""
    try:
        return serves(releases, version)
    except InvalidVersion:
        return True


def reverify_command(deployed: dict[str, Any], info: dict[str, Any]) -> str:
    """The export of the deployed checkpoint again, into the deployed folder (an export of the same
    checkpoint is redone in place), as it was made and checked in the engine PYTHON runs."""
    args = [f"checkpoint={deployed['checkpoint']}", f"export.output={Path(deployed['export']).parent}"]
    if info.get("num_speculative_tokens"):
        args.append(f"export.num_speculative_tokens={info['num_speculative_tokens']}")
    if info.get("eval_report"):  # else the re-export would look for the report beside the checkpoint
        args.append(f"export.report={info['eval_report']['path']}")
    if info.get("batch_schedule"):
        args.append(f"export.batch_sweep={info['batch_schedule']['sweep']}")
    return f"draftsmith export recipe=RECIPE {shlex.join(args)} export.vllm_python=PYTHON"
