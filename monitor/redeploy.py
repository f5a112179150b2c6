"""From a promotion until the engine serves the promoted drafter.

A promotion (exit 12) names the export to serve, and the engine serves the replaced drafter until it is
redeployed with it: what it serves meanwhile is not the promoted drafter's, to be judged against that one's
baseline. With vLLM's counters (monitor.metrics, monitor.engine=vllm) the redeploy shows: every replica's
counters went down since the last scrape before the promotion (a restart), or its URL is one no earlier scrape
held (a new server). Until then each check judges nothing and exits 12 again, its line naming the export to
serve, so that a redeploy hook that missed the first 12 acts on the next. The requests logged before the
redeploy was seen are never judged (`State.judged_since`). Without counters (SGLang's gauges, or traffic alone)
nothing shows the redeploy: the requests logged after the promotion are judged.

`monitor.redeploy_command` is that hook run by the monitor itself, after each check that exits 12 (`watch`,
which runs on, has no exit code for a scheduler to act on).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from draftsmith.engines import SERVING_ENGINES
from draftsmith.monitor.metrics import window
from draftsmith.monitor.state import State, iso_seconds

AWAITING = "awaiting redeploy"  # a check's verdict while the engine serves the replaced drafter


def after_promotion(state: State, settings: DictConfig, now: float) -> None:
    """A promotion of `state.deployed`: nothing served before it is judged against its baseline; with vLLM's
    counters, nothing until the redeploy shows in them."""
    state.judged_since = now
    if settings.metrics and SERVING_ENGINES[settings.engine].counts_drafts:
        deployed = state.deployed
        state.awaiting_redeploy = {"revision": deployed["revision"], "export": deployed["export"],
                                   "promoted": iso_seconds(now), "restarted": []}  # fmt: skip


def note_restarts(state: State, current: dict[str, float], urls: list[str], now: float) -> list[str]:
    """The URLs of `urls` still serving the replaced drafter after this scrape (`current`), the others added to
    `awaiting_redeploy["restarted"]`; none left ends the wait, and the requests logged from now on are judged."""
    before = state.counters or {}
    known = {key.split("|", 2)[1] for key in before}  # a URL has no unencoded "|"
    new = [url for url in urls if url not in known]  # a server no earlier scrape held
    awaiting = state.awaiting_redeploy
    awaiting["restarted"] = sorted({*awaiting["restarted"], *window(before, current).restarted, *new})
    waiting = [url for url in urls if url not in awaiting["restarted"]]
    if not waiting:
        state.awaiting_redeploy = None
        state.judged_since = now
    return waiting


def awaiting_action(state: State, waiting: list[str]) -> str:
    """The line of a check while the engine serves the replaced drafter (exit 12, as the promotion's)."""
    awaiting = state.awaiting_redeploy
    return (
        f"revision {awaiting['revision']} awaits its redeploy: serve {awaiting['export']} (the engine at "
        f"{', '.join(waiting)} has not restarted since the promotion, {awaiting['promoted']}: it serves the replaced "
        "drafter, and nothing is judged until it serves this one)"
    )


def run_redeploy_command(command: str, directory: Path, timeout_s: float) -> None:
    """`command` (monitor.redeploy_command) through /bin/sh, told the promoted export (DRAFTSMITH_EXPORT, the
    folder to serve, and DRAFTSMITH_REVISION) by the environment, its output the monitor's; the monitor waits for it
    up to `timeout_s` (monitor.redeploy_timeout_s; a `watch` too: its next check is due once it is done), since a
    hung hook (a `kubectl rollout status` that never returns) blocked `watch` for good. One still running then is
    killed with every process it started (it runs in a session of its own), as is one still running when the monitor
    stops (SIGTERM, Ctrl-C); what one that ended leaves in the background (a server it started) is kept. A failure or
    a timeout is one line: the check's outcome stands (the export is promoted), and while the monitor awaits the
    redeploy (vLLM's counters) the next check, 12 again, runs it again; otherwise no check does, and the line says
    to roll it out by hand."""
    state = State.load(directory)
    deployed = state.deployed
    told = {"DRAFTSMITH_EXPORT": deployed["export"], "DRAFTSMITH_REVISION": str(deployed["revision"])}
    sys.stdout.flush()  # the check's line before the command's output
    hook = subprocess.Popen(["/bin/sh", "-c", command], env={**os.environ, **told}, start_new_session=True)
    try:
        code = hook.wait(timeout=timeout_s)
        failure = None if code == 0 else f"exited {code}"
    except subprocess.TimeoutExpired:
        failure = f"was still running after {timeout_s:g} s (monitor.redeploy_timeout_s): killed with its processes"
    finally:
        if hook.returncode is None:  # timed out, or the monitor stops: nothing of the hook outlives its wait
            os.killpg(hook.pid, signal.SIGKILL)  # its session's group: the shell and what it started
            hook.wait()
    if failure:
        print(
            f"monitor: monitor.redeploy_command {failure} for revision {deployed['revision']} "
            f"({deployed['export']}): not rolled out by it"
            + ("" if state.awaiting_redeploy else "; no later check runs it again: roll it out by hand"),
            file=sys.stderr,
            flush=True,
        )
