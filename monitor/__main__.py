"""`python -m monitor check recipe=NAME [key=value ...]` runs one check (for cron, a systemd timer or a
Kubernetes CronJob); `python -m monitor watch ...` checks every monitor.interval_s seconds until
stopped (SIGTERM ends it, exit 75: a check in progress as it ends `check`; Ctrl-C, exit 130).

Exit codes (monitor.Outcome): 0 healthy, 10 drift (waiting), 11 retrained but not promoted,
12 retrained and promoted (redeploy), 13 re-verify: the engine is not the one the export was checked
in (nothing was judged; the line says what to run), 2 bad input, 69 an engine that does not answer
or answers with a server error (temporary: retry), 75 stopped on SIGTERM (during a retraining: the
next check resumes it; `watch`: a check in progress stops as `check` does), and as every command 3, 4, 70,
74 (docs/faults.md). `watch` exits only on bad input or a signal; an engine that does not answer is one
line (`engine unavailable: ...`) and the next check tries again, and so is a Hugging Face Hub out of reach
(`Hub unavailable: ...`: a one-off `check` exits 69) and a state directory another check holds
(`monitor: check skipped: ... is in use by another job ...`: a one-off `check` there exits 2). After a
check that exits 12, both run monitor.redeploy_command where one is set (monitor/redeploy.py).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from draftsmith.errors import (
    EngineUnavailable,
    HubUnavailable,
    Preempted,
    StopRequest,
    UserError,
    hub_unreachable,
    one_line,
)


def main(argv: Sequence[str]) -> None:
    # imported here, under entry_point's run_cli: Ctrl-C or SIGTERM during their imports ends as later
    from draftsmith.cli import DATA_LINES_SAID, SUBCOMMANDS
    from draftsmith.engines import ANSWERED

    if list(argv[:1]) not in SUBCOMMANDS:
        # `draftsmith monitor ...` (the console script, or python -m draftsmith) has the command in argv[1]
        program = "draftsmith monitor" if sys.argv[1:2] == ["monitor"] else "python -m monitor"
        raise UserError(f"usage: {program} {'|'.join(name for (name,) in SUBCOMMANDS)} recipe=NAME [key=value ...]")
    from draftsmith.outputs import DirectoryInUse
    from draftsmith.recipe import load_recipe

    cfg = load_recipe(argv[1:], "monitor")
    from draftsmith.monitor import Outcome
    from draftsmith.monitor.check import check, state_dir_of, summary
    from draftsmith.monitor.redeploy import run_redeploy_command
    from draftsmith.recipe_checks import require_export_settings_read

    require_export_settings_read(cfg.export)

    def reported(outcome: Outcome) -> None:  # the state directory still held: no other check overlaps the hook
        print(summary(cfg, outcome), flush=True)
        if outcome == Outcome.PROMOTED and cfg.monitor.redeploy_command:
            run_redeploy_command(cfg.monitor.redeploy_command, state_dir_of(cfg), cfg.monitor.redeploy_timeout_s)

    def checked() -> Outcome:
        DATA_LINES_SAID.forget()  # each check's log says what it read
        ANSWERED.clear()  # and asks the engine's environment again: it may have been upgraded since the last
        return check(cfg, held=reported)

    if argv[0] == "check":
        sys.exit(int(checked()))
    stop = StopRequest()
    while not stop.requested:
        try:  # SIGTERM during a check stops it as it stops `check` (a retraining resumes at the next check)
            checked()
        except EngineUnavailable as err:  # temporary: the next check tries again
            print(f"engine unavailable: {one_line(err, limit=2000)}", file=sys.stderr, flush=True)
        except DirectoryInUse as err:  # another check (a cron `check`) is running: this interval's is skipped
            print(
                f"monitor: check skipped: {one_line(err, limit=2000)}; the next one is in {cfg.monitor.interval_s:g} s",
                file=sys.stderr,
                flush=True,
            )
        except Exception as err:
            # the Hub out of reach (for the target, or the data of a retraining) is temporary as an engine is; it is
            # found as `check`'s exit code finds it (errors.outcome), in the error's chain
            if not (isinstance(err, HubUnavailable) or hub_unreachable(err)):
                raise
            print(
                f"Hub unavailable: {one_line(err, limit=2000)}; the next check is in {cfg.monitor.interval_s:g} s",
                file=sys.stderr,
                flush=True,
            )
        with stop.on_sigterm():
            deadline = time.monotonic() + cfg.monitor.interval_s
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(1.0)
    raise Preempted("stopped on SIGTERM between checks; run the same command again to go on watching")


if __name__ == "__main__":
    from draftsmith.cli import configure_logging, entry_point

    configure_logging()
    entry_point(main, __doc__, command="monitor")
