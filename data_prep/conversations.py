"""Read chat conversations from local files, globs, directories or Hub data sets into one
normalized `datasets.Dataset`.

Every record becomes `{"messages": [{"role", "content", ...}, ...], "domain", "source", "record"}` (a turn also
holds its reasoning, cut mark and tool calls, None where it has none: data_prep/turns.py):
`source` is the file path (or Hub id) it came from and `record` its 1-based position there, so
that any later stage (tokenization, the eval) can point the user at the offending record.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import inspect
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import datasets

from draftsmith.data_prep.local_files import builder, file_digest, files_matching, files_under, gzipped, suffixes
from draftsmith.data_prep.sources import is_named, named_file
from draftsmith.data_prep.turns import CUT_KEY as CUT_KEY  # re-exported: regenerate, monitor, benchmarks read them
from draftsmith.data_prep.turns import REASONING_KEYS as REASONING_KEYS
from draftsmith.data_prep.turns import ROLES as ROLES
from draftsmith.data_prep.turns import TURN_FEATURES, normalize_turn
from draftsmith.errors import HubUnavailable, UserError, cache_fault, one_line, storage_fault
from draftsmith.model_files import endpoint_out_of_reach

logger = logging.getLogger("draftsmith.data")

DEFAULT_DOMAIN = "default"
FEATURES = datasets.Features(
    {
        "messages": datasets.List(TURN_FEATURES),
        "domain": datasets.Value("string"),
        "source": datasets.Value("string"),
        "record": datasets.Value("int64"),
    }
)


def code_digest(*paths: str | os.PathLike) -> str:
    """sha256 of source files' bytes, in order: the part of a cache's key that follows the code that wrote it."""
    return hashlib.sha256(b"".join(Path(path).read_bytes() for path in paths)).hexdigest()


# datasets fingerprints a module-level map function by reference, not by its code, so an edit to
# the normalization below (or a turn's, data_prep/turns.py) would otherwise reuse stale map caches (and stale
# tokenized caches, whose key builds on this fingerprint). Hashing both files' bytes ties the fingerprint to the code.
_CODE_HASH = code_digest(__file__, inspect.getfile(normalize_turn))


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
    optionally `id:split` (default split `train`). Each file of a glob or directory counts as its own source:
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
        for name, loader in _expand(str(source), skip_invalid_utf8, digests):
            dataset = loader()
            if max_conversations is not None and len(dataset) > max_conversations:
                dataset = dataset.select(range(max_conversations))
            parts.append(_normalize_utf8(dataset, name, prompts_only, skip_invalid_utf8))
            logger.info("loaded %d conversations from %s", len(parts[-1]), name)
            _count_turn_order_oddities(parts[-1], name)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _expand(
    source: str, skip_invalid_utf8: bool = False, digests: Optional[dict[str, str]] = None
) -> list[tuple[str, Any]]:
    """Resolve one source string into (name, loader) pairs: one per local file, or one Hub split."""
    if not source.strip():  # `data.train=` on a command line: not the Hub's data set '', which fails obscurely
        raise UserError("a data source is empty: give a file, a folder, a glob or a Hub data set id")
    if is_named(source):
        path = str(named_file(source))
        return [(source, lambda: _load_file(path, skip_invalid_utf8, digests))]
    local = os.path.expanduser(source)
    if any(char in source for char in "*?["):
        files = files_matching(local, source)
    elif os.path.isdir(local):
        files = files_under(local, source)
    elif os.path.isfile(local):
        if builder(local) is None:
            raise UserError(f"data file {source!r} has an unsupported format (expected {suffixes()})")
        files = [local]
    elif builder(source) is not None or source.startswith((".", "/", "~")):
        raise UserError(f"data file {source!r} does not exist")
    else:  # not a local path: a Hub data set id, `owner/name[:split]`
        return [(source, lambda: _load_hub(source))]
    return [(path, lambda path=path: _load_file(path, skip_invalid_utf8, digests)) for path in files]


def _load_hub(source: str) -> datasets.Dataset:
    repo, _, split = source.partition(":")
    split = split or "train"
    # one quick request first: datasets would retry its own for about 25 s, logging every try, before reading its
    # cache all the same
    out_of_reach = None if datasets.config.HF_HUB_OFFLINE else endpoint_out_of_reach(datasets.config.HF_ENDPOINT)
    try:
        with _datasets_offline(out_of_reach is not None):
            dataset = datasets.load_dataset(repo, split=split)
    except ConnectionError as err:  # datasets' line for a Hub it could not reach, the request's error dropped
        if out_of_reach is not None:  # not in the cache, which alone was read
            raise HubUnavailable(
                f"cannot load data set {repo!r} (split {split!r}): ConnectionError: Couldn't reach {repo!r} on the "
                f"Hub ({one_line(out_of_reach, with_type=True)}); run the same command again when the Hub can be "
                "reached, or give local files"
            ) from None
        if datasets.config.HF_HUB_OFFLINE:  # no request was made: a data set not in the cache is the input's fault
            raise UserError(
                f"data set {repo!r} is not in the datasets cache, and HF_HUB_OFFLINE=1 forbids downloading it: "
                "download it once with a network, or give local files"
            ) from None
        raise HubUnavailable(
            f"cannot load data set {repo!r} (split {split!r}): {one_line(err, with_type=True)}; run the same command "
            "again when the Hub can be reached, or give local files"
        ) from None
    except Exception as err:  # auth, unknown repo or split: the user's to fix (a Hub out of reach further on
        # leaves huggingface_hub's error in the chain, which errors.hub_unreachable finds)
        _raise_cache_fault(err)
        raise UserError(f"cannot load data set {repo!r} (split {split!r}): {one_line(err, with_type=True)}") from err
    if len(dataset) == 0:
        raise UserError(f"data set {source!r} has no records")
    return dataset


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
    content = file_digest(path, digests)
    try:
        with _quiet_builders():
            dataset = datasets.load_dataset(reader, name=f"sha256-{content}", data_files=path, split="train")
    except Exception as err:  # the builders raise assorted types (ArrowInvalid, StopIteration on empty files, ...)
        _raise_cache_fault(err)
        if reader == "json":
            _diagnose_json(path, skip_invalid_utf8)  # raises the precise, line-numbered error when it finds one
        raise UserError(f"cannot read {path}: {one_line(err, with_type=True)}") from None
    if len(dataset) == 0:
        raise UserError(f"{path} has no records")
    dataset._fingerprint = hashlib.sha256(f"{reader}|{content}|{datasets.__version__}".encode()).hexdigest()[:16]
    return dataset


def _raise_cache_fault(err: BaseException) -> None:
    """Raise the line for a load that failed because a cache could not be written (errors.cache_fault): datasets', or
    the Hub's, into which a Hub data set's files are downloaded. It was `cannot read FILE: DatasetGenerationError`,
    the data file blamed for the cache's disk (the file itself was read whole before the load, for its digest)."""
    from huggingface_hub import constants

    fault = storage_fault(err)
    if fault is None:
        return
    cache, variable = datasets.config.HF_DATASETS_CACHE, "HF_DATASETS_CACHE"
    hub = os.path.abspath(constants.HF_HUB_CACHE)
    if fault.filename and os.path.abspath(os.fsdecode(fault.filename)).startswith(hub + os.sep):
        cache, variable = hub, "HF_HUB_CACHE"
    raise cache_fault(fault, "the Hugging Face cache", cache, variable) from None


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
    a better one, on one line."""
    loggers = [logging.getLogger(f"datasets.packaged_modules.{name}.{name}") for name in ("json", "parquet")]
    levels = [builder_logger.level for builder_logger in loggers]
    for builder_logger in loggers:
        builder_logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
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
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{err.lineno}: malformed JSON ({err.msg})") from None
        numbered = list(enumerate(records, 1))
    else:  # JSON lines; blank lines are skipped like the builder does
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
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{lineno}: malformed JSON ({err.msg})") from None
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
    """`_normalize`, with text that is not valid UTF-8 found and named. Arrow's JSON reader takes such
    bytes into its strings without complaint; they fail only when a record is read, here. Then the file
    is scanned for its invalid lines: the first is a UserError naming the file and line, or with
    `skip_invalid_utf8` every such record is left out (the others keep their record numbers) and the
    count is logged. Clean files pay nothing for the check."""
    try:
        return _normalize(dataset, source, prompts_only)
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
    return _normalize(dataset.select(keep), source, prompts_only, numbers=[index + 1 for index in keep])


def _normalize(
    dataset: datasets.Dataset, source: str, prompts_only: bool, numbers: Optional[list[int]] = None
) -> datasets.Dataset:
    """Every row validated and normalized; `numbers`: each row's record number in its file, where
    rows were left out (default: the row's position)."""
    fingerprint = hashlib.sha256(f"{dataset._fingerprint}|{source}|{prompts_only}|{_CODE_HASH}".encode()).hexdigest()[
        :16
    ]
    return dataset.map(
        _normalize_row,
        with_indices=True,
        fn_kwargs={"source": source, "prompts_only": prompts_only, "numbers": numbers},
        remove_columns=dataset.column_names,
        features=FEATURES,
        new_fingerprint=fingerprint,
        desc=f"checking {source}",
    )


def _normalize_row(
    row: dict[str, Any], index: int, source: str, prompts_only: bool, numbers: Optional[list[int]] = None
) -> dict[str, Any]:
    number = index + 1 if numbers is None else numbers[index]
    return normalize_record(row, source=source, number=number, prompts_only=prompts_only)


def normalize_record(record: dict[str, Any], source: str, number: int, prompts_only: bool = False) -> dict[str, Any]:
    """Validate one raw record (messages or ShareGPT shape) and return it normalized; with
    `prompts_only`, a conversation may end with a user turn instead of holding an answer.

    Arrow gives every row all columns of its file, with None for absent ones, so "missing" and
    "None" are treated alike throughout.
    """
    where = f"{source} record {number}"
    turns = record.get("messages")
    if turns is None:
        turns = record.get("conversations")
    if turns is None:
        raise UserError(f"{where}: no 'messages' field (nor a ShareGPT 'conversations' field)")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'messages' must be a non-empty list of turns")
    messages = [normalize_turn(turn, f"{where}: turn {turn_number}") for turn_number, turn in enumerate(turns, 1)]
    if not answered_turns(messages) and not (prompts_only and messages[-1]["role"] == "user"):
        opening = messages[0]["role"] == "assistant"
        raise UserError(
            f"{where}: no assistant turn"
            + (" after the opening one (which nothing before it asks for: kept as context only)" if opening else "")
            + ", so nothing to train on"
            + (" (nor a last user turn to answer)" if prompts_only else "")
        )
    domain = record.get("domain")
    return {
        "messages": messages,
        "domain": DEFAULT_DOMAIN if domain is None or domain == "" else str(domain),
        "source": source,
        "record": number,
    }


def answered_turns(messages: list[dict[str, Any]]) -> list[int]:
    """The positions of the assistant turns that answer the turns before them: what training masks in and
    regeneration rewrites. An opening assistant turn (a chat log's greeting) answers nothing, and no chat
    template renders an empty conversation to show what the model was asked: it stays, as context."""
    return [index for index, message in enumerate(messages) if message["role"] == "assistant" and index > 0]


def _count_turn_order_oddities(dataset: datasets.Dataset, source: str) -> None:
    """Warn, with a count and the first record numbers, about conversations kept as they are though often a
    file joined or cut wrongly: a user turn that follows a user turn (the chat template renders both as the
    user's, and only assistant turns are trained on), and an opening assistant turn (context only, see
    `answered_turns`). Read from the Arrow columns, not row by row."""
    import numpy as np
    import pyarrow.compute as pc

    messages = dataset.data.column("messages").combine_chunks()
    roles = pc.list_flatten(messages).field("role").to_numpy(zero_copy_only=False)
    owners = pc.list_parent_indices(messages).to_numpy()
    repeated = (roles[1:] == "user") & (roles[:-1] == "user") & (owners[1:] == owners[:-1])
    first = np.flatnonzero(np.diff(owners, prepend=-1) != 0)  # every conversation's first turn
    opening = owners[first][roles[first] == "assistant"]
    kept = {
        "have two user turns in a row (records {}): kept, both rendered as the user's; check how the file was joined": (
            np.unique(owners[1:][repeated])
        ),
        "open with an assistant turn (records {}): kept as context, neither trained on nor regenerated, since no "
        "turn before it asks for it": opening,
    }
    for what, rows in kept.items():
        if len(rows):
            records = ", ".join(map(str, dataset.select(rows[:10].tolist())["record"]))
            logger.warning(
                "%s: %d conversation(s) %s",
                source,
                len(rows),
                what.format(records + (", ..." if len(rows) > 10 else "")),
            )
