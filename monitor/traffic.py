"""A sample of real traffic: a directory of JSONL request logs, one request a line, `{"messages": [...],
"domain": "...", "timestamp": ...}` (domain optional, a string: a line whose domain is a list, a number or an
object is malformed; timestamp as Unix seconds or ISO 8601, a line without one malformed; the assistant's logged
answer may end the messages or be absent). A turn keeps OpenAI's `tool_calls` (its content null when it only calls
tools) and a tool result's `tool_call_id` and `name`. A log is a file, in the directory or a folder under it, named
`NAME.jsonl` or as logrotate renames it: `NAME.jsonl.N` (N digits) or, with `dateext`, `NAME.jsonl-YYYYMMDD`; each
also gzip-compressed, `.gz` after it. A file that is none of these but has `.jsonl` in its name
(`requests.jsonl.bak`, `requests.jsonl.1.xz`) is not read, and a warning names it.

A record may also carry the engine's own acceptance for that request, as vLLM 0.32 returns it with
`--per-request-spec-decode-metrics summary|detailed`: the response's `metrics` object copied into the
record (`"metrics": {"speculative_decoding": {"acceptance_histogram": [...], "num_draft_tokens": N,
...}}`). Those counts are what the engine measured on the real request, so a domain whose recent
requests carry them is judged from them (`per_request_acceptance`) and needs no replay.

The sample is the latest `monitor.sample_per_domain` requests of each domain within the last
`monitor.traffic_window_s` seconds, latest by each request's timestamp (not by its file: names do not sort by
age, the rotated `requests.jsonl.1` after the live `requests.jsonl`), written as a conversation file the eval
and regeneration read: each request's messages, ending with the logged answer, or with a placeholder answer when
none was logged (the eval reads only what precedes it, regeneration replaces it). Logs being written are read
safely: a last line without its newline is skipped as incomplete, as is a gzip log's cut-off end (or a
`.jsonl.gz` that is not gzip: a warning names it, its rest counted as one malformed line); logs are streamed, only
the window's requests kept, a log last written a day before the window not read, and a line past MAX_REQUEST_BYTES is
malformed, read past and never held; malformed lines
are counted, not fatal, unless no line is a request (logs in another format: refused, naming the first line); a
request timed more than a day ahead of the monitor's clock counts as malformed, and when every request is
(timestamps in milliseconds), the logs are refused. A log or a folder of logs that cannot be read is refused,
naming it (its requests would be missing from every check).
"""

from __future__ import annotations

import datetime
import errno
import gzip
import json
import logging
import math
import os
import re
import time
import zlib
from collections import Counter, defaultdict
from itertools import zip_longest
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional

from draftsmith.data_prep.records import DEFAULT_DOMAIN
from draftsmith.data_prep.turns import TOOL_CALLS_KEY, TOOL_KEYS, normalize_turn
from draftsmith.errors import UserError
from draftsmith.files import write_text_atomic

UNLOGGED_ANSWER = "[the response was not logged]"
log = logging.getLogger("draftsmith.monitor")
FUTURE_TOLERANCE_S = 86400.0  # a request's time may be this far ahead of the monitor's clock
# NAME.jsonl, and logrotate's renamings of it: NAME.jsonl.1 (its default), NAME.jsonl-20260101 (dateext), each
# optionally .gz (compress)
REQUEST_LOG_PATTERN = re.compile(r".*\.jsonl(\.\d+|-\d{8,})?(\.gz)?")
REQUEST_LOG_NAMES = "NAME.jsonl, NAME.jsonl.N, NAME.jsonl-YYYYMMDD, each optionally .gz"
# a logged request longer than this (about 4M tokens of text, past any served context) is malformed, never held
MAX_REQUEST_BYTES = 16 << 20
READ_CHUNK_BYTES = 1 << 20
LOOK_ALIKES_NAMED = 5  # look-alike logs named in the warning; the rest counted


def timestamp_of(value: Any) -> Optional[float]:
    """Unix seconds or ISO 8601; None for anything else (a bool is no time, though Python counts it an int)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def read_requests(
    directory: Path, keep: Callable[[dict[str, Any]], bool] = lambda request: True, written_after: float = -math.inf
) -> tuple[list[dict[str, Any]], int]:
    """The complete, well-formed requests in the logs (in the order of their paths) that `keep` keeps, the others
    never held (a month of rotated logs was read whole into memory every check), and the malformed count; a log last
    written before `written_after` is not read (it holds no request since). Logs of which no line is a request are
    refused: a format other than this one, not a bad line."""
    require_traffic_dir(directory)
    requests, malformed, first_malformed, read = [], 0, None, 0
    for path in log_files(directory):
        if path.exists() and not path.is_file():  # a FIFO or a device: its read blocked the check until a SIGTERM
            raise UserError(f"monitor.traffic: {path} is not a regular file (a pipe or a device): move it out")
        try:
            stream = gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")
        except PermissionError:
            raise UserError(f"monitor.traffic: cannot read {path}: permission denied") from None
        except OSError as err:  # a link to a log rotated away, a loop of links: was exit 70
            if err.errno not in (errno.ENOENT, errno.ELOOP):
                raise
            raise UserError(f"monitor.traffic: cannot read {path}: {err.strerror} (a link to no file)") from None
        if os.fstat(stream.fileno()).st_mtime < written_after:  # the file opened, whatever renamed its path since
            stream.close()
            continue
        too_long = []
        with stream:
            try:
                for number, line in enumerate(complete_lines(stream), 1):
                    if line is not None and not line.strip():
                        continue
                    request = None if line is None else logged_request(line)
                    if request is None:
                        malformed += 1
                        first_malformed = first_malformed or f"{path}:{number}"
                        if line is None:
                            too_long.append(number)
                        continue
                    read += 1
                    if keep(request):
                        requests.append(request)
            except (EOFError, gzip.BadGzipFile, zlib.error) as err:  # cut off (still being written), or not gzip
                log.warning("monitor: %s is not whole gzip (%s): only the lines before it are read", path, err)
                malformed += 1  # the rest of the file is one malformed part of it
                first_malformed = first_malformed or f"{path} (not whole gzip)"
        if too_long:
            log.warning(
                "monitor: %s: %d line(s) longer than %d MiB skipped as malformed (the first: line %d): no served "
                "request is that long",
                path,
                len(too_long),
                MAX_REQUEST_BYTES >> 20,
                too_long[0],
            )
    if malformed and read:  # counted in the record's traffic.malformed_lines; said, as a log skipped is
        log.warning("monitor: %d malformed line(s) of the logs skipped (the first: %s)", malformed, first_malformed)
    if malformed and not read:
        raise UserError(
            f"monitor.traffic={str(directory)!r}: none of its {malformed} logged line(s) is a request (the first: "
            f'{first_malformed}); each line is a JSON object with "messages" (a list of {{"role", "content"}}, '
            'a user turn among them), "timestamp" (Unix seconds or ISO 8601), and optionally "domain" (a string)'
        )
    return requests, malformed


def require_traffic_dir(directory: Path) -> None:
    if not directory.is_dir():
        raise UserError(f"monitor.traffic={str(directory)!r} is not a directory of JSONL request logs")


def logged_request(line: bytes) -> Optional[dict[str, Any]]:
    """The request a log line holds, or None when it is malformed."""
    try:
        record = json.loads(line.decode("utf-8", "replace"))
        messages = [logged_turn(turn) for turn in record["messages"]]
        logged_at = timestamp_of(record["timestamp"])
        domain = record.get("domain") or DEFAULT_DOMAIN
    # RecursionError: JSON nested too deep for the parser (a client's object logged through): one malformed line
    except (ValueError, KeyError, TypeError, UserError, RecursionError):
        return None
    # no time: it would stay in every window, as the newest traffic; a domain that is not a name (a list, a number)
    # would become a domain of its own (`['a']`), judged and retrained apart from the named ones
    if (
        not messages
        or not any(m["role"] == "user" for m in messages)
        or logged_at is None
        or not isinstance(domain, str)
    ):
        return None
    return {
        "messages": messages,
        "domain": domain,
        "time": logged_at,
        "spec_decode": spec_decode_counts(record.get("metrics")),
    }


def complete_lines(stream: BinaryIO) -> Iterator[Optional[bytes]]:
    """Each complete line of a log, streamed (a log of gigabytes is never held whole), None in place of a line
    longer than MAX_REQUEST_BYTES, read past in chunks (one 200 MB line drove a check to 24 GB and a kernel kill).
    The text after the last newline is still being written: not a line yet."""
    while line := stream.readline(MAX_REQUEST_BYTES + 1):
        if line.endswith(b"\n"):
            yield line
        elif len(line) <= MAX_REQUEST_BYTES:
            return
        else:
            while (rest := stream.readline(READ_CHUNK_BYTES)) and not rest.endswith(b"\n"):
                pass
            if not rest:  # an over-long last line still being written
                return
            yield None


def log_files(directory: Path) -> list[Path]:
    """The request logs under `directory` (REQUEST_LOG_PATTERN), by path; a folder in it that cannot be listed is
    refused, not skipped (its requests would be missing from every check). Files named like a log but not one (`.jsonl`
    in the name: a backup, another compression) are named in a warning: skipped silently, their requests would be
    missing without a word; a folder holding no log at all is warned of too."""

    def unlisted(err: OSError) -> None:
        if isinstance(err, PermissionError):
            raise UserError(f"monitor.traffic: cannot read {err.filename}: permission denied") from None
        raise err

    files = sorted(Path(parent, name) for parent, _, names in os.walk(directory, onerror=unlisted) for name in names)
    logs = [path for path in files if REQUEST_LOG_PATTERN.fullmatch(path.name)]
    look_alikes = [path for path in files if ".jsonl" in path.name and not REQUEST_LOG_PATTERN.fullmatch(path.name)]
    if not logs:  # an empty folder, or logs under other names (`chat.log`): every check would count 0 requests
        others = f" (it holds {len(files)} other file(s), e.g. {files[0].name})" if files else " (it is empty)"
        log.warning("monitor: monitor.traffic=%s holds no request log named %s%s", directory, REQUEST_LOG_NAMES, others)
    if look_alikes:
        named = ", ".join(str(path) for path in look_alikes[:LOOK_ALIKES_NAMED])
        more = len(look_alikes) - LOOK_ALIKES_NAMED
        log.warning(
            "monitor: not read as request logs (the names read: %s): %s%s",
            REQUEST_LOG_NAMES,
            named,
            f" and {more} more" if more > 0 else "",
        )
    return logs


def logged_turn(turn: Any) -> dict[str, Any]:
    """One logged turn as the sample holds it: its role by the data loader's table, its content (null where
    the turn only calls tools, as OpenAI logs it), its `tool_calls` and the `tool_call_id` and `name` a tool's
    result carries. A turn the loader would refuse (data_prep/turns.py: an unknown role, no content and no
    call, a malformed call) raises UserError: its line is malformed, not a sample the eval then refuses."""
    checked = normalize_turn(turn, "a logged turn")
    kept = {key: checked[key] for key in ("role", "content", TOOL_CALLS_KEY, *TOOL_KEYS) if checked[key] is not None}
    if checked[TOOL_CALLS_KEY] and turn.get("content") is None:
        kept["content"] = None
    return kept


def spec_decode_counts(metrics: Any) -> Optional[dict[str, Any]]:
    """A request's acceptance from vLLM's per-request `metrics.speculative_decoding`: verify steps
    (`drafts`), proposed and accepted draft tokens, and the histogram of accepted tokens per step;
    None when the record has none (or a malformed one, or counts no engine makes: more tokens accepted, or steps
    taken, than proposed; then the request is replayed instead)."""
    spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
    if not isinstance(spec, dict):
        return None
    histogram, proposed = spec.get("acceptance_histogram"), spec.get("num_draft_tokens")
    if (
        not isinstance(histogram, list)
        or not all(isinstance(n, int) and n >= 0 for n in histogram)
        or not isinstance(proposed, int)
    ):
        return None
    accepted = sum(j * count for j, count in enumerate(histogram))
    if accepted > proposed or sum(histogram) > proposed:  # counts no engine makes: each draft proposes a token or more
        return None
    return {"drafts": sum(histogram), "draft_tokens": proposed, "accepted": accepted, "histogram": histogram}


def per_request_acceptance(requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per domain, the engine's per-request counts summed over the requests that carry them: drafts,
    draft tokens, accepted tokens, and P(accepted >= k) per draft position (the histogram's tail)."""
    totals: dict[str, dict[str, Any]] = {}
    for request in requests:
        counts = request.get("spec_decode")
        if counts is None or not counts["drafts"]:
            continue
        total = totals.setdefault(
            request["domain"], {"requests": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "histogram": []}
        )
        total["requests"] += 1
        for key in ("drafts", "draft_tokens", "accepted"):
            total[key] += counts[key]
        total["histogram"] = [a + b for a, b in zip_longest(total["histogram"], counts["histogram"], fillvalue=0)]
    for total in totals.values():
        tail = [sum(total["histogram"][k:]) for k in range(1, len(total["histogram"]))]
        total["at_least"] = [count / total["drafts"] for count in tail]
    return totals


def sample(
    directory: Path,
    per_domain: int,
    window_s: float,
    now: Optional[float] = None,
    since: float = 0.0,
    scraped: Optional[float] = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The latest `per_domain` requests per domain within the window and logged after `since` (before it, a
    drafter the monitor replaced served them: monitor/redeploy.py); and what was read, with the requests per domain
    logged after `scraped` (the engine's window: the previous scrape) where given."""
    now = time.time() if now is None else now
    read: dict[str, Any] = {"requests": 0, "ahead": 0, "first": None}

    def in_window(request: dict[str, Any]) -> bool:
        read["requests"] += 1
        read["first"] = request["time"] if read["first"] is None else read["first"]
        # a time further ahead than a clock's skew or a naive time's zone explains (or NaN) is no request's time:
        # taken as the newest traffic it would stay in every window, so it is counted as malformed instead
        if not request["time"] <= now + FUTURE_TOLERANCE_S:
            read["ahead"] += 1
            return False
        return now - request["time"] <= window_s and request["time"] > since

    # a log last written before the window (less the clocks' tolerance) holds no request of it
    recent, malformed = read_requests(directory, in_window, written_after=now - window_s - FUTURE_TOLERANCE_S)
    if read["requests"] and read["ahead"] == read["requests"]:  # the logs' unit (each check: too few samples)
        raise UserError(
            f"monitor.traffic={str(directory)!r}: every one of its {read['requests']} request(s) is timed more than a "
            f"day ahead of this machine's clock (the first: timestamp {read['first']:g}; milliseconds?): a "
            '"timestamp" is Unix seconds or ISO 8601'
        )
    malformed += read["ahead"]
    by_domain: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for request in recent:
        by_domain[request["domain"]].append(request)
    # latest by time, not by place in the logs: their files are read by path, which is no order of time (a rotated
    # requests.jsonl.1 after the live requests.jsonl); a stable sort keeps equal times in the logs' order
    picked = {domain: sorted(rows, key=lambda r: r["time"])[-per_domain:] for domain, rows in sorted(by_domain.items())}
    summary = {
        # requests logged before `since` are not judged (a replaced drafter served them): the line says from when
        **({"judged_since": since} if since > now - window_s else {}),
        "requests_read": read["requests"] - read["ahead"],  # in the logs written within the window
        "malformed_lines": malformed,
        "in_window": len(recent),
        "per_domain": {d: len(r) for d, r in picked.items()},
        # every recent request the engine reported on, not only the sample
        "per_request_acceptance": per_request_acceptance(recent),
    }
    if scraped is not None:  # the engine's counters' mix of domains (monitor/drift.py judge_on_mix)
        summary["since_scrape"] = dict(Counter(request["domain"] for request in recent if request["time"] > scraped))
    return [row for rows in picked.values() for row in rows], summary


def write_conversations(requests: list[dict[str, Any]], path: Path) -> Path:
    """The sample as a conversation file (see the module docstring for the answer placeholder)."""
    lines = []
    for request in requests:
        messages = list(request["messages"])
        if messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": UNLOGGED_ANSWER})
        lines.append(json.dumps({"messages": messages, "domain": request["domain"]}, ensure_ascii=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "\n".join(lines) + "\n")
    return path
