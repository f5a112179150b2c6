"""Output directories: one writer per directory, and nothing of an earlier run deleted implicitly.

Every job that writes (train, capture, regenerate, eval, export, the monitor's pipeline) holds
`DirectoryLock` on the directory it writes before it writes anything. The lock is a file,
`.draftsmith.lock`, holding who holds it (pid, host, start time, command) and an advisory `flock` on
it: the kernel drops the flock when the holder dies, even by `kill -9`, so a lock whose holder is gone
is recognised and taken over (with a warning), and a live holder is never overridden. flock is local
to a host's kernel; on a network file system that does not forward it, two hosts are not excluded.
A directory that cannot be created (a file in its path, a read-only or special file system) is bad
input (`check_output_dir`): checked by the recipe check for each output key given, and by the lock for
the directory it takes, a key's default included.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from draftsmith.errors import STORAGE_ERRNOS, UserError, one_line

LOCK_NAME = ".draftsmith.lock"
REPLACED_DIR = "replaced"  # where train.overwrite=true moves an earlier run
# What a run publishes in its output_dir that other stages read (docs/outputs.md), by these names only.
# What each data setting read when the run began (trainer/resume_checks.py), beside its recipe.yaml: a resume
# compares the bytes its recipe names now with these, not with what the run's paths hold today (a file edited since)
DATA_CONTENT_NAME = "data_content.json"
RECIPE_NAME = "recipe.yaml"  # the resolved recipe of the run (and of an eval, beside its report)
FINAL_DIR = "final"  # the trained drafter
LOG_NAME = "log.jsonl"  # a row per logged step
RUN_SUMMARY_NAME = "run_summary.json"
EVAL_DIR = "eval"  # the eval report's folder
ACCURACY_NAME = "eval_accuracy.json"  # the eval split's teacher-forced accuracy, trained against untrained
REPORT_NAME = "report.json"  # the eval report, in EVAL_DIR

log = logging.getLogger("draftsmith.outputs")


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def check_output_dir(path: str | os.PathLike, key: str = "output_dir", named: Optional[str] = None) -> None:
    """An output directory (the recipe key `key`; `named`: how the message names it, default `key='path'`)
    must be creatable: its nearest existing ancestor is a directory we can create entries in (probed with
    a temporary directory, removed at once)."""
    named = named or f"{key}={str(path)!r}"
    target = Path(path).expanduser().absolute()
    if target.exists():
        if not target.is_dir():
            raise UserError(f"{named} exists and is not a directory")
    ancestor = target
    while not ancestor.exists():
        if ancestor.is_symlink():  # a link to nothing: mkdir fails on it as on a file that exists
            leads = "is a loop of symbolic links" if loops(ancestor) else f"links to {os.readlink(ancestor)}, missing"
            raise UserError(f"{named} cannot be created: {ancestor} {leads}")
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{named} cannot be created: {ancestor} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".draftsmith-probe-", dir=ancestor))
    except OSError as err:
        if err.errno in STORAGE_ERRNOS and err.errno != errno.EROFS:  # a full or failing disk: exit 74, not 2
            raise
        reason = err.strerror or one_line(err)
        if ancestor == target:  # the folder is there: it is its writing that is refused, not its making
            raise UserError(f"{named} exists but cannot be written in: {reason}") from None
        raise UserError(f"{named} cannot be created under {ancestor}: {reason}") from None


def check_output_folders(directory: Path, names: list[str]) -> None:
    """The folders `names` of `directory` a job writes into again, those that exist (a resumed run's `tb/`,
    `checkpoints/`, `eval/`), can be written in, probed as `check_output_dir` does: bad input before anything loads
    (a read-only `tb/` failed in TensorBoard's writer thread once the data had loaded, its traceback around the
    line)."""
    for name in names:
        if (directory / name).is_dir():
            check_output_dir(directory / name, named=f"{directory / name} (in output_dir)")


def loops(path: Path) -> bool:
    """Whether following `path`'s symbolic links runs into a loop of them (which `Path.exists` reads as missing)."""
    try:
        path.stat()
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


class DirectoryInUse(UserError):
    """Another job holds the directory's lock: bad input to a one-off command; a loop (`monitor watch`) waits."""


class DirectoryLock:
    """Exclusive use of `directory` by this process (see the module docstring). Use as a context
    manager or with acquire()/release(). A failed start (an exception while held) leaves no trace:
    the lock file goes, and the directory too if acquiring created it and it is still empty. `key`: the
    recipe key the directory is the value or the default of, named when it cannot be created."""

    def __init__(self, directory: str | os.PathLike, key: Optional[str] = None):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.command = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])  # what a job it refuses is told
        self.key = key
        self._fd: Optional[int] = None
        self._created: list[Path] = []  # directories acquire() created, innermost first

    def acquire(self) -> DirectoryLock:
        if self._fd is not None:  # already held by this object
            return self
        # bad input, not a bug: the recipe check saw the keys given, not their defaults under output_dir
        check_output_dir(self.directory, named=f"{self.directory} ({self.key})" if self.key else str(self.directory))
        missing = self.directory
        while not missing.exists():
            self._created.append(missing)
            missing = missing.parent
        self.directory.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(_read_holder(fd))
                os.close(fd)
                self._undo_created_directory()
                raise DirectoryInUse(
                    f"{self.directory} is in use by another job ({holder}); wait for it to finish or use another "
                    "directory"
                ) from None
            # The file we locked must still be the one at the path: a releasing holder unlinks it, and
            # a lock on an unlinked file excludes nobody.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        previous = _read_holder(fd)
        if previous:
            log.warning(
                "taking over the lock of %s in %s: that job is gone (killed or crashed)",
                _describe(previous),
                self.directory,
            )
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": utc_stamp(), "command": self.command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def _undo_created_directory(self) -> None:
        for directory in self._created:
            try:
                directory.rmdir()  # only if still empty
            except OSError:
                break
        self._created = []

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, kind, value, traceback) -> None:
        failed_start = kind is not None and bool(self._created) and _only_lock_inside(self.directory)
        self.release()
        if failed_start:
            self._undo_created_directory()


@contextlib.contextmanager
def held_by_main_process(
    directory: str | os.PathLike, state, check: Optional[Callable[[], None]] = None, key: Optional[str] = None
) -> Iterator[None]:
    """A multi-process job's hold on `directory` (`state`: accelerate's PartialState; `key` as for
    DirectoryLock): the main process locks it and runs `check` (which may refuse with a UserError); every
    rank learns the outcome before any rank writes, and all of them raise the same one-line error on failure."""
    lock, error = None, None
    if state.is_main_process:
        lock = DirectoryLock(directory, key=key)
        try:
            lock.acquire()
            if check is not None:
                check()
        except UserError as err:
            lock.__exit__(UserError, err, None)  # releases, and removes what acquire created
            lock, error = None, str(err)
    if state.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise UserError(error)
    if lock is None:
        yield
        return
    with lock:
        yield


def _read_holder(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace")
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {"unreadable": True}


def _describe(holder: dict) -> str:
    if not holder or holder.get("unreadable"):
        return "holder unknown"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started')}: {holder.get('command')}"


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _only_lock_inside(directory: Path) -> bool:
    try:
        return {p.name for p in directory.iterdir()} <= {LOCK_NAME}
    except OSError:
        return False


def move_aside(directory: Path, names: list[str]) -> Optional[Path]:
    """Move the entries `names` of `directory` (paths relative to it; those that exist) into
    `directory/replaced/<UTC time>/` (`<UTC time>-2/` for a second move within that second), each at the same
    relative path, and return that folder; None if none existed. Nothing is deleted."""
    present = [name for name in names if (directory / name).exists()]
    if not present:
        return None
    stamp, moves = utc_stamp(), 1
    while True:
        destination = directory / REPLACED_DIR / (stamp if moves == 1 else f"{stamp}-{moves}")
        try:
            destination.mkdir(parents=True, exist_ok=False)
            break
        except FileExistsError:  # two quick evals' reports, moved within one second
            moves += 1
    for name in present:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)  # a nested entry keeps its folders
        shutil.move(str(directory / name), str(destination / name))
    return destination
