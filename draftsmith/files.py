"""Small file helpers shared by every stage."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from draftsmith.errors import UserError, one_line


def cache_root() -> Path:
    """Where draftsmith caches what it derives (tokenized data, converted sources, dequantized targets):
    DRAFTSMITH_CACHE, else ~/.cache/draftsmith."""
    return Path(os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith").expanduser()


def file_sha256(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except PermissionError:
        raise cannot_read(path) from None


def cannot_read(path: Path) -> UserError:
    """The line for an input the user gave that exists but that its permissions forbid reading: bad input
    (exit 2, fix the permissions or give another path), not an I/O fault of the disk."""
    return UserError(f"cannot read {path}: permission denied")


def require_readable(path: Path) -> None:
    """Refuse a file its permissions forbid reading before a reader that misreports it opens it (safetensors says
    "No such file or directory" of a file it may not read)."""
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        raise cannot_read(path) from None


def checkpoint_digest(directory: Path) -> str:
    """The sha256 of a drafter checkpoint as a whole: of every file under `directory` (its config.json
    and weights, a Medusa-2 adapter), each named by its relative path; hidden files (a job lock) aside.
    What an export records as its source, so a changed config is a changed source too."""
    directory = Path(directory)
    listing = "".join(
        f"{path.relative_to(directory).as_posix()} {file_sha256(path)}\n"
        for path in sorted(directory.rglob("*"))
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(directory).parts)
    )
    return hashlib.sha256(listing.encode()).hexdigest()


def read_json(path: Path, what: str = "JSON", advice: str = "") -> Any:
    """A JSON file a stage wrote; one line naming it as `what` when it is not JSON (cut short, edited by hand),
    with `advice`, what to do about it, after."""
    try:
        return json.loads(Path(path).read_text())
    except PermissionError:
        raise cannot_read(path) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:  # RecursionError: no stage nests so deep
        raise UserError(f"{path}: corrupt {what} ({one_line(err)})" + (f"; {advice}" if advice else "")) from None


def require_same_settings(found: dict[str, Any], wanted: dict[str, Any], what: str, advice: str) -> None:
    """Refuse in one line, naming each key whose value differs with both values, when the settings `found`
    recorded with earlier work (`what`: where it is and what it holds) are not the `wanted` ones: going on
    would mix work made two ways. A key one side does not hold reads as None there; `advice` says what to do
    instead."""
    differ = [
        key for key in [*wanted, *(key for key in found if key not in wanted)] if found.get(key) != wanted.get(key)
    ]
    if differ:
        changes = "; ".join(f"{key}: {found.get(key)!r} -> {wanted.get(key)!r}" for key in differ)
        raise UserError(f"{what} with other settings ({changes[:400]}): {advice}")


@contextlib.contextmanager
def replacing(path: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """`<name><suffix>` to write `path`'s content into, renamed over `path` when the block ends, so a reader never
    sees a half-written file. When the block fails the temporary file is removed (a full disk leaves nothing
    half-written behind), and an OSError that names no file (a write's or a flush's) is given `path`, so that
    exit 74's line says where."""
    tmp = path.with_name(path.name + suffix)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:
            err.filename = str(path)
        raise


def append_lines(path: Path, lines) -> None:
    """Append the text `lines` to `path` (created if missing) whole or not at all: a write that fails (a full disk)
    cuts the file back to where it ended, removes a file it created, and names `path` in the error (exit 74's line),
    so a reader of its lines (a resume, the sweep's rows) never meets a half line or an empty file."""
    data = "".join(lines).encode()
    with open(path, "ab", buffering=0) as out:
        start = out.tell()
        try:
            if out.write(data) != len(data):  # an unbuffered write may be cut short instead of failing
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError as err:
            out.truncate(start)
            if start == 0:
                path.unlink(missing_ok=True)
            if err.filename is None:
                err.filename = str(path)
            raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write to `<name>.tmp` and rename into place (`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text)


def write_json(path: Path, value: Any, sort_keys: bool = False) -> None:
    """`value` as indented JSON, one newline after it, through `write_text_atomic`; `sort_keys` for a file whose
    bytes must not depend on the order its dict was built in (an export's: the same inputs give the same bytes)."""
    write_text_atomic(path, json.dumps(value, indent=2, sort_keys=sort_keys) + "\n")


def save_figure_atomic(figure, path: Path) -> None:
    """Save a matplotlib figure as PNG through `<name>.tmp.png` renamed into place (`replacing`; the suffix
    tells matplotlib the format), then close it to free its memory."""
    import matplotlib.pyplot as plt  # only the stages that draw need matplotlib

    with replacing(path, suffix=".tmp.png") as tmp:
        try:
            figure.savefig(tmp, dpi=100)
        finally:
            plt.close(figure)


def save_safetensors(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, a failure of the file system it reports (a full disk: SafetensorError "... No space
    left on device (os error 28)", naming no file) raised as the OSError it is, naming `path`: exit 74's line, as
    Python's own writes give, not an internal error."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file  # imports torch: only the stages that write tensors need it

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from err


def created_file_mode() -> int:
    """The mode a file created now gets (0644 under umask 022), for a file safetensors wrote: it writes
    through a private temporary file, mode 0600, which a job or an engine running as another user could
    not read. os.umask reads the umask only by setting it."""
    umask = os.umask(0o077)
    os.umask(umask)
    return 0o666 & ~umask


def readable_as_created(folder: Path) -> None:
    """Give every file under `folder` at least `created_file_mode()`."""
    mode = created_file_mode()
    for path in folder.rglob("*"):
        if path.is_file():
            path.chmod(stat.S_IMODE(path.stat().st_mode) | mode)


@contextlib.contextmanager
def staging(directory: Path) -> Iterator[Path]:
    """`<directory>.tmp`, empty, to write a folder into and check before `publish_folder` renames it into
    place; removed if the block ends without publishing it (a refusal, a failed check, a stop)."""
    staged = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staged, ignore_errors=True)
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def publish_folder(staged: Path, directory: Path) -> None:
    """Replace `directory` by the `staged` folder with renames only: a job killed anywhere leaves the
    earlier folder or the new one in place, never a mix. The earlier one is moved to `<name>.old` and
    removed after; a `.old` a killed job left behind is removed first, or the next rename would fail.
    Its files get the umask's mode first (`readable_as_created`). A file of `directory` that `staged` does not hold
    (a user's beside an export's files, a folder exported into it) is moved to `replaced/<time>/` beside it first,
    with a warning: it was removed with the earlier folder."""
    readable_as_created(staged)
    if directory.is_dir() and (kept := [name for name in sorted(directory.rglob("*")) if not name.is_dir()
                                        and not (staged / name.relative_to(directory)).exists()]):  # fmt: skip
        from draftsmith.outputs import move_aside

        moved = move_aside(directory.parent, [name.relative_to(directory.parent).as_posix() for name in kept])
        logging.getLogger("draftsmith.outputs").warning(
            "%s held %d file(s) the new one does not (%s): moved to %s", directory, len(kept), kept[0].name, moved
        )
    old = directory.with_name(directory.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if directory.exists():
        directory.rename(old)
    staged.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
