"""Exit codes a scheduler can act on (docs/faults.md): one code per kind of failure, the same in every
stage, each provoked here through a real entry point run in this process. 2 is bad input only; 3 a
failed correctness check; 4 a diverged training run; 69 an engine that died or a Hub out of reach; 70 a
draftsmith bug (its traceback kept in a log file); 74 a full disk; 75 SIGTERM; 130 Ctrl-C. Also proved
elsewhere, in real processes or with real faults: 3 by the eval (tests/test_eval.py), 69 by a killed vLLM regeneration
(tests/test_regenerate_vllm.py), 74 by a real tmpfs filling during a checkpoint and 75 by a real
SIGTERM during training (tests/test_reliability.py), 10/11/12/13 by the monitor (tests/test_monitor.py)."""

from __future__ import annotations

import errno
import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

from draftsmith import errors
from draftsmith.target import load_target
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, save_drafter, train_args

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path_factory.mktemp("exit") / "final")


def fake_vllm(directory: Path, body: str) -> str:
    """A stand-in for export.vllm_python: an executable that speaks the engine worker's protocol
    (draftsmith/engine_scripts/vllm_worker.py: one JSON request per line on stdin, one reply per line)
    the way a failing engine does, after answering the export's version query as vLLM 0.32 (formats/versions.py).
    The real engine cannot be made to die or refuse on cue cheaply (the real one, killed, is
    tests/test_regenerate_vllm.py's)."""
    path = directory / "fake-vllm-python"
    version = "if sys.argv[1:2] == ['-c']:\n    print('0.32.0')\n    sys.exit(0)\n"
    path.write_text(f"#!{sys.executable}\nimport json, sys\n{version}request = sys.stdin.readline()\n{body}\n")
    path.chmod(0o755)
    return str(path)


def export(checkpoint: Path, tmp_path: Path, capsys, *extra: str):
    args = [
        "-m",
        "export",
        "recipe=medusa",
        f"checkpoint={checkpoint}",
        f"output_dir={tmp_path / 'run'}",
        f"export.output={tmp_path / 'export'}",
        "eval.max_prompts=1",
        "eval.max_new_tokens=4",
        *extra,
    ]
    return run_entry_in_process(args, capsys)


def test_bad_input_exits_2(checkpoint, tmp_path, capsys):
    result = export(checkpoint, tmp_path, capsys, "export.engines=[tensorrt]")
    assert result.returncode == errors.EXIT_USER_ERROR == 2
    assert_one_line_error(result, 2, "export.engines=['tensorrt']")


def test_an_engine_that_dies_during_the_export_check_exits_69(checkpoint, tmp_path, capsys):
    """The same code as a vLLM regeneration whose engine dies: retry the same command."""
    python = fake_vllm(tmp_path, "sys.stderr.write('engine core died\\n'); sys.exit(1)")
    result = export(checkpoint, tmp_path, capsys, f"export.vllm_python={python}")
    assert result.returncode == errors.EXIT_UNAVAILABLE == 69
    line = assert_one_line_error(result, 69, prefix="engine unavailable: ")
    assert "gave no answer (exit code 1)" in line and "engine core died" in line
    assert not (tmp_path / "export" / "vllm").exists()  # nothing published


def test_an_engine_that_exits_silently_during_the_export_check_says_so(checkpoint, tmp_path, capsys):
    """A program that answers the version query but starts no engine (exit 0, nothing on stderr): still
    69, and the line says it wrote nothing rather than ending on an empty cause."""
    python = fake_vllm(tmp_path, "sys.exit(0)")
    result = export(checkpoint, tmp_path, capsys, f"export.vllm_python={python}")
    line = assert_one_line_error(result, 69, prefix="engine unavailable: ")
    assert line.endswith("gave no answer (exit code 0) and wrote nothing to stderr")
    assert not (tmp_path / "export" / "vllm").exists()


def test_a_hub_that_cannot_be_reached_exits_69_and_an_uncached_id_offline_exits_2(tmp_path, monkeypatch, capsys):
    """A Hub id with no network is a temporary fault (69: run it again), not bad input; with HF_HUB_OFFLINE=1
    (the tests' setting) an id not in the cache is (2). The Hub here is an address nothing listens on, and
    huggingface_hub's retries (about 25 s of sleeping) are skipped."""
    import huggingface_hub.constants as constants

    train = ["train.py", "recipe=medusa", "target.name_or_path=acme/not-cached", f"output_dir={tmp_path / 'run'}"]
    offline = run_entry_in_process(train, capsys)
    assert_one_line_error(offline, 2, "'acme/not-cached': not in the Hub cache", alone=True)
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in offline.stderr  # transformers' line: could not connect
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    unreachable = run_entry_in_process(train, capsys)
    assert_one_line_error(unreachable, 69, "We couldn't connect to 'http://127.0.0.1:9'", prefix="Hub unavailable: ")
    assert unreachable.stderr.rstrip().endswith("or set HF_HUB_OFFLINE=1 to read the Hub cache only)")
    assert not (tmp_path / "run").exists()


def test_a_push_to_a_hub_out_of_reach_exits_69_with_the_folders_exported(checkpoint, tmp_path, monkeypatch, capsys):
    """A push with no network was an internal error (exit 70: httpx's ConnectError); it is a Hub out of reach
    (69: run the same command again), the folders exported before it are kept."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    output = tmp_path / "export"
    args = ["recipe=medusa", f"checkpoint={checkpoint}", f"output_dir={tmp_path}", f"export.output={output}",
            "export.push.repo_id=acme/demo"]  # fmt: skip
    result = run_entry_in_process(["-m", "export", *args], capsys)
    assert_one_line_error(result, 69, "could not push", prefix="Hub unavailable: ")
    assert result.stderr.rstrip().endswith("the folders are exported: run the same command again to push them")
    assert (output / "vllm" / "draftsmith_export.json").is_file()


def test_an_engine_that_refuses_the_export_exits_3(checkpoint, tmp_path, capsys):
    """An engine that answers but cannot serve the folder: the export failed its check (as a τ or
    lossless mismatch in the engine would), not bad input and not worth a retry."""
    reply = {"ok": False, "error": "ValueError: unknown speculative method", "error_lines": []}
    python = fake_vllm(tmp_path, f"print(json.dumps({reply!r}), flush=True); sys.exit(1)")
    result = export(checkpoint, tmp_path, capsys, f"export.vllm_python={python}")
    assert result.returncode == errors.EXIT_CHECK_FAILED == 3
    fragment = "vLLM could not serve the export: ValueError: unknown speculative method"
    assert_one_line_error(result, 3, fragment, prefix="check failed: ")
    assert not (tmp_path / "export" / "vllm").exists()


def test_a_full_disk_exits_74_wherever_it_is_met(checkpoint, tmp_path, monkeypatch, capsys):
    """ENOSPC injected where the export writes draftsmith_export.json (a real full disk during a
    checkpoint, on a tmpfs: tests/test_reliability.py)."""
    import draftsmith.export.run as run

    write_json = run.write_json

    def full_disk(path, value):
        if path.name != "draftsmith_export.json":
            return write_json(path, value)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(run, "write_json", full_disk)
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == errors.EXIT_IO_ERROR == 74
    line = assert_one_line_error(result, 74, prefix="I/O error: ")
    assert "no space left on device" in line and "draftsmith_export.json" in line
    assert not (tmp_path / "export" / "vllm").exists()


def test_a_draftsmith_bug_exits_70_with_its_traceback_in_a_log_file(checkpoint, tmp_path, monkeypatch, capsys):
    import draftsmith.export.run as run

    def broken(*args, **kwargs):
        raise KeyError("num_heads")  # an exception no stage raises on purpose

    monkeypatch.setattr(run, "serving_gamma", broken)
    monkeypatch.delenv(errors.DEBUG_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == errors.EXIT_INTERNAL == 70
    line = assert_one_line_error(
        result, 70, prefix="internal error (a draftsmith bug, please report it): KeyError: 'num_heads'"
    )
    (log,) = tmp_path.glob("draftsmith-error-*.log")
    assert f"traceback in {log}" in line and f"{errors.DEBUG_ENV}=1" in line
    assert "Traceback" in log.read_text() and "in broken" in log.read_text()

    monkeypatch.setenv(errors.DEBUG_ENV, "1")  # or on stderr, above the line
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == 70 and "in broken" in result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("the traceback is above")


def test_a_readback_that_differs_is_a_draftsmith_bug_not_bad_input(checkpoint, tmp_path, monkeypatch, capsys):
    import draftsmith.formats.folder as drafter_folder

    real = drafter_folder.read_folder

    def changed(folder, target):
        drafter = real(folder, target)
        next(drafter.parameters()).data.add_(1.0)
        return drafter

    monkeypatch.setattr(drafter_folder, "read_folder", changed)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == errors.EXIT_INTERNAL
    assert_one_line_error(result, 70, "does not read back into the same drafter", prefix="internal error")


def test_sigterm_exits_75_and_ctrl_c_130(checkpoint, tmp_path, monkeypatch, capsys):
    """A real SIGTERM to this process while the export runs (during training, where a checkpoint is
    saved first: tests/test_reliability.py)."""
    import draftsmith.export.run as run

    real = run.serving_gamma

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(run, "serving_gamma", signalled)
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == errors.EXIT_PREEMPTED == 75
    assert_one_line_error(result, 75, prefix="preempted: ")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "serving_gamma", interrupted)
    result = export(checkpoint, tmp_path / "again", capsys)
    assert result.returncode == errors.EXIT_INTERRUPTED == 130
    assert result.stderr.strip().splitlines()[-1] == "interrupted"


def test_a_diverged_training_run_exits_4(tmp_path, small_data, token_cache, capsys):
    """A learning rate that blows the weights up: every step after the first is non-finite, and past
    train.max_nonfinite the run stops with one line naming where."""
    args = train_args(
        tmp_path / "run",
        small_data,
        token_cache,
        "data.max_conversations=8",
        "train.max_steps=4",
        "train.warmup_steps=0",
        "train.lr=1e30",
        "train.max_nonfinite=0",
        "data.eval=[]",
    )
    result = run_entry_in_process(["train.py", *args], capsys)
    assert result.returncode == errors.EXIT_DIVERGED == 4
    line = assert_one_line_error(result, 4, prefix="training diverged: ")
    assert "more than train.max_nonfinite=0 steps skipped" in line and "non-finite loss or gradient at step" in line


def test_every_outcome_has_its_own_code():
    # one meaning per code: 3 a failed check (the eval's, the export's), 69 a service out of reach (an engine, the Hub)
    shared = (errors.EXIT_CHECK_FAILED, errors.EXIT_UNAVAILABLE)
    codes = [code for _, code, _ in errors.OUTCOMES if code not in shared]
    codes += [*shared, errors.EXIT_INTERNAL, errors.EXIT_INTERRUPTED]
    assert len(codes) == len(set(codes))
    from draftsmith.monitor import Outcome

    assert not {int(outcome) for outcome in Outcome} & set(codes)  # the monitor's 0, 10, 11, 12, 13
