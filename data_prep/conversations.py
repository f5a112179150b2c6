"""Read chat conversations from local files, globs, directories or Hub data sets into one
normalized `datasets.Dataset`, each record validated and normalized by data_prep/records.py; a file the builders
reject, or text that is not valid UTF-8, is named here by its line.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional

import datasets
import psutil
from datasets.table import CastError

from draftsmith.data_prep.cache_faults import hugging_face_caches, raise_cache_fault
from draftsmith.data_prep.local_files import builder, file_digest, gzipped, source_files
from draftsmith.data_prep.records import normalize_record, normalize_records, warn_of_turn_order_oddities
from draftsmith.data_prep.sources import is_named, named_file
from draftsmith.errors import HubUnavailable, OutOfMemory, UserError, one_line
from draftsmith.hub_cache import endpoint_out_of_reach

logger = logging.getLogger("draftsmith.data")
# a folder or glob of more files than this is one line, not a line a file (a sharded dump of 100,000 files)
FILES_LOGGED_ONE_BY_ONE = 10


def load_conversations(
    sources: list[str],
    max_conversations: Optional[int] = None,
    prompts_only: bool = False,
    skip_invalid_utf8: bool = False,
    digests: Optional[dict[str, str]] = None,
) -> datasets.Dataset:
    """Load and validate conversations from every source, in order.

    A source is a local `.jsonl`, `.ndjson`, `.json` (each optionally `.gz`) or `.parquet` file (any case), a
    glob, a directory (searched recursively for such files; the others are named in a warning), a named
    standard data set (`named:sharegpt`, `named:mt_bench`: data_prep/sources.py), or a Hub data set id,
    optionally `id@revision:split` (default: main, split `train`; offline, read from the datasets cache or else the
    Hub cache's copy of it). Each file of a glob or directory counts as its own source:
    `max_conversations` keeps the first N records of each. Any invalid record raises a UserError naming the source and
    the 1-based record number. `prompts_only` (the eval's prompts) also accepts conversations that end
    with a user turn and have no answer yet. A line that is not valid UTF-8 is a UserError naming the
    file and line, or, with `skip_invalid_utf8` (recipe key data.skip_invalid_utf8), a record skipped
    and counted in a warning (JSON-lines files; records keep their numbers in the file). `digests`: the files' sha256
    a training start has read already, where each file read is added (local_files.file_digest).
    """
    if isinstance(sources, str):  # a bare string would otherwise be read character by character
        sources = [sources]
    if not sources:
        raise UserError("no conversation sources given (data.train / data.eval are empty)")
    if max_conversations is not None and max_conversations < 1:
        raise UserError(f"data.max_conversations={max_conversations} must be at least 1 (or null for all)")
    parts = []
    for source in sources:
        loaders = _expand(str(source), skip_invalid_utf8, digests)
        for name, loader in loaders:
            dataset = loader()
            if max_conversations is not None and len(dataset) > max_conversations:
                dataset = dataset.select(range(max_conversations))
            parts.append(_normalize_utf8(dataset, name, prompts_only, skip_invalid_utf8))
            if len(loaders) <= FILES_LOGGED_ONE_BY_ONE:
                logger.info("loaded %d conversations from %s", len(parts[-1]), name)
            warn_of_turn_order_oddities(parts[-1], name)
        if len(loaders) > FILES_LOGGED_ONE_BY_ONE:
            read = sum(len(part) for part in parts[-len(loaders) :])
            logger.info("loaded %d conversations from %d files of %s", read, len(loaders), source)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _expand(
    source: str, skip_invalid_utf8: bool = False, digests: Optional[dict[str, str]] = None
) -> list[tuple[str, Any]]:
    """Resolve one source string into (name, loader) pairs: one per local file (local_files.source_files), or one
    named data set, or one Hub split."""
    files = source_files(source)
    if files is not None:
        return [(path, lambda path=path: _load_file(path, skip_invalid_utf8, digests)) for path in files]
    if is_named(source):
        path = str(named_file(source))
        return [(source, lambda: _load_file(path, skip_invalid_utf8, digests))]
    return [(source, lambda: _load_hub(source))]


def _load_hub(source: str) -> datasets.Dataset:
    repo, _, split = source.partition(":")
    repo, _, revision = repo.partition("@")
    split, revision = split or "train", revision or None
    # one quick request first: datasets would retry its own for about 25 s, logging every try, before reading its
    # cache all the same
    out_of_reach = None if datasets.config.HF_HUB_OFFLINE else endpoint_out_of_reach(datasets.config.HF_ENDPOINT)
    copy = None
    try:
        with _datasets_offline(out_of_reach is not None):
            dataset = datasets.load_dataset(repo, split=split, revision=revision)
    except ConnectionError as err:  # datasets' line for a Hub it could not reach, the request's error dropped
        # offline, datasets reads its own processed cache alone: the files `hf download --repo-type dataset` left in
        # the Hub cache are read as the local folder they are
        copy = _hub_cache_copy(repo, revision) if out_of_reach is not None or datasets.config.HF_HUB_OFFLINE else None
        if copy is None and out_of_reach is not None:  # not in the caches, which alone were read
            raise HubUnavailable(
                f"cannot load data set {repo!r} (split {split!r}): ConnectionError: Couldn't reach {repo!r} on the "
                f"Hub ({one_line(out_of_reach, with_type=True)}); run the same command again when the Hub can be "
                "reached, or give local files"
            ) from None
        if copy is None and datasets.config.HF_HUB_OFFLINE:  # no request was made: not cached is the input's fault
            raise UserError(
                f"data set {source!r} is in neither the datasets cache nor the Hub cache, and HF_HUB_OFFLINE=1 forbids "
                "downloading it: download it once with a network, or give local files"
            ) from None
        if copy is None:
            raise HubUnavailable(
                f"cannot load data set {repo!r} (split {split!r}): {one_line(err, with_type=True)}; run the same "
                "command again when the Hub can be reached, or give local files"
            ) from None
    except Exception as err:  # auth, unknown repo or split: the user's to fix (a Hub out of reach further on
        # leaves huggingface_hub's error in the chain, which errors.hub_unreachable finds)
        raise_cache_fault(err, *hugging_face_caches())
        raise UserError(f"cannot load data set {repo!r} (split {split!r}): {one_line(err, with_type=True)}") from err
    if copy is not None:
        logger.info("reading data set %s from the Hub cache's copy of it (%s)", source, copy)
        try:
            dataset = datasets.load_dataset(str(copy), split=split)
        except Exception as err:  # a split the files do not hold, files no builder reads
            raise_cache_fault(err, *hugging_face_caches())
            raise UserError(
                f"cannot load data set {repo!r} (split {split!r}) from the Hub cache's copy of it ({copy}): "
                f"{one_line(err, with_type=True)}"
            ) from err
    if len(dataset) == 0:
        raise UserError(f"data set {source!r} has no records")
    return dataset


def _hub_cache_copy(repo: str, revision: Optional[str]) -> Optional[Path]:
    """The Hub cache's snapshot of data set `repo` at `revision` (None: main), where one is there."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, repo_type="dataset", revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


@contextlib.contextmanager
def _datasets_offline(offline: bool) -> Iterator[None]:
    """With `offline`, datasets reads its cache alone, as with HF_HUB_OFFLINE=1: it has no per-call way to (its
    DownloadConfig.local_files_only is not consulted where it looks a data set up on the Hub)."""
    kept = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = kept or offline
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = kept


def _load_file(
    path: str, skip_invalid_utf8: bool = False, digests: Optional[dict[str, str]] = None
) -> datasets.Dataset:
    """The file's records as its builder reads them, known by the file's content. datasets knows a local file by
    its path and modification time alone (data_files.py, _get_single_origin_metadata), so a file edited with its
    time kept (cp -p, rsync -a, tar x) would load its old parse, and the normalization and tokenized caches keyed
    on that fingerprint would follow. Naming the builder config after the bytes' sha256 puts each content in its
    own cache folder, and the fingerprint is the bytes' and the parser's alone: datasets' own also follows the
    modification time, so the same bytes copied or restored read as other data (a capture refused to resume, the
    tokenized cache missed). Cost: the file read once more, 0.65 s per GB on a 2-core AMD EPYC (SHA-NI,
    page-cached), once a training start (`digests`: its other reads of the file reuse the digest)."""
    reader = builder(path)
    if reader == "parquet" and _parquet_rows(path) == 0:  # the builder fails on it ("BatchSize must be > 0")
        raise UserError(f"{path} has no records")
    size = _refuse_lines_arrow_crashes_on(path) if reader == "json" else None
    content = file_digest(path, digests)
    try:
        try:
            with _quiet_builders():
                dataset = datasets.load_dataset(reader, name=f"sha256-{content}", data_files=path, split="train")
        except Exception as err:
            if not isinstance(err.__cause__, CastError) or size is None:
                raise
            # datasets' JSON builder takes a file's columns from its first 10 MiB (its chunksize): a key that first
            # appears later (a regenerated answer's `cut`, a `domain`) failed its cast of the next 10 MiB. Read as
            # one chunk, the columns are every record's (its memory: the whole file parsed at once)
            _require_room_to_read_whole(path, size, err.__cause__)
            with _quiet_builders():
                whole = {"name": f"sha256-{content}-whole", "chunksize": size + 1}
                dataset = datasets.load_dataset(reader, data_files=path, split="train", **whole)
    except OutOfMemory:
        raise
    except Exception as err:  # the builders raise assorted types (ArrowInvalid, StopIteration on empty files, ...)
        raise_cache_fault(err, *hugging_face_caches())
        if reader == "json":
            _diagnose_json(path, skip_invalid_utf8)  # raises the precise, line-numbered error when it finds one
        raise UserError(f"cannot read {path}: {one_line(err, with_type=True)}") from None
    if len(dataset) == 0:
        raise UserError(f"{path} has no records")
    dataset._fingerprint = hashlib.sha256(f"{reader}|{content}|{datasets.__version__}".encode()).hexdigest()[:16]
    return dataset


# the peak memory of datasets' JSON builder reading a file as one chunk, in bytes per byte of the file: 6.6 measured
# (98 MB of conversations, 0.65 GB; read 10 MiB at a time, 1.9)
WHOLE_READ_MEMORY = 7


def _require_room_to_read_whole(path: str, size: int, cast: CastError) -> None:
    """Refuse a whole read that would need more memory than is available: the kernel would kill it (exit 137, no
    line), as a 3 GB file's 20 GB parse would on a 24 GB machine. (A container's memory limit is not seen here.)"""
    need, available = size * WHOLE_READ_MEMORY, psutil.virtual_memory().available
    if need > available:
        late = sorted(set(cast.table_column_names) - set(cast.requested_column_names))  # none: a nested key
        named = f" ({', '.join(late)})" if late else ""
        raise OutOfMemory(
            f"{path}: records past its first 10 MiB have keys the first ones lack{named}, and read whole, so that "
            "every record's keys are columns, "
            f"it would take about {need / 2**30:.1f} GiB of memory, {available / 2**30:.1f} GiB available; give those "
            "keys in its first record (null where a record has none)"
        )


def _refuse_lines_arrow_crashes_on(path: str) -> Optional[int]:
    """pyarrow's JSON reader (26.0) crashes the process, SIGSEGV and no line, on a `null` line that starts a block it
    parses (the file's first, or the first of any later 10 MiB batch of datasets' builder), and on JSON nested some
    10,000 levels deep: every line that is `null` is refused as the record it is, and one that opens MAX_NESTING
    arrays or objects in a row, before the builder reads the file. One more read of it, regular expressions over
    16 MiB at a time (2.9 s for 254 MiB on a 2-core AVX2 EPYC, a quarter of it the nesting). The bytes read,
    decompressed; None where the file cannot be read."""
    opener = gzip.open if gzipped(path) else open
    lines, tail, size = 0, b"", 0  # lines before `tail`, the part line the last chunk ended in
    try:
        with opener(path, "rb") as handle:
            while chunk := handle.read(16 << 20):
                size += len(chunk)
                text = tail + chunk
                cut = text.rfind(b"\n") + 1  # whole lines now, the rest with the next chunk
                text, tail = text[:cut], text[cut:]
                _refuse_line(path, text, lines)
                lines += text.count(b"\n")
    except (OSError, EOFError, zlib.error):
        return None  # the builder's read says what is wrong
    _refuse_line(path, tail + b"\n", lines)
    return size


def _refuse_line(path: str, text: bytes, lines: int) -> None:
    """`text`: whole lines of `path`, `lines` lines into it."""
    if found := NULL_LINE.search(text):
        line = lines + text.count(b"\n", 0, found.start()) + 1
        raise UserError(f"{path}:{line}: a record that is null, not a JSON object")
    for number, line in enumerate(text.split(b"\n"), lines + 1):  # the pattern only where it can match: 10 times faster
        if line.count(b"[") + line.count(b"{") >= MAX_NESTING and DEEP_NESTING.search(JSON_STRING.sub(b'""', line)):
            raise UserError(f"{path}:{number}: {DEEP}")


NULL_LINE = re.compile(rb"^(?:\xef\xbb\xbf)?[ \t]*null[ \t\r]*,?[ \t\r]*$", re.MULTILINE)
MAX_NESTING = 500  # no conversation nests so deep; pyarrow crashes near 10,000, Python's JSON parser stops near 1,000
# MAX_NESTING arrays or objects opened in a row, a key before each (the way a chain of nesting is written)
DEEP_NESTING = re.compile(rb'(?:[\[{][ \t\r\n]*(?:"[^"\n]*"[ \t\r\n]*:[ \t\r\n]*)?){%d}' % MAX_NESTING)
JSON_STRING = re.compile(rb'"(?:[^"\\\n]|\\.)*"')  # brackets inside a string (a message's text) nest nothing
DEEP = f"JSON nested more than {MAX_NESTING} levels deep, which no conversation is"


def _parquet_rows(path: str) -> Optional[int]:
    """The rows a parquet file's footer counts (an empty file: none); None for a file that is not parquet."""
    import pyarrow.parquet as pq

    if os.path.getsize(path) == 0:
        return 0
    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # noqa: BLE001 - not parquet, or unreadable: the builder's own error says which
        return None


@contextlib.contextmanager
def _quiet_builders() -> Iterator[None]:
    """The JSON and parquet builders log their error before raising (`Failed to read file ...`); we report it, or
    a better one, on one line. And a local file's load asks nothing of the network: datasets sends a HEAD request
    to count a download of its packaged builder on every load_dataset (HF_UPDATE_DOWNLOAD_COUNTS), 0.14 s a file
    on a machine without a network (a regeneration's folder of 300 parts: 42 s of a 45 s read), a round trip with."""
    loggers = [logging.getLogger(f"datasets.packaged_modules.{name}.{name}") for name in ("json", "parquet")]
    levels = [builder_logger.level for builder_logger in loggers]
    counts = datasets.config.HF_UPDATE_DOWNLOAD_COUNTS
    for builder_logger in loggers:
        builder_logger.setLevel(logging.CRITICAL)
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = counts
        for builder_logger, level in zip(loggers, levels):
            builder_logger.setLevel(level)


def _diagnose_json(path: str, skip_invalid_utf8: bool = False) -> None:
    """Rescan a file the JSON builder rejected and raise a UserError at the first problem found:
    a line that is not valid UTF-8 (`path:LINE: invalid UTF-8`; skipped with `skip_invalid_utf8` in
    JSON lines), a malformed line (`path:LINE: malformed JSON`), a non-object record, an invalid record
    (e.g. a content of the wrong type, which breaks Arrow's type inference), or no records."""
    opener = gzip.open if gzipped(path) else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError) as err:
        raise UserError(f"cannot read {path}: {one_line(err, with_type=True)}") from None
    except zlib.error as err:  # a gzip file damaged inside: exit 70 before
        raise UserError(f"cannot read {path}: a damaged gzip file ({one_line(err)})") from None
    numbered = None
    if raw.lstrip().startswith(b"["):  # one JSON document holding a list of records
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            lineno, start = raw.count(b"\n", 0, err.start) + 1, raw.rfind(b"\n", 0, err.start) + 1
            raise UserError(
                f"{path}:{lineno}: {_utf8_problem(err, start)}; fix that line (data.skip_invalid_utf8 skips records"
                " of JSON-lines files only, and this file is one JSON document)"
            ) from None
        try:
            numbered = list(enumerate(json.loads(text), 1))
        except RecursionError:
            raise UserError(f"{path}: {DEEP}") from None
        except json.JSONDecodeError as err:
            if err.msg != "Extra data":  # else JSON lines whose first record is an array: read as lines below
                raise UserError(f"{path}:{err.lineno}: malformed JSON ({err.msg} column {err.colno})") from None
    if numbered is None:  # JSON lines; blank lines are skipped like the builder does
        numbered, record = [], 0
        for lineno, raw_line in enumerate(raw.split(b"\n"), 1):
            if not raw_line.strip():
                continue
            record += 1
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as err:
                if skip_invalid_utf8:
                    continue
                raise UserError(f"{path}:{lineno}: {_utf8_problem(err)}; {UTF8_HINT}") from None
            try:
                numbered.append((record, json.loads(line)))
            except RecursionError:
                raise UserError(f"{path}:{lineno}: {DEEP}") from None
            except json.JSONDecodeError as err:
                # the parser's message ends "starting at", "expecting ..." before its position: the column said
                raise UserError(f"{path}:{lineno}: malformed JSON ({err.msg} column {err.colno})") from None
    if not numbered:
        raise UserError(f"{path} has no records")
    for number, record in numbered:
        if not isinstance(record, dict):
            raise UserError(f"{path} record {number}: expected a JSON object, got {type(record).__name__}")
        normalize_record(record, source=path, number=number)


UTF8_HINT = "fix or remove that line, or set data.skip_invalid_utf8=true to skip such records and count them"


def _utf8_problem(err: UnicodeDecodeError, line_start: int = 0) -> str:
    """`invalid UTF-8 (byte 0xff at byte 12 of the line)`, for a decode error over a line (or over a
    whole file whose current line starts at `line_start`)."""
    return f"invalid UTF-8 (byte 0x{err.object[err.start]:02x} at byte {err.start - line_start + 1} of the line)"


def _invalid_utf8_lines(path: str) -> Iterator[tuple[int, int, UnicodeDecodeError]]:
    """(line number, record number, error) of every line of a JSON-lines file that is not valid UTF-8;
    records are counted over the non-blank lines, as the JSON builder numbers its rows."""
    opener = gzip.open if gzipped(path) else open
    record = 0
    with opener(path, "rb") as handle:
        for lineno, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record += 1
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                yield lineno, record, err


def _normalize_utf8(
    dataset: datasets.Dataset, source: str, prompts_only: bool, skip_invalid_utf8: bool
) -> datasets.Dataset:
    """`normalize_records`, with text that is not valid UTF-8 found and named. Arrow's JSON reader takes such
    bytes into its strings without complaint; they fail only when a record is read, here. Then the file
    is scanned for its invalid lines: the first is a UserError naming the file and line, or with
    `skip_invalid_utf8` every such record is left out (the others keep their record numbers) and the
    count is logged. Clean files pay nothing for the check."""
    try:
        return normalize_records(dataset, source, prompts_only)
    except UnicodeDecodeError as err:
        if builder(source) != "json" or not os.path.isfile(source):
            raise UserError(
                f"{source}: a record holds text that is not valid UTF-8 ({one_line(err, with_type=True)})"
            ) from None
        found = _invalid_utf8_lines(source)
        bad = {record: (lineno, error) for lineno, record, error in found if record <= len(dataset)}
        if not bad:
            raise UserError(
                f"{source}: a record holds text that is not valid UTF-8 ({one_line(err, with_type=True)})"
            ) from None
    if not skip_invalid_utf8:
        lineno, error = bad[min(bad)]
        raise UserError(f"{source}:{lineno}: {_utf8_problem(error)}; {UTF8_HINT}")
    keep = [index for index in range(len(dataset)) if index + 1 not in bad]
    lines = [lineno for lineno, _ in bad.values()]
    shown = ", ".join(map(str, lines[:10])) + (", ..." if len(lines) > 10 else "")
    logger.warning(
        "%s: skipped %d record(s) that are not valid UTF-8 (data.skip_invalid_utf8=true), on line(s) %s",
        source,
        len(bad),
        shown,
    )
    if not keep:
        raise UserError(f"{source}: every record is invalid UTF-8 (lines {shown}), so none is left")
    return normalize_records(dataset.select(keep), source, prompts_only, numbers=[index + 1 for index in keep])
