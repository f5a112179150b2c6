"""Entry points and other work run in processes forked from the test process, sharing its imports: a started
`python train.py` (or `-m eval`, ...) imports torch, transformers, accelerate and draftsmith again, about 6-8 s of CPU
a process.

`ForkedEntry` (a `ForkedCall` of an entry point) is a killed or signalled entry point (Popen's pid, send_signal/kill,
poll, wait and communicate); the test's subject is what the product does on the stop (its checkpoint, exit code and
line, nothing half-written), not the interpreter's start, which tests/test_signals_start.py stops in. `run_forked`
runs one to its end, for a command that must not change the test process (a benchmark that sets torch's threads and
runs the profiler, an import that only the command may see). `forked_ranks` is the ranks of a one-node CPU launch
(RANK, WORLD_SIZE, MASTER_*: torch's env:// rendezvous over gloo) of any work, `run_forked_ranks` of an entry point,
for a test that compares a launch with a reference run of the same entry point: it launches what it tests and forks
the reference.

The child is made what a fresh process is for what these tests see: the stop signals as a foreground process has
them (SIGTERM's default, SIGINT's KeyboardInterrupt; a test process that ran a command in-process ignores SIGTERM),
no Python handler of pytest's, a root logger without pytest's handlers (the command's log lines go to its stderr),
accelerate's state and torch's process group unset, one torch thread (OpenMP's pool does not survive a fork: after a
parent ran two threads, a child at two hangs in libgomp, at one it runs), and output of its own. Warnings stay in
pytest's record, unprinted. It never returns into pytest's code: it ends with `os._exit` and the work's exit code (no
atexit handler of the test process runs; draftsmith closes what it opens, and its threads are daemons), or dies of a
signal (returncode -N, as Popen's). A fork copies the locks other threads held: a child still running after `timeout`
seconds is killed (-9) rather than left to hang the suite."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

STOPS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}  # a foreground process's


def _one_thread(set_num_threads: Callable[[int], None], threads: int) -> None:
    """torch.set_num_threads in a forked child: one thread, whatever it asks (a benchmark's --threads, a forked rank's
    share of the cores). GNU OpenMP is not fork-safe: a child forked from a test process that ran two threads (`-n 0`
    on two cores, an xdist worker on eight) hung in its first parallel region (benchmarks/packing.py's default
    --threads 2: 300 s, then killed), while under xdist on two cores, whose workers run one, it passed."""
    set_num_threads(1)


def _become_fresh(env: dict[str, str]) -> None:
    """In the child: what the test process changed that the entry point reads, back as a fresh process has it."""
    import faulthandler
    import logging

    import torch
    from accelerate.state import AcceleratorState, GradientState

    for signum in signal.valid_signals():  # pytest's and xdist's handlers; C-level ones (getsignal None) stay
        if callable(signal.getsignal(signum)) and signum not in STOPS:
            signal.signal(signum, signal.SIG_DFL)
    for signum, handler in STOPS.items():
        signal.signal(signum, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    faulthandler.disable()
    threading.excepthook, sys.unraisablehook = threading.__excepthook__, sys.__unraisablehook__
    root = logging.getLogger()
    for handler in root.handlers[:]:  # pytest's capture; run_entry_in_process adds the command's own
        root.removeHandler(handler)
    os.environ.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **env)
    torch.set_num_threads(1)
    torch.set_num_threads = partial(_one_thread, torch.set_num_threads)
    # tqdm's write lock: a multiprocessing RLock, a semaphore the fork shares with the test process, and a thread lock
    # another of its threads may hold as it forks. A child killed (SIGKILL) while writing a bar left the semaphore
    # held, and the test process's next bar waited for it forever (tests/test_faults.py's in-process resume): the
    # child's own, for tqdm and every subclass holding a lock of its own (get_lock keeps it on the class it is asked
    # of: tqdm.auto's, whose bars transformers 5.25 draws as it loads a model, and huggingface_hub's)
    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock

    TqdmDefaultWriteLock.mp_lock, TqdmDefaultWriteLock.th_lock = multiprocessing.RLock(), threading.RLock()
    fresh, classes = TqdmDefaultWriteLock(), [tqdm]
    while classes:
        cls = classes.pop()
        if cls is tqdm or "_lock" in vars(cls):
            cls.set_lock(fresh)
        classes.extend(cls.__subclasses__())
    assert not torch.distributed.is_initialized()  # a test process holds no group
    AcceleratorState._reset_state(reset_partial_state=True)  # nor its Accelerator: the child's own
    GradientState._reset_state()


def _child(work: Callable[[], int], env: dict[str, str], outputs: list) -> None:
    code = 1
    try:
        for fd, output in zip((1, 2), outputs):
            os.dup2(output.fileno(), fd)
        # unbuffered as with PYTHONUNBUFFERED: a progress bar's "\r" updates are on stderr as they are drawn
        sys.stdout, sys.stderr = (
            io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True, write_through=True)
            for fd in (1, 2)
        )
        _become_fresh(env)
        code = work()
    except KeyboardInterrupt:  # uncaught, as the interpreter ends: by the signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - printed as the interpreter does, exit 1
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def entry_point(args: list[str]) -> int:
    from tests.helpers import REPO, run_entry_in_process

    os.chdir(REPO)
    return run_entry_in_process(args).returncode


class ForkedCall:
    """`work()` (its return value the exit code) in a child forked from this process, its stdout and stderr each to a
    file of its own (or both to `log`), `env` added to its environment; `args` name it in a TimeoutExpired."""

    def __init__(self, work: Callable[[], int], args=(), env: dict[str, str] | None = None, log: Path | None = None,
                 timeout=300.0):  # fmt: skip
        self.args, self.returncode = args, None
        self._outputs = [open(log, "w+b")] * 2 if log else [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            _child(work, env or {}, self._outputs)
        self._ended = threading.Event()
        self._deadline = threading.Timer(timeout, self.kill)
        self._deadline.daemon = True
        self._deadline.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        _, status = os.waitpid(self.pid, 0)  # not WUNTRACED: a SIGSTOP'd child is still running
        self.returncode = os.waitstatus_to_exitcode(status)
        self._deadline.cancel()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # never a pid reaped and perhaps reused
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """What the child has written so far to its stdout and its stderr."""
        return tuple(
            os.pread(output.fileno(), os.fstat(output.fileno()).st_size, 0).decode(errors="replace")
            for output in self._outputs
        )

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()


class ForkedEntry(ForkedCall):
    """`python *args` (a script, or `-m module`, as `run_entry_in_process` takes them) as a child forked from this
    process, run from the repository root."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None, log: Path | None = None, timeout=300.0):
        super().__init__(partial(entry_point, args), args, env, log, timeout)


def run_forked(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """`args` run to their end in a `ForkedEntry`: its exit code and output, as `subprocess.run` gives a process's."""
    entry = ForkedEntry(args, timeout=timeout)
    out, err = entry.communicate()
    return subprocess.CompletedProcess(args, entry.returncode, out, err)


def forked_ranks(
    work: Callable[[], int], world: int, logs: Path | None = None, timeout: float = 180
) -> list[ForkedCall]:
    """`work` on `world` forked ranks, each with the variables a launcher gives it (each rank's output in `logs`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    return [
        ForkedCall(
            work,
            env={
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
            },
            log=None if logs is None else logs / f"rank{rank}.log",
            timeout=timeout,
        )
        for rank in range(world)
    ]


def run_forked_ranks(args: list[str], logs: Path, world: int = 2, timeout: float = 180) -> subprocess.CompletedProcess:
    """`args` (an entry point) on `world` forked ranks (`forked_ranks`): the worst exit code, rank 0's output as stdout
    and every rank's as stderr."""
    ranks = forked_ranks(partial(entry_point, args), world, logs, timeout)
    codes = [rank.wait() for rank in ranks]
    texts = [rank.output()[0] for rank in ranks]
    return subprocess.CompletedProcess(args, max(codes, key=abs), texts[0], "".join(texts))
