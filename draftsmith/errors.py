"""Bad input is the user's problem to fix, not ours to debug: one line on stderr and exit code 2."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class UserError(Exception):
    """Input the user can fix (a recipe key, a data file, a checkpoint). Reported as one line, exit 2."""


class EngineUnavailable(Exception):
    """A serving engine the job needs could not be started or stopped answering: a temporary fault,
    not bad input. What was finished is kept; exit EXIT_ENGINE_UNAVAILABLE, retry the same command."""


class NotLossless(Exception):
    """The eval's greedy check found a method whose tokens differ from plain greedy decoding: a bug in
    the drafter's verification, not bad input. The report is written; exit EXIT_NOT_LOSSLESS."""


class Preempted(Exception):
    """The job was asked to stop (SIGTERM) and saved what it needs to continue; exit EXIT_PREEMPTED."""


# Exit codes a scheduler can act on: 2 = fix the input; 3 = the eval's lossless check failed (a bug to
# report, the report is written); 69 (EX_UNAVAILABLE) = an engine the job needs is
# down, retry later; 75 (EX_TEMPFAIL) = stopped on request after saving a checkpoint, requeue the same
# command (train.resume=true for training).
EXIT_USER_ERROR = 2
EXIT_NOT_LOSSLESS = 3
EXIT_ENGINE_UNAVAILABLE = 69
EXIT_PREEMPTED = 75


def one_line(err: BaseException | str, limit: int = 300) -> str:
    """An error's text folded onto one line and cut to `limit` characters."""
    return " ".join(str(err).split())[:limit]


def close_progress_bars() -> None:
    """End any progress bar a failing job left open, so the error starts a line of its own."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):
        bar.close()


def stop_on_sigterm(signum, frame) -> None:
    """SIGTERM outside a training loop (which installs its own, to checkpoint first): stop where the
    job is. Every stage publishes by rename, so what it finished is kept and the same command
    continues (regeneration and capture after their last finished part, export from its checks)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the unwinding kills
    raise Preempted("stopped on SIGTERM; what was finished is kept: run the same command again to continue")


def run_cli(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> NoReturn:
    """Run an entry point; each exception above becomes one line on stderr and its exit code, and
    SIGTERM becomes Preempted (exit 75) wherever the job is (`stop_on_sigterm`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, stop_on_sigterm)
    try:
        _run(main, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(main: Callable[[Sequence[str]], object], argv: list[str]) -> NoReturn:
    try:
        main(argv)
    except UserError as err:
        close_progress_bars()
        print(f"error: {one_line(err, limit=2000)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except NotLossless as err:
        close_progress_bars()
        print(f"lossless check failed: {one_line(err, limit=2000)}", file=sys.stderr)
        sys.exit(EXIT_NOT_LOSSLESS)
    except EngineUnavailable as err:
        close_progress_bars()
        print(f"engine unavailable: {one_line(err, limit=2000)}", file=sys.stderr)
        sys.exit(EXIT_ENGINE_UNAVAILABLE)
    except Preempted as err:
        close_progress_bars()
        print(f"preempted: {one_line(err, limit=2000)}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)
