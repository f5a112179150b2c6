"""Exit codes a scheduler can act on. Each kind of failure is an exception class below and one exit
code, the same in every stage (train, capture, regenerate, eval, export, monitor); run_cli turns it
into one line on stderr. Bad input, and only bad input, exits 2. docs/faults.md has the table."""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import NoReturn


class UserError(Exception):
    """Input the user can fix (a recipe key, a data file, a checkpoint). Reported as one line, exit 2."""


class CheckFailed(Exception):
    """A correctness check on finished work failed: a bug to report (in the drafter's verification, the
    export's conversion or the engine), not bad input; exit EXIT_CHECK_FAILED."""


class NotLossless(CheckFailed):
    """The eval's greedy check found a method whose tokens differ from plain greedy decoding: a bug in
    the drafter's verification, not bad input. The report is written; exit EXIT_CHECK_FAILED."""


class ExportCheckFailed(CheckFailed):
    """The export's check in the real engine failed (its output with the drafter differs from its
    output without, or its acceptance from draftsmith's, or it refused the folder): nothing was
    published; exit EXIT_CHECK_FAILED."""


class TrainingDiverged(Exception):
    """Training stopped because more than `train.max_nonfinite` steps had a non-finite loss or
    gradient, or its weights were not finite at its end (its final checkpoint and final/ not written):
    lower train.lr or remove the batches named, then resume or start over; exit EXIT_DIVERGED."""


class EngineUnavailable(Exception):
    """A serving engine the job needs could not be started or stopped answering: a temporary fault,
    not bad input. What was finished is kept; exit EXIT_UNAVAILABLE, retry the same command."""


class HubUnavailable(Exception):
    """The Hugging Face Hub could not be reached (no network, a timeout, a server error): a temporary fault,
    not bad input; exit EXIT_UNAVAILABLE, retry the same command."""


class StorageError(Exception):
    """An output could not be written (a full disk, a quota, an I/O error, permissions): what was
    finished before is intact; free space and run the same command again (training: with train.resume=true);
    exit EXIT_IO_ERROR."""


class CacheWriteFailed(StorageError):
    """A cache's full or failing disk refused a write (data_prep/cache_faults.py): raised by data_prep, which serves
    several commands, so `outcome` ends its line with the advice of the command that ran (`how_to_continue`)."""


class OutOfMemory(Exception):
    """Memory ran out where the job knows which of its settings asked for it (building the drafter): its line names
    them, not a step's size; exit EXIT_OUT_OF_MEMORY."""


class InternalError(Exception):
    """Something that cannot happen did (a draftsmith bug), as does any exception not above: exit EXIT_INTERNAL."""


class Preempted(BaseException):
    """The job was asked to stop (SIGTERM) and saved what it needs to continue; exit EXIT_PREEMPTED. A BaseException,
    as KeyboardInterrupt is: raised wherever the job is (`stop_on_sigterm`), it must pass the `except Exception` of a
    library call it lands in (yaml's, OmegaConf's, a download's), which turned it into that call's own error."""


class PreemptedWhereItWas(Preempted):
    """SIGTERM's stop outside a loop that stops at its boundary (`stop_on_sigterm`), advised as its command continues
    (`how_to_continue`): a command that knows what it kept says so instead (train: `after_interrupt`)."""


# The exit codes (docs/faults.md): 2 = fix the input; 3 = a correctness check failed (the eval's lossless check, the
# export's engine check: a bug to report); 4 = training diverged; 10/11/12/13 = monitor outcomes (monitor/check.py);
# 69 (EX_UNAVAILABLE) = an engine or the Hugging Face Hub the job needs is down, retry later; 70 (EX_SOFTWARE) = a
# draftsmith bug, traceback in a log file; 71 (EX_OSERR) = out of memory, a device's or the host's, rerun with less a
# step; 74 (EX_IOERR) = an output could not be written (disk full), free space and rerun; 75 (EX_TEMPFAIL) = stopped
# on request after saving, requeue the same command (train.resume=true for training); 130 = Ctrl-C.
EXIT_USER_ERROR = 2
EXIT_CHECK_FAILED = 3
EXIT_DIVERGED = 4
EXIT_UNAVAILABLE = 69
EXIT_INTERNAL = 70
EXIT_OUT_OF_MEMORY = 71
EXIT_IO_ERROR = 74
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130

# OSError numbers that mean the storage failed, not draftsmith: exit EXIT_IO_ERROR wherever they surface.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
# The advice of a line that does not know which command ran: training refuses its own command again (an earlier
# run in output_dir) unless it resumes.
RUN_AGAIN = "run the same command again to continue (a training run: with train.resume=true)"
# command (draftsmith/cli.py's COMMANDS) -> how it continues after a stop that kept what it finished, where that is
# not the same command again
CONTINUE = {
    "train": "run the same command with train.resume=true to continue",
    "monitor": "run the same command again to continue (a retraining it stopped, if any, resumes)",
}
# Python's import system: a frame of one of these on the main thread's stack means that a module is being imported
IMPORT_SYSTEM = frozenset({"importlib._bootstrap", "importlib._bootstrap_external"})
# the stops (signal numbers) that landed inside an import and wait for its end (`outside_imports`)
DEFERRED_STOPS: set[int] = set()
DEBUG_ENV = "DRAFTSMITH_DEBUG"  # set (to anything but 0): an internal error prints its traceback on stderr

# exception class -> (exit code, what the line starts with); the first match in order wins
OUTCOMES: tuple[tuple[type[BaseException], int, str], ...] = (
    (UserError, EXIT_USER_ERROR, "error"),
    (NotLossless, EXIT_CHECK_FAILED, "lossless check failed"),
    (CheckFailed, EXIT_CHECK_FAILED, "check failed"),
    (TrainingDiverged, EXIT_DIVERGED, "training diverged"),
    (EngineUnavailable, EXIT_UNAVAILABLE, "engine unavailable"),
    (HubUnavailable, EXIT_UNAVAILABLE, "Hub unavailable"),
    (StorageError, EXIT_IO_ERROR, "I/O error"),
    (OutOfMemory, EXIT_OUT_OF_MEMORY, "out of memory"),
    (Preempted, EXIT_PREEMPTED, "preempted"),
)


def one_line(err: BaseException | str, limit: int = 300, with_type: bool = False) -> str:
    """An error's text folded onto one line and cut to `limit` characters; `with_type`: led by its class name
    (`KeyError: 'turns'`), for an error whose text alone does not say what went wrong."""
    text = f"{type(err).__name__}: {err}" if with_type else str(err)
    return " ".join(text.split())[:limit]


def close_progress_bars() -> None:
    """End any progress bar a failing job left open, so the error starts a line of its own."""
    from tqdm import tqdm

    for bar in list(tqdm._instances):
        bar.close()


def how_to_continue(command: str) -> str:
    """The advice that ends the line of a `command` stopped with what it finished kept (SIGTERM, a full disk); ""
    (not known) names training's way too."""
    return CONTINUE.get(command, "run the same command again to continue" if command else RUN_AGAIN)


def stop_on_sigterm(signum, frame, command: str = "") -> NoReturn:
    """SIGTERM outside a loop that finishes its unit of work first (`StopRequest`): stop where the
    job is. Every stage publishes by rename, so what it finished is kept and the same command
    continues (regeneration and capture after their last finished part, export from its checks).
    run_cli binds `command`, the one that runs, for the line's advice."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM during the unwinding kills
    raise PreemptedWhereItWas(f"stopped on SIGTERM; what was finished is kept: {how_to_continue(command)}")


def stop_would_be_lost(frame: FrameType | None) -> bool:
    """Whether a stop raised in `frame` (the main thread's, where a signal's handler runs) would be lost: inside an
    import, or inside a finalizer (`__del__`), whose exceptions Python prints as "Exception ignored in" and drops (a
    regex pattern's, collected while random_target built its model: the command went on and exited 0)."""
    while frame is not None:
        if frame.f_globals.get("__name__") in IMPORT_SYSTEM or frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def outside_imports(stop: Callable[[int, FrameType | None], object]) -> Callable[[int, FrameType | None], None]:
    """A signal's handler that raises (`stop`: Ctrl-C's KeyboardInterrupt, SIGTERM's Preempted), run once the main
    thread imports no module and runs no finalizer (`stop_would_be_lost`). Raised inside an import (torch's,
    transformers' lazy ones: seconds, early in every command), the stop was swallowed by a library (the command went
    on, exit 0), or it left numpy half-imported for the next import to fail on (`internal error ... Could not import
    module 'LlamaConfig'`, exit 70); inside a finalizer Python drops it."""

    def after_the_import(signum: int) -> None:
        main = threading.main_thread().ident
        while stop_would_be_lost(sys._current_frames().get(main)):
            time.sleep(0.01)
        try:
            DEFERRED_STOPS.remove(signum)
        except KeyError:  # raised already, where the command ended (`raise_deferred_stop`)
            return
        signal.pthread_kill(main, signum)  # a real signal: it ends a sleep or a wait the main thread went on to

    def handler(signum: int, frame: FrameType | None) -> None:
        if not stop_would_be_lost(frame):
            stop(signum, frame)
        elif signum not in DEFERRED_STOPS:  # a second one meanwhile is the same stop
            DEFERRED_STOPS.add(signum)
            threading.Thread(target=after_the_import, args=(signum,), daemon=True).start()

    return handler


class StopRequest:
    """SIGTERM for a loop that must finish what it is doing first (a training step and its checkpoint, a
    monitor check): while `on_sigterm()` is entered, SIGTERM only sets `requested` (and logs `note`), and
    the loop stops at its next boundary; elsewhere `stop_on_sigterm` stops the job where it is."""

    def __init__(self, note: str = ""):
        self.note = note
        self.requested = False

    @contextlib.contextmanager
    def on_sigterm(self) -> Iterator[StopRequest]:
        def handler(signum, frame) -> None:
            if self.note:
                logging.getLogger("draftsmith").warning(self.note)
            self.requested = True

        previous = signal.signal(signal.SIGTERM, handler)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)


def run_cli(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None, command: str = "") -> NoReturn:
    """Run an entry point; each exception above becomes one line on stderr and its exit code (`outcome`),
    and SIGTERM becomes Preempted (exit 75) wherever the job is (`stop_on_sigterm`); `command` (cli.py's
    COMMANDS, "" for another entry point) chooses the advice of the lines that say how to continue. Ctrl-C and
    SIGTERM wait for the end of an import they land in (`outside_imports`). Once the command is over and its code
    decided, SIGTERM is ignored, and no handler is put back: the process ends here, and its interpreter's shutdown
    (thread joins, atexit) takes up to a second, in which a SIGTERM would end it as 143 and lose what the command
    decided (a scheduler acts on `monitor check`'s 12)."""
    freeze_heap_at_exit()
    sys.exit(_run(main, list(sys.argv[1:] if argv is None else argv), command))


@functools.cache  # once a process, however many commands run in it
def freeze_heap_at_exit() -> None:
    """The interpreter's last garbage collections walk the whole heap (torch, transformers, a model: 1-3 s an exit
    of a CLI process, measured) to free memory the process gives back anyway; frozen at exit (an atexit handler
    registered before the commands' own, so run after them), they walk none of it. Files and writers are closed by
    the code that opened them, not left to a collection."""
    atexit.register(gc.freeze)


def _run(main: Callable[[Sequence[str]], object], argv: list[str], command: str) -> int | str | None:
    spare_line = out_of_memory_line(MemoryError(), command)  # exit 71's, made while memory is to spare
    try:
        # inside the try: a Ctrl-C landing while the handlers go in is its line too, not a traceback (it was, in CI);
        # SIGINT's first, so that a process seen handling SIGTERM handles both
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not an ignored one (a background job's)
            signal.signal(signal.SIGINT, outside_imports(signal.default_int_handler))
        signal.signal(signal.SIGTERM, outside_imports(functools.partial(stop_on_sigterm, command=command)))
        try:
            main(argv)
        finally:
            raise_deferred_stop()
        _command_over()
    except SystemExit as stop:  # a command that states its own code (`monitor check`'s 10-13)
        _command_over()
        return stop.code
    except BrokenPipeError:
        _command_over()
        # stdout's reader stopped reading (`--help | head`): nothing failed here, and nothing more can be
        # said on stdout; pointed at /dev/null so that the interpreter's last flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (Exception, Preempted, KeyboardInterrupt) as err:  # noqa: BLE001 - every failure: one line, its exit code
        _command_over()
        close_progress_bars()  # the line of its own, not the tail of a progress bar's
        err = stop_behind(err) or err
        if isinstance(err, KeyboardInterrupt):
            print(f"interrupted: {err}" if str(err) else "interrupted", file=sys.stderr)  # with a command's advice
            return EXIT_INTERRUPTED
        release_locals(err)
        try:
            code, line = outcome(err, command)
        except MemoryError:  # deciding takes memory too (an import, a log file): the error's own class then decides
            code, line = EXIT_OUT_OF_MEMORY, spare_line  # where none is left for its own line either
            with contextlib.suppress(MemoryError):
                code, line = classified(err, command) or (EXIT_OUT_OF_MEMORY, out_of_memory_line(err, command))
        print(line, file=sys.stderr)
        return code
    return 0


def release_locals(err: BaseException) -> None:
    """Let go of what the failed work's frames held (a model half built, a batch), which its traceback and those of
    the errors it was raised from kept alive: memory exhausted by ten million modules stayed exhausted while the exit
    code was decided, whose own import then failed (exit 1, three tracebacks). A traceback is still written from
    them: it names code and lines, not values."""
    for link in exception_chain(err):
        traceback.clear_frames(link.__traceback__)  # the frame still running (this one's caller) is left as it is


def exception_chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and the errors it was raised from (its cause, else its context), each once: a chain made into a loop by
    hand would otherwise be walked forever."""
    seen: set[int] = set()
    link: BaseException | None = err
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or link.__context__


def stop_behind(err: BaseException) -> KeyboardInterrupt | Preempted | None:
    """The stop (Ctrl-C's KeyboardInterrupt, SIGTERM's Preempted) that `err` is, or was raised while it unwound, if
    any: a library's cleanup that failed on the work the stop left half done replaced it (OmegaConf's `AttributeError:
    'NoneType' object has no attribute '_invalidate_flags_cache'`: exit 70, for a job that was asked to stop)."""
    return next((link for link in exception_chain(err) if isinstance(link, (KeyboardInterrupt, Preempted))), None)


def raise_deferred_stop() -> None:
    """Raise a stop that waited for the end of an import (`outside_imports`) and that its poll has not raised yet: a
    command that ended right after the import (a refusal, a last step) exited 2 or 0 for a job asked to stop."""
    for signum in list(DEFERRED_STOPS):
        try:
            DEFERRED_STOPS.remove(signum)
        except KeyError:  # its poll raised it meanwhile
            continue
        signal.raise_signal(signum)


def _command_over() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the exit code is decided (run_cli)


def outcome(err: BaseException, command: str = "") -> tuple[int, str]:
    """The exit code of an exception that ended `command` (run_cli's) and the one line that says so. A PermissionError
    is bad input (a file or folder the user gave) and an OSError of the storage (STORAGE_ERRNOS) an I/O error
    wherever it was raised; anything unexpected is a draftsmith bug, its traceback written to a log file (or to
    stderr with DRAFTSMITH_DEBUG=1)."""
    # wherever a model or file was asked of the Hub: a network fault, not the input; a stop that landed while a
    # failed request was handled is the stop
    if not isinstance(err, Preempted) and hub_unreachable(err):
        err = HubUnavailable(
            f"{one_line(err, limit=2000).rstrip('.')}; run the same command again when the Hub can be reached, or "
            "give a local folder (or set HF_HUB_OFFLINE=1 to read the Hub cache only)"
        )
    known = classified(err, command)
    if known is not None:
        return known
    if out_of_memory(err):  # the job's size, not draftsmith: the most common failure of a GPU run
        return EXIT_OUT_OF_MEMORY, out_of_memory_line(err, command)
    if isinstance(err, PermissionError):  # a path the user gave that this user may not use: fix it, no retry helps
        where = f"cannot access {os.fsdecode(err.filename)}" if err.filename else "cannot access a file"  # bytes too
        return EXIT_USER_ERROR, f"error: {where}: permission denied; fix its permissions or give another path"
    if isinstance(err, OSError) and err.errno in STORAGE_ERRNOS:
        reason = storage_reason(err.errno, err.filename)  # a call of two paths (a rename) names its first
        return EXIT_IO_ERROR, f"I/O error: {reason}; free space (or fix the disk) and {how_to_continue(command)}"
    return (
        EXIT_INTERNAL,
        f"internal error (a draftsmith bug, please report it): {one_line(err, with_type=True)}; {traceback_kept(err)}",
    )


def out_of_memory_line(err: BaseException, command: str) -> str:
    """Exit 71's line: what failed (its class where it says nothing: Python's MemoryError) and what to give less of."""
    return (
        f"out of memory: {one_line(err) or type(err).__name__}; give each step less (a smaller "
        "train.micro_batch_size with a larger train.grad_accum keeps the step; a shorter data.max_length; fewer "
        "eval.batch_sizes or data.regenerate.batch_size), or more memory (target.shard=fsdp over several GPUs), and "
        f"{how_to_continue(command)}"
    )


def classified(err: BaseException, command: str) -> tuple[int, str] | None:
    """The exit code and line of an error of one of draftsmith's own classes (OUTCOMES), None for any other."""
    if isinstance(err, CacheWriteFailed):  # its raiser does not know the command
        return EXIT_IO_ERROR, f"I/O error: {one_line(err, limit=2000)}, and {how_to_continue(command)}"
    return next(
        ((code, f"{prefix}: {one_line(err, limit=2000)}") for cls, code, prefix in OUTCOMES if isinstance(err, cls)),
        None,
    )


# what torch's allocators say when they cannot allocate: CUDA's torch.OutOfMemoryError, the CPU's and MPS's RuntimeError
OUT_OF_MEMORY_SAID = ("out of memory", "can't allocate memory")


def out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocation that failed: Python's MemoryError, or torch's (a RuntimeError subclass on CUDA,
    a RuntimeError on a CPU), torch imported only if the job imported it."""
    torch = sys.modules.get("torch")
    if isinstance(err, MemoryError) or (torch is not None and isinstance(err, torch.OutOfMemoryError)):
        return True
    return isinstance(err, RuntimeError) and any(said in str(err) for said in OUT_OF_MEMORY_SAID)


def space_left(path: str | os.PathLike) -> str | None:
    """`N MiB free` on the file system that holds `path` (its nearest folder that exists: the file a full disk refused
    is often removed, or never made), None where it cannot be read. A full disk's line says it: the disk may have room
    again, or the file system that filled may not be the one the user looked at (a cache on another disk)."""
    try:
        folder = os.path.abspath(os.fsdecode(path))
        while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
        return f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free"
    except (OSError, TypeError):  # TypeError: an OSError's filename may be a file descriptor
        return None


def storage_reason(number: int, path: str | os.PathLike | None, named: bool = True) -> str:
    """What the storage answered (an errno of STORAGE_ERRNOS) for the line: `no space left on device (PATH, N MiB
    free)`, the `path` named unless the line names it elsewhere (`named` False), and a full disk's room left."""
    left = space_left(path) if path and number == errno.ENOSPC else None
    details = ([os.fsdecode(path)] if path and named else []) + ([left] if left else [])
    return os.strerror(number).lower() + (f" ({', '.join(details)})" if details else "")


def hub_unreachable(err: BaseException) -> bool:
    """Whether `err` (or an error it was raised from, as transformers and draftsmith's own lines wrap it) is
    huggingface_hub's "not in the cache" after a request that failed (no network, a timeout). With
    HF_HUB_OFFLINE=1 no request is made, and a file not cached is bad input (`hub_cache_miss`)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:  # a miss is raised in the context of the cache's own lookups (a revision not there)
        return False
    miss = hub_cache_miss(err)
    return miss is not None and (miss.__cause__ or miss.__context__) is not None


def hub_cache_miss(err: BaseException) -> BaseException | None:
    """huggingface_hub's "not in the cache" in `err`'s chain, if it is there: raised from the request that
    failed, or from nothing when HF_HUB_OFFLINE=1 made none."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    return next((link for link in exception_chain(err) if isinstance(link, LocalEntryNotFoundError)), None)


def traceback_kept(err: BaseException) -> str:
    """Where the traceback of an internal error went: stderr with DRAFTSMITH_DEBUG=1, else a log file."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    if os.environ.get(DEBUG_ENV, "0") not in ("", "0"):
        sys.stderr.write(text)
        return "the traceback is above"
    try:
        fd, path = tempfile.mkstemp(prefix=f"draftsmith-error-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            f.write(" ".join(sys.argv) + "\n\n" + text)
    except OSError:
        return f"rerun with {DEBUG_ENV}=1 to print the traceback"
    return f"traceback in {path} (or rerun with {DEBUG_ENV}=1 to print it)"
