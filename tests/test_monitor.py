"""The drift monitor against an engine's exposition served by prometheus_client on loopback (the real
vLLM server is tests/test_monitor_vllm.py): counters summed over replicas and surviving restarts, the
statistical decision, the traffic reader, and the whole loop — a shift to unseen domains is detected
by the counters, located by the traffic sample, waits out the hysteresis, is retrained (interrupted
once and resumed), passes the gate and is exported as the new deployed revision. The deploy examples
under deploy/ run as written."""

from __future__ import annotations

import configparser
import gzip
import http.server
import json
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, start_http_server

from draftsmith.errors import EngineUnavailable, UserError
from draftsmith.monitor import Outcome
from draftsmith.monitor.drift import DRIFT, HEALTHY, TOO_FEW, UNDECIDED, Baseline, judge, request_tests
from draftsmith.monitor.metrics import collect, window
from draftsmith.monitor.traffic import read_requests, sample
from draftsmith.outputs import DirectoryLock
from draftsmith.recipe import load_recipe
from tests.conftest import DEMO, REPO, run_entry_in_process

LABELS = ["model_name", "engine"]


class FakeEngine:
    """vLLM's spec-decode counters, exposed by prometheus_client on 127.0.0.1 (names, labels and
    `_total` suffixes as vLLM 0.32's /metrics has them)."""

    def __init__(self):
        self.start()

    def start(self) -> None:
        registry = CollectorRegistry()
        self.drafts = Counter("vllm:spec_decode_num_drafts", "drafts", LABELS, registry=registry)
        self.tokens = Counter("vllm:spec_decode_num_draft_tokens", "draft tokens", LABELS, registry=registry)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "accepted", LABELS, registry=registry)
        self.per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "per position", [*LABELS, "position"], registry=registry
        )
        self.server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
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
    assert measured.drafts == 50 and measured.resets > 0 and measured.at_least == pytest.approx([0.4, 0.2])
    one.server.shutdown(), two.server.shutdown()


class Answers(http.server.BaseHTTPRequestHandler):
    """A loopback server answering /<status>/<body name> with that status and body."""

    BODIES = {
        "html": "<html><body><h1>502 Bad Gateway</h1></body></html>",
        "cut": 'vllm:spec_decode_num_drafts_total{model_name="demo",engine="0"} 10.0\nvllm:spec_decode_num_dr',
    }

    def do_GET(self):
        _, status, body = self.path.split("/")
        self.send_response(int(status))
        self.end_headers()
        self.wfile.write(self.BODIES[body].encode())

    def log_message(self, *args):
        pass


def test_a_bad_scrape_is_one_line_and_a_failing_engine_is_temporary():
    """An HTML page or a body cut off mid-line is bad input (one line, no traceback); a refused
    connection or a 5xx (a proxy in front of a dead engine) is EngineUnavailable: exit 69, retry."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        for path in ("/200/html", "/200/cut"):
            with pytest.raises(UserError, match="did not answer with Prometheus text") as err:
                collect([base + path])
            assert "\n" not in str(err.value)
        with pytest.raises(UserError, match="HTTP 404"):
            collect([base + "/404/html"])
        with pytest.raises(EngineUnavailable, match="HTTP 502"):
            collect([base + "/502/html"])
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(EngineUnavailable, match="cannot scrape"):
        collect([base + "/200/html"])  # nothing listens there now


def test_the_decision_needs_a_significant_drop_and_enough_drafts():
    settings = load_recipe(["recipe=medusa"]).monitor  # max_drop 0.10, confidence 0.99, min_drafts 200
    assert judge(0.30, 2000, 0.40, settings).verdict == DRIFT  # far below 0.36
    assert judge(0.40, 2000, 0.40, settings).verdict == HEALTHY
    assert judge(0.35, 2000, 0.40, settings).verdict == UNDECIDED  # near the line: not significant either way
    assert judge(0.10, 50, 0.40, settings).verdict == TOO_FEW  # a quiet hour decides nothing


def test_the_traffic_reader_skips_a_line_being_written_and_counts_malformed_ones(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    request = {"messages": [{"role": "user", "content": "hi"}], "domain": "chat", "timestamp": "2026-11-23T10:00:00Z"}
    (logs / "a.jsonl").write_text(
        json.dumps(request) + "\nnot json\n" + json.dumps({"messages": []}) + "\n" + json.dumps(request)[:20]
    )
    (logs / "b.jsonl.gz").write_bytes(gzip.compress((json.dumps({**request, "domain": None}) + "\n").encode()))
    requests, malformed = read_requests(logs)
    assert [r["domain"] for r in requests] == ["chat", "default"] and malformed == 2
    assert requests[0]["time"] == pytest.approx(1795428000.0)


def vllm_metrics(histogram: list[int], gamma: int = 3) -> dict:
    """A response's `metrics` as vLLM 0.32 returns it with --per-request-spec-decode-metrics summary."""
    steps, accepted = sum(histogram), sum(j * n for j, n in enumerate(histogram))
    spec = {"mean_acceptance_length": 1 + accepted / steps, "draft_acceptance_rate": accepted / (gamma * steps), "acceptance_histogram": histogram,
            "num_spec_steps": steps, "num_accepted_draft_tokens": accepted, "num_draft_tokens": gamma * steps, "num_spec_tokens": gamma}  # fmt: skip
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
    assert sorted({r["domain"] for r in picked} - set(tests)) == ["docs", "math"]  # replayed


# -- the loop, end to end with the loopback exposition ------------------------------------------------
def log_requests(logs: Path, source: Path, domain: str, count: int) -> None:
    """Append `count` requests of `domain` (user turn only, answer not logged) to the request log."""
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    with open(logs / "requests.jsonl", "a") as f:
        for row in [r for r in rows if r["domain"] == domain][:count]:
            f.write(json.dumps({"messages": row["messages"][:1], "domain": domain, "timestamp": time.time()}) + "\n")


@pytest.mark.slow
def test_a_shift_is_detected_located_retrained_and_promoted(deployed, tmp_path, monkeypatch):
    import draftsmith.monitor.pipeline as pipeline
    from draftsmith.monitor.check import check

    root, args = deployed
    engine, logs = FakeEngine(), tmp_path / "logs"
    logs.mkdir()
    cfg = load_recipe([
        *args, f"output_dir={tmp_path / 'run'}", f"monitor.deployed={root / 'export' / 'vllm'}", f"monitor.metrics=[{engine.url}]",
        f"monitor.traffic={logs}", "monitor.min_drafts=100", "monitor.sample_per_domain=4", "monitor.retrain_samples=48", "train.max_steps=30", "data.regenerate.max_new_tokens=64",
    ])  # fmt: skip
    baseline = Baseline.from_report(json.loads((root / "deployed" / "eval" / "report.json").read_text()), "report")
    source = root / "traffic_source.jsonl"
    for domain in ("math", "packages"):
        log_requests(logs, source, domain, 6)
    assert check(cfg) == Outcome.HEALTHY  # the first scrape starts the window
    engine.serve(2000, baseline.at_least)
    assert check(cfg) == Outcome.HEALTHY  # in-domain traffic accepts as in the eval

    for domain in ("code", "docs"):  # the shift: domains the drafter never saw
        log_requests(logs, source, domain, 48)
    engine.serve(2000, [rate / 3 for rate in baseline.at_least])
    assert check(cfg) == Outcome.DRIFT  # hysteresis: 1 of 2 checks
    record = json.loads((tmp_path / "run" / "monitor" / "checks" / "00003.json").read_text())
    assert (
        record["engine"]["verdict"] == DRIFT
        and record["engine"]["tests"]["alpha"]["upper"] < record["engine"]["tests"]["alpha"]["threshold"]
    )
    located = {d for d, test in record["traffic"]["domains"].items() if test["verdict"] == DRIFT}
    assert located and located <= {"code", "docs"}  # where: the unseen domains, not the trained ones
    assert {d for d, test in record["traffic"]["domains"].items() if test["new_domain"]} == {"code", "docs"}

    real_train, calls = pipeline.STEPS["train"], []

    def killed_train(*a, **k):  # the retraining dies in its train step the first time
        calls.append(1)
        raise KeyboardInterrupt

    engine.serve(2000, [rate / 3 for rate in baseline.at_least])
    monkeypatch.setitem(pipeline.STEPS, "train", killed_train)
    with pytest.raises(KeyboardInterrupt):
        check(cfg)
    state = json.loads((tmp_path / "run" / "monitor" / "state.json").read_text())
    assert set(state["pipeline"]["done"]) == {"sample", "regenerate"} and state["pipeline"]["domains"] == [
        "code",
        "docs",
    ]

    def must_not_run(*a, **k):
        raise AssertionError("a finished step ran again")

    monkeypatch.setitem(pipeline.STEPS, "train", real_train)
    monkeypatch.setitem(pipeline.STEPS, "sample", must_not_run)
    monkeypatch.setitem(pipeline.STEPS, "regenerate", must_not_run)
    assert check(cfg) == Outcome.PROMOTED  # resumed at train
    state = json.loads((tmp_path / "run" / "monitor" / "state.json").read_text())
    gate = state["last_retrain"]["gate"]
    assert state["pipeline"] is None and state["deployed"]["revision"] == 1 and gate["promote"]
    assert gate["tau"]["candidate"]["new"] > gate["tau"]["deployed"]["new"] * 1.02
    assert Path(state["deployed"]["export"], "model.safetensors").is_file() and state["cooldown_until"] > time.time()
    assert list((tmp_path / "run" / "monitor" / "tb").glob("events.out.tfevents.*"))
    engine.server.shutdown()


def test_two_checks_never_overlap(tmp_path):
    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path}", "monitor.traffic=/nonexistent"])
    from draftsmith.monitor.check import check

    with DirectoryLock(tmp_path / "monitor", "a running check"):
        with pytest.raises(UserError, match="in use by another job .*a running check"):
            check(cfg)


# -- the deploy examples, as written -----------------------------------------------------------------
@pytest.fixture
def healthy_setup(deployed, tmp_path):
    """A recipe file for a monitor that finds the (loopback) engine healthy, and the commands' paths."""
    root, args = deployed
    engine = FakeEngine()
    settings = {"drafter": {"type": "medusa"}, "target": {"name_or_path": str(DEMO / "target")}, "output_dir": str(tmp_path / "run"),
                "monitor": {"deployed": str(root / "export" / "vllm"), "metrics": [engine.url], "min_drafts": 100}}  # fmt: skip
    recipe = tmp_path / "monitor.yaml"
    recipe.write_text(yaml.safe_dump(settings))
    yield recipe, engine
    engine.server.shutdown()


def run_as_written(command: str, recipe: Path) -> subprocess.CompletedProcess:
    """A deploy example's command with this test's recipe and the installed `draftsmith`."""
    command = command.replace("/etc/draftsmith/monitor.yaml", str(recipe)).replace(
        "/opt/draftsmith/bin/draftsmith", "draftsmith"
    )
    return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, timeout=300, cwd=recipe.parent)


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
    assert run_as_written(command, recipe).returncode == 0
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
    assert rules == {"Ignore": [69, 75], "FailJob": [2]}
    container = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    assert run_as_written(container["command"][2], recipe).returncode == 0
    bad = run_as_written(container["command"][2], recipe.parent / "missing.yaml")
    assert bad.returncode == 2  # bad input fails the Job
    engine.server.shutdown()
    engine.server.server_close()
    down = run_as_written(service["Service"]["ExecStart"], recipe)  # the engine is down: retry later, not "bad input"
    lines = [line for line in down.stderr.splitlines() if line.strip()]
    assert down.returncode == 69 and len(lines) == 1 and lines[0].startswith("engine unavailable: "), down.stderr[
        -1000:
    ]


def test_monitor_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    for args in (
        ["-m", "monitor"],
        ["-m", "monitor", "check", "recipe=medusa", f"output_dir={tmp_path}"],
        ["-m", "monitor", "check", "recipe=medusa", "monitor.metrics=[localhost:9]"],
    ):
        result = run_entry_in_process(args, capsys)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (
            args,
            result.stderr[-1000:],
        )
