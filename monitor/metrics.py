"""The serving engine's speculative-decoding counters, from its Prometheus `/metrics`.

vLLM exposes Counters (labels `model_name`, `engine`; the per-position one also `position`):
`vllm:spec_decode_num_drafts_total` (verify steps that had draft tokens), `..._num_draft_tokens_total`,
`..._num_accepted_tokens_total` (bonus excluded) and `..._num_accepted_tokens_per_pos_total`
(accepted at position k, counted only when positions < k were accepted too). A check scrapes every
replica, keeps each series (target URL + labels) apart, and turns two scrapes into the counts of the
window between them: a series that went down restarted from zero (a server restart), so its window
count is its new value. A restart is counted once per replica whose counters went down, however many
series it has. SGLang exposes gauges (`sglang:spec_accept_length`, `sglang:spec_accept_rate`):
levels with no counts behind them, recorded as they are.

Parsing is prometheus_client's own parser, not regexes.

vLLM's server also answers `GET /version` (`{"version": "0.32.0"}`) beside its `/metrics`: the version
of the engine serving, which a check compares with the one the export was checked in (monitor/check.py).
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Optional

from packaging.version import InvalidVersion, Version
from prometheus_client.parser import text_string_to_metric_families

from draftsmith.engines import SERVING_ENGINES
from draftsmith.errors import EngineUnavailable, UserError, one_line

VLLM_COUNTERS = {
    "vllm:spec_decode_num_drafts_total": "drafts",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted",
}
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_GAUGES = ("sglang:spec_accept_length", "sglang:spec_accept_rate")
UNKNOWN = "unknown"  # a replica's version when its server has no /version
# an engine's /metrics is kilobytes to a few MB (per-position counters, histograms per model); a body past this is no
# single engine's page (a log, a dump behind a misrouted URL): 83 MB took 42 s and 2.1 GB to parse before it was refused
MAX_BODY_BYTES = 32 << 20
SCRAPE_TIMEOUT_S = 10.0  # a healthy engine answers in milliseconds; one slower is unavailable (exit 69: retry)


def get(url: str) -> Optional[str]:
    """The body at `url`, or None when the server has no such path (404). An engine that does not
    answer, or answers with a server error (5xx: a proxy in front of a dead engine, say), is a
    temporary fault (EngineUnavailable: retry); another client error or a URL that cannot be fetched
    at all is bad input, as is a body past MAX_BODY_BYTES (read no further)."""
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
            body = response.read(MAX_BODY_BYTES + 1)
            missing = response.length if len(body) <= MAX_BODY_BYTES else None  # of the Content-Length it announced
        if missing:  # a read of at most so many bytes returns what came before the connection closed, unsaid
            raise http.client.IncompleteRead(body, missing)
    except urllib.error.HTTPError as err:
        if err.code == 404:
            return None
        if err.code >= 500:
            raise EngineUnavailable(f"{url} answered HTTP {err.code} {one_line(err.reason)}") from None
        raise UserError(f"{url} answered HTTP {err.code} {one_line(err.reason)}: check monitor.metrics") from None
    except ValueError as err:  # not a URL urllib can fetch
        raise UserError(f"cannot scrape {url}: {one_line(err)}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:  # refused, unreachable, timed out, cut
        raise EngineUnavailable(f"cannot scrape {url}: {one_line(getattr(err, 'reason', err))}") from None
    if len(body) > MAX_BODY_BYTES:
        raise UserError(
            f"{url} answered more than {MAX_BODY_BYTES >> 20} MiB, no engine's metrics page (it begins "
            f"{one_line(body[:80].decode('utf-8', 'replace'), limit=80)!r}): check monitor.metrics"
        )
    return body.decode("utf-8", "replace")


def scrape(url: str) -> str:
    """The exposition text at `url`; a 404 is a wrong path, bad input like any other client error."""
    text = get(url)
    if text is None:
        raise UserError(f"{url} answered HTTP 404 Not Found: check monitor.metrics")
    return text


def engine_version(metrics_url: str) -> str:
    """The vLLM version the server of `metrics_url` reports at the /version beside it, or UNKNOWN when
    there is none (404: a proxy that routes only /metrics, or a server older than the endpoint): the
    monitor was told where the counters are, not where the version is, so a missing one leaves the
    version uncompared instead of stopping the monitoring. A server that does not answer is
    EngineUnavailable and any other answer that is not `{"version": "..."}` bad input, as for /metrics."""
    url = urllib.parse.urljoin(metrics_url.rstrip("/"), "version")
    text = get(url)
    if text is None:
        return UNKNOWN
    try:
        version = json.loads(text)["version"]
    except (json.JSONDecodeError, TypeError, KeyError):
        version = None
    if not isinstance(version, str) or not is_a_version(version):
        raise UserError(
            f"{url} did not answer with vLLM's version (it begins {one_line(text, limit=80)!r}): monitor.metrics must "
            "name vLLM's own server"
        )
    return version


def is_a_version(text: str) -> bool:
    """Whether `text` is a release's version (0.32.0, 0.33.0rc1, 0.32.0+cpu), which the export's table compares."""
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def series(text: str, url: str) -> dict[str, float]:
    """The spec-decode samples of one exposition as `series key -> value`; the key names the kind
    (`drafts`, `draft_tokens`, `accepted`, `pos<k>`, or the SGLang gauge) and the series' labels."""
    found: dict[str, float] = {}
    try:
        samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    except (ValueError, KeyError, IndexError) as err:  # an HTML page, a body cut off mid-line
        first = one_line(text, limit=80)
        raise UserError(
            f"{url} did not answer with Prometheus text ({one_line(err, limit=120)}; it begins {first!r}): check "
            "monitor.metrics"
        ) from None
    for sample in samples:
        labels = {k: v for k, v in sample.labels.items() if k != "position"}
        suffix = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        counted = sample.name in VLLM_COUNTERS or sample.name == VLLM_PER_POSITION
        if counted and not (math.isfinite(sample.value) and sample.value >= 0):  # NaN would poison state.json
            raise UserError(
                f"{url} reports {sample.name}{{{suffix}}} = {sample.value}: a counter is a finite count, 0 or more; "
                "check monitor.metrics"
            )
        if sample.name in VLLM_COUNTERS:
            found[f"{VLLM_COUNTERS[sample.name]}|{url}|{suffix}"] = sample.value
        elif sample.name == VLLM_PER_POSITION:
            found[f"pos{int(sample.labels['position'])}|{url}|{suffix}"] = sample.value
        elif sample.name in SGLANG_GAUGES:
            if math.isinf(sample.value) or sample.value < 0:  # NaN is a level not measured yet (no draft so far)
                raise UserError(
                    f"{url} reports {sample.name}{{{suffix}}} = {sample.value}: an acceptance level is finite, 0 or "
                    "more; check monitor.metrics"
                )
            found[f"{sample.name}|{url}|{suffix}"] = sample.value
    return found


def collect(urls: list[str], engine: str = "vllm") -> dict[str, float]:
    """One scrape of every replica, each of which must report `engine`'s speculative-decoding metrics."""
    values: dict[str, float] = {}
    for url in urls:
        text = scrape(url)
        found = series(text, url)
        require_spec_decode(found, text, url, engine)
        values |= found
    return values


def require_spec_decode(found: dict[str, float], text: str, url: str, engine: str) -> None:
    """An answer without the engine's speculative-decoding metrics (an empty one, another server's, a
    vLLM started without a speculative config) could never show a drift: bad input, not a quiet window.
    vLLM creates its counters at 0 when it starts, so they are there before the first request. Accepted
    draft tokens beyond the drafted ones (α > 1) are no engine's counts either."""
    kinds = {key.split("|", 1)[0] for key in found}
    if SERVING_ENGINES[engine].counts_drafts:  # vLLM's counters: all of them
        missing = [name for name, kind in VLLM_COUNTERS.items() if kind not in kinds]
    else:  # SGLang's gauges: either one is a level to record
        missing = [] if kinds & set(SGLANG_GAUGES) else list(SGLANG_GAUGES)
    if missing:
        answer = "an empty answer" if not text.strip() else f"no {', '.join(missing)}"
        raise UserError(
            f"{url} is not the /metrics of {SERVING_ENGINES[engine].name} serving with speculative decoding "
            f"({answer}): check monitor.metrics and the engine's speculative config"
        )
    for key in found:
        if key.startswith("drafts|"):
            impossible = impossible_counts(found, key.split("|", 1)[1])
            if impossible:
                labels = key.rsplit("|", 1)[1]
                series = f"the series {{{labels}}}" if labels else "its series without labels"
                raise UserError(
                    f"{url} reports {impossible} for {series}: these are not vLLM's counters; check monitor.metrics"
                )


def impossible_counts(found: dict[str, float], series_id: str) -> Optional[str]:
    """What no vLLM counts of one label set (`series_id`: its replica and labels) could be, in words; None where they
    may be counts: each draft proposes a token or more, and accepts at each position at most once, fewer at a later
    position than an earlier, the positions' acceptances summing to the accepted tokens, which are at most those
    drafted."""
    drafts, drafted = found[f"drafts|{series_id}"], found.get(f"draft_tokens|{series_id}", 0.0)
    accepted = found.get(f"accepted|{series_id}", 0.0)
    positions: list[float] = []  # vLLM's positions 0, 1, ... of this label set
    while f"pos{len(positions)}|{series_id}" in found:
        positions.append(found[f"pos{len(positions)}|{series_id}"])
    if accepted > drafted:
        return f"more accepted draft tokens ({accepted:g}) than draft tokens ({drafted:g})"
    if drafted < drafts:
        return f"fewer draft tokens ({drafted:g}) than drafts ({drafts:g})"
    if any(count > drafts for count in positions):
        return f"more acceptances at a draft position ({max(positions):g}) than drafts ({drafts:g})"
    if any(later > earlier for earlier, later in zip(positions, positions[1:])):
        return f"more acceptances at a later draft position than an earlier one ({[f'{n:g}' for n in positions]})"
    if positions and abs(sum(positions) - accepted) > 0.5:
        return f"acceptances per draft position summing to {sum(positions):g}, not the accepted tokens ({accepted:g})"
    return None


@dataclass
class Window:
    """The engine's counts between two scrapes, all replicas and label sets summed."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_position: list[float] = field(default_factory=list)
    restarted: list[str] = field(default_factory=list)  # replicas (URLs) whose counters went down: counted from zero
    gauges: dict[str, float] = field(default_factory=dict)  # SGLang: the latest level, averaged over replicas

    @property
    def resets(self) -> int:
        """Server restarts in the window: one per replica whose counters went down, not one per series."""
        return len(self.restarted)

    @property
    def alpha(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def tau(self) -> float | None:
        """Mean acceptance length: tokens per verify step, the bonus included."""
        return 1 + self.accepted / self.drafts if self.drafts else None

    @property
    def at_least(self) -> list[float]:
        """P(accepted >= k) per draft, k = 1.. (vLLM's per-position rate)."""
        return [count / self.drafts for count in self.accepted_per_position] if self.drafts else []

    def as_dict(self) -> dict[str, Any]:
        return {
            "drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
            "accepted_per_position": self.accepted_per_position, "alpha": self.alpha, "tau": self.tau,
            "at_least": self.at_least, "counter_resets": self.resets, "restarted": self.restarted,
            "gauges": self.gauges,
        }  # fmt: skip


def window(before: dict[str, float], after: dict[str, float]) -> Window:
    """The counts between two scrapes (see the module docstring for resets)."""
    result = Window()
    gauges: dict[str, list[float]] = {}
    for key, value in after.items():
        kind = key.split("|", 1)[0]
        if kind in SGLANG_GAUGES:
            if not math.isnan(value):  # a replica that has not drafted yet has no level to average in
                gauges.setdefault(kind, []).append(value)
            continue
        previous = before.get(key, 0.0)
        delta = value - previous
        if delta < 0:  # the series restarted: everything it counts is new
            delta = value
            url = key.split("|", 2)[1]  # a URL has no unencoded "|"; a label value may
            if url not in result.restarted:
                result.restarted.append(url)
        if kind.startswith("pos"):
            position = int(kind[3:])
            result.accepted_per_position += [0.0] * (position + 1 - len(result.accepted_per_position))
            result.accepted_per_position[position] += delta
        else:
            setattr(result, kind, getattr(result, kind) + delta)
    result.gauges = {name: sum(values) / len(values) for name, values in gauges.items()}
    return result
