"""monitor.redeploy_command's bounded wait (monitor/redeploy.py): a hung hook no longer blocks `watch` for good."""

from __future__ import annotations

import os
import time

from draftsmith.monitor import Outcome
from draftsmith.recipe import load_recipe
from tests.helpers import assert_one_line_error, run_entry_in_process


def gone(pid: int) -> bool:
    """Whether process `pid` is over: absent, or a zombie its new parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_hook_still_running_after_monitor_redeploy_timeout_s_is_killed_with_what_it_started(
    tmp_path, monkeypatch, capsys
):
    """A hook that hangs (a `kubectl rollout status` that never returns) blocked `watch` forever: after
    monitor.redeploy_timeout_s it is killed with the processes it started, one line says so, and the check's
    outcome stays 12, as for a hook that fails."""
    from draftsmith.monitor import check as monitor_check
    from draftsmith.monitor.state import State

    directory, child = tmp_path / "monitor", tmp_path / "child.pid"
    State(deployed={"export": "/srv/rev_0001/vllm", "revision": 1, "baseline": "r"}).save(directory)
    monkeypatch.setattr(monitor_check, "check", lambda cfg, held: held(Outcome.PROMOTED) or Outcome.PROMOTED)
    monkeypatch.setattr(monitor_check, "summary", lambda cfg, outcome: "monitor: promoted")
    hook = f"sleep 60 & echo $! > {child}; wait"  # the shell waits on a child of its own: both must end
    args = [f"output_dir={tmp_path}", f"monitor.state_dir={directory}", f"monitor.redeploy_command='{hook}'"]
    started = time.monotonic()
    result = run_entry_in_process(
        ["-m", "monitor", "check", "recipe=medusa", *args, "monitor.redeploy_timeout_s=0.5"], capsys
    )
    assert time.monotonic() - started < 30
    assert result.returncode == 12 and result.stdout.strip() == "monitor: promoted"
    assert result.stderr.strip() == (
        "monitor: monitor.redeploy_command was still running after 0.5 s (monitor.redeploy_timeout_s): killed with "
        "its processes for revision 1 (/srv/rev_0001/vllm): not rolled out by it; no later check runs it again: "
        "roll it out by hand"
    )
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid), "the hook's own child outlived it"


def test_a_hook_that_ends_in_time_leaves_what_it_started_in_the_background_running(tmp_path, monkeypatch, capsys):
    """Only a hook still running at the timeout is killed: one that starts a server in the background and exits
    (nohup vllm serve ... &) leaves it serving."""
    from draftsmith.monitor import check as monitor_check
    from draftsmith.monitor.state import State

    directory, child = tmp_path / "monitor", tmp_path / "child.pid"
    State(deployed={"export": "/srv/rev_0001/vllm", "revision": 1, "baseline": "r"}).save(directory)
    monkeypatch.setattr(monitor_check, "check", lambda cfg, held: held(Outcome.PROMOTED) or Outcome.PROMOTED)
    monkeypatch.setattr(monitor_check, "summary", lambda cfg, outcome: "monitor: promoted")
    hook = f"sleep 60 > /dev/null 2>&1 & echo $! > {child}"
    args = [f"output_dir={tmp_path}", f"monitor.state_dir={directory}", f"monitor.redeploy_command='{hook}'"]
    result = run_entry_in_process(["-m", "monitor", "check", "recipe=medusa", *args], capsys)
    pid = int(child.read_text())
    try:
        assert result.returncode == 12 and result.stderr.strip() == ""
        assert not gone(pid)
    finally:
        os.kill(pid, 9)


def test_monitor_redeploy_timeout_s_must_be_positive(tmp_path, capsys):
    assert load_recipe(["recipe=medusa"]).monitor.redeploy_timeout_s == 600
    result = run_entry_in_process(
        ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path}", "monitor.redeploy_timeout_s=0"], capsys
    )
    assert_one_line_error(result, 2, "monitor.redeploy_timeout_s=0.0 must be > 0", alone=True)
