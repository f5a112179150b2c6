"""The local files a data source names (`source_files`: what the load reads, and what a resume compares by
content), and the `datasets` builder that reads each: a file, a glob, or a folder searched recursively. The files a
glob or folder holds that are not read are named in one warning, as a file named directly with their suffix is
refused; a symbolic link among them named as data that leads to no file (a missing one, or a loop of links) is
refused, as a missing file named directly is."""

from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path
from typing import Optional

from draftsmith.data_prep.sources import is_named
from draftsmith.errors import UserError
from draftsmith.files import file_sha256

logger = logging.getLogger("draftsmith.data")

# Suffix -> `datasets` builder. Checked with endswith so that `.jsonl.gz` is recognized, and on the lower-cased
# name: the builders read `UPPER.JSONL`, `.ndjson` (JSON lines by another name) and `X.JSON.GZ` alike (the JSON
# builder takes JSON lines or one array whatever the name, and finds gzip by its bytes).
FILE_BUILDERS = {
    ".jsonl": "json",
    ".jsonl.gz": "json",
    ".ndjson": "json",
    ".ndjson.gz": "json",
    ".json": "json",
    ".json.gz": "json",
    ".parquet": "parquet",
}
# What a regeneration records beside its part files (data_prep/regenerate.py): not a data suffix, and a folder
# source skips it without naming it
REGENERATE_SETTINGS = "regenerate.settings"
OWN_RECORD_NAMES = frozenset({REGENERATE_SETTINGS})


def builder(path: str) -> Optional[str]:
    """The `datasets` builder that reads the file, by its suffix; None for a suffix draftsmith does not read."""
    name = path.lower()
    return next((reader for suffix, reader in FILE_BUILDERS.items() if name.endswith(suffix)), None)


def gzipped(path: str) -> bool:
    return path.lower().endswith(".gz")


def suffixes() -> str:
    return "/".join(FILE_BUILDERS)


def files_matching(pattern: str, source: str) -> list[str]:
    """The data files the glob matches, sorted (recursive `**`); refused where it matches none."""
    every = sorted(glob.glob(pattern, recursive=True))
    _refuse_broken_links(f"data source {source!r}", every)
    matched = [path for path in every if os.path.isfile(path)]
    files = [path for path in matched if builder(path) is not None]
    _warn_not_read(f"data source {source!r}", [path for path in matched if path not in files])
    if not files:
        raise UserError(f"data source {source!r} matches no {suffixes()} file")
    return files


def files_under(local: str, source: str) -> list[str]:
    """The data files anywhere under the folder, sorted; refused where it holds none. A folder in it that this
    process may not list is refused: a walk that skipped it would leave its files out of the data without a word
    (the folder itself: it would say the source holds no data file)."""

    def refuse(err: OSError) -> None:
        if not isinstance(err, PermissionError):
            raise err
        named = source if os.path.samefile(err.filename, local) else err.filename
        raise UserError(f"cannot read data directory {named!r}: permission denied")

    files, others = [], []
    for root, folders, names in os.walk(local, onerror=refuse):
        folders.sort()
        _refuse_broken_links(f"data directory {source!r}", [os.path.join(root, name) for name in sorted(names)])
        for path in (os.path.join(root, name) for name in names if os.path.isfile(os.path.join(root, name))):
            (files if builder(path) is not None else others).append(path)
    _warn_not_read(f"data directory {source!r}", others, local)
    if not files:
        raise UserError(f"data directory {source!r} holds no {suffixes()} file")
    _require_finished_regeneration(local, source)
    return sorted(files)


def _require_finished_regeneration(local: str, source: str) -> None:
    """A regeneration's folder (data_prep/regenerate.py) is read once all its parts are written: one still being
    written, or left by a stopped run, holds some of its conversations, and training on them said nothing of the rest
    (a capture's is refused alike until its manifest.json). A record of an earlier draftsmith counts no parts."""
    try:
        parts = json.loads(Path(local, REGENERATE_SETTINGS).read_text()).get("parts")
    except (OSError, ValueError, AttributeError):  # no record (another folder), or one its regeneration refuses
        return
    written = len(glob.glob(os.path.join(glob.escape(local), "part-*.jsonl.gz")))
    if isinstance(parts, int) and written < parts:
        raise UserError(
            f"data directory {source!r} is a regeneration that has not finished ({written} of its {parts} parts "
            f"written): run its regenerate command again to finish it, or give data.train=[{source}/part-*.jsonl.gz] "
            "to train on the parts written"
        )


def _refuse_broken_links(what: str, paths: list[str]) -> None:
    """Refuse the first path with a data suffix that is a symbolic link to no file: read as no file at all, it was
    left out of the data without a word."""
    for path in paths:
        if builder(path) is not None and os.path.islink(path) and not os.path.exists(path):
            raise UserError(
                f"{what}: {path} is a symbolic link that leads to no file ({os.readlink(path)}: missing, or a loop "
                "of links): restore what it links to, or remove it"
            )


def _warn_not_read(what: str, paths: list[str], folder: Optional[str] = None) -> None:
    """One warning naming the files a folder or glob holds that are not read (the first ten; relative to the
    folder), so that data under a suffix draftsmith does not read is not left out without a word."""
    names = [
        os.path.relpath(path, folder) if folder else path
        for path in sorted(paths)
        if os.path.basename(path) not in OWN_RECORD_NAMES
    ]
    if names:
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        logger.warning("%s: %d file(s) not read, their suffix not %s: %s", what, len(names), suffixes(), shown)


def file_digest(path: str | os.PathLike, digests: Optional[dict[str, str]] = None) -> str:
    """The sha256 of the file at `path`: from `digests` (path -> sha256, what the caller's training start has
    read already) where it is there, else read, and added to it. The caller owns it, one per start: a long `monitor
    watch` retrains in one process, and each retraining must see the files as they are then."""
    if digests is None:
        return file_sha256(Path(path))
    key = os.path.abspath(path)
    if key not in digests:
        digests[key] = file_sha256(Path(path))
    return digests[key]


def source_files(source: str) -> Optional[list[str]]:
    """The local files one data source names, in the order they are read: the file, or the data files a glob matches
    or a folder holds (`files_matching`, `files_under`); None for a data set read by its name, a named one
    (data_prep/sources.py) or a Hub data set id, `owner/name[:split]`. A UserError where it names local data that
    cannot be read: nothing at all, a path that does not exist, a file of a suffix not read, no data file."""
    if not source.strip():  # `data.train=` on a command line: not the Hub's data set '', which fails obscurely
        raise UserError("a data source is empty: give a file, a folder, a glob or a Hub data set id")
    if is_named(source):
        return None
    local = os.path.expanduser(source)
    if any(char in source for char in "*?["):
        return files_matching(local, source)
    if os.path.isdir(local):
        return files_under(local, source)
    if os.path.isfile(local):
        if builder(local) is None:
            raise UserError(f"data file {source!r} has an unsupported format (expected {suffixes()})")
        return [local]
    if builder(source) is not None or source.startswith((".", "/", "~")):  # a path, never a Hub data set id
        raise UserError(f"data file {source!r} does not exist")
    return None


def local_content(sources, digests: Optional[dict[str, str]] = None) -> Optional[list[str]]:
    """The sha256 of each local file a data setting (`data.train`, `data.draft_vocab`: a source or a list of
    them) reads (`source_files`, as data_prep/conversations.py reads them); a named data set or a Hub data set by its
    name (whose bytes are read from its package or the Hub, not from a path given). None where a source names local
    data that cannot be read here (a path moved away, a glob or folder that holds no data file now), whose content is
    not known. `digests`: those already read (`file_digest`)."""
    content = []
    for source in map(str, [sources] if isinstance(sources, str) else sources):
        try:
            files = source_files(source)
        except UserError:
            return None
        content += [source] if files is None else [file_digest(path, digests) for path in files]
    return content
