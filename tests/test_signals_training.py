"""Training stopped while it ends or writes: SIGTERM in the last step stops the run once final/ is written (it ran
the whole eval stage and exited 0), Ctrl-C or SIGTERM during a checkpoint's or final/'s write leaves no partial
copy, and a write that fails says the command that continues (the same command alone is refused)."""

from __future__ import annotations

import errno
import importlib
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import draftsmith.trainer.checkpoint as checkpoint
import draftsmith.trainer.loop as loop
from draftsmith.errors import EXIT_INTERRUPTED, EXIT_IO_ERROR, EXIT_PREEMPTED, EXIT_USER_ERROR
from draftsmith.outputs import ACCURACY_NAME
from tests.forked import ForkedEntry
from tests.helpers import assert_one_line_error, corpus_slice, run_entry_in_process, train_args

pytestmark = pytest.mark.slow  # each trains

QUICK = ("data.max_conversations=8", "train.max_steps=2", "train.cpu_threads=1")
RESUME = "run the same command with train.resume=true"


@pytest.fixture(scope="module")
def data(small_data, tmp_path_factory) -> dict[str, Path]:
    """The small corpus slice with an eval split of one conversation a domain: the eval stage here is where a run is
    stopped or whose end is checked, never what it measures (the slice's 24 conversations: about 1.5 s a stage)."""
    eval_split = corpus_slice(tmp_path_factory.mktemp("eval") / "eval.jsonl", "eval", 1)
    return {"train": small_data["train"], "eval": eval_split}


def test_sigterm_in_the_last_step_stops_once_final_is_written_and_a_resume_runs_the_eval(
    tmp_path, data, token_cache, monkeypatch, capsys
):
    """A real SIGTERM while the last step runs: it was noted ("saving a checkpoint at the end of this step, then
    stopping"), then the run wrote final/, ran the whole eval stage and exited 0."""
    out, marker = tmp_path / "run", tmp_path / "last_step"
    args = train_args(out, data, token_cache, *QUICK, "train.save_every=0")
    real = loop.train_step

    def last_step_waits(run, step, agreed, stream, stop):  # held until the signal has landed in it (a poll)
        if run.state.step + 1 == run.max_steps:
            marker.touch()
            deadline = time.monotonic() + 60
            while not stop.requested and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(run, step, agreed, stream, stop)

    with monkeypatch.context() as patch:  # in the forked run only: the real entry point, its last step waiting
        patch.setattr(loop, "train_step", last_step_waits)
        process = ForkedEntry(["train.py", *args])
    while not marker.exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    stopped = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    line = assert_one_line_error(stopped, EXIT_PREEMPTED, prefix="preempted: ")
    assert line == (
        f"preempted: stopped on SIGTERM at the end of training (step 2 of 2): {out / 'final'} is written; {RESUME} to "
        "run what follows training (its eval-split accuracy)"
    )
    assert "SIGTERM: saving a checkpoint at the end of this step, then stopping" in stderr + stdout
    assert (out / "checkpoints" / "step_0000002" / "trainer_state.json").is_file()
    trained = load_file(str(out / "final" / "model.safetensors"))
    assert not (out / ACCURACY_NAME).exists()  # the eval stage did not start

    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / ACCURACY_NAME).is_file()  # the eval stage ran, on the same drafter
    again = load_file(str(out / "final" / "model.safetensors"))
    assert trained.keys() == again.keys() and all(torch.equal(trained[k], again[k]) for k in trained)


def sigterm_in(function: str, args: list[str], marker: Path, monkeypatch) -> subprocess.CompletedProcess:
    """`train.py args` forked from this process (what is tested is the stop, not the interpreter's start), stopped by
    a real SIGTERM while `function` (module.name) runs: it touches `marker`, then waits for the signal."""
    module, name = function.rsplit(".", 1)
    real = getattr(importlib.import_module(module), name)

    def waiting(*args, **kwargs):
        marker.touch()
        time.sleep(60)
        return real(*args, **kwargs)

    with monkeypatch.context() as patch:  # in the forked run only
        patch.setattr(importlib.import_module(module), name, waiting)
        process = ForkedEntry(["train.py", *args])
    while not marker.exists() and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


@pytest.mark.parametrize(
    "function, advice",
    [
        (
            "draftsmith.eval.report.evaluate_trained_run",
            "training finished ({out}/final is written): run the same command with train.resume=true to run what "
            "follows training (its eval-split accuracy)",
        ),
        ("draftsmith.trainer.setup.load_data", "nothing was written: run the same command again"),
    ],
    ids=["eval-stage", "tokenizing"],
)
def test_sigterm_outside_the_training_loop_says_what_continues_the_run(
    function, advice, tmp_path, data, token_cache, monkeypatch, capsys
):
    """SIGTERM in the eval stage, after final/ is published, or while the data is tokenized before step 0: the line
    said `train.resume=true to continue` whatever the run had written; it says what Ctrl-C's says there
    (`after_interrupt`: in the eval stage, that training finished and what runs the evaluation, not which checkpoint
    a resume continues from), and the command it names runs to the end."""
    out = tmp_path / "run"
    args = train_args(out, data, token_cache, *QUICK, "train.save_every=0")
    stopped = sigterm_in(function, args, tmp_path / "waiting", monkeypatch)
    line = assert_one_line_error(stopped, EXIT_PREEMPTED, prefix="preempted: ")
    assert line == f"preempted: stopped on SIGTERM; {advice.format(out=out)}"
    again = [*args, "train.resume=true"] if "train.resume=true" in advice else args
    continued = run_entry_in_process(["train.py", *again], capsys)
    assert continued.returncode == 0, continued.stderr[-2000:]
    assert (out / ACCURACY_NAME).is_file()


@pytest.mark.parametrize("stopped", ["checkpoints/step_0000001", "final"])
def test_ctrl_c_while_a_checkpoint_or_final_is_written_leaves_no_partial_copy(
    stopped, tmp_path, small_data, token_cache, monkeypatch, capsys
):
    """Ctrl-C once the drafter's weights were written into `<name>.tmp`: the folder was left (`final.tmp/`,
    `checkpoints/step_0000001.tmp/`), removed only by the next run."""
    out = tmp_path / "run"
    real = checkpoint.save_drafter

    def interrupted(accelerator, drafter, directory: Path) -> None:
        real(accelerator, drafter, directory)
        if directory.as_posix().endswith(f"{stopped}.tmp") or directory.parent.as_posix().endswith(f"{stopped}.tmp"):
            raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_drafter", interrupted)
    args = train_args(out, small_data, token_cache, *QUICK, "train.save_every=1", "data.eval=[]")
    result = run_entry_in_process(["train.py", *args], capsys)
    assert_one_line_error(result, EXIT_INTERRUPTED, prefix="interrupted")
    assert not list(out.rglob("*.tmp")) and (stopped == "final" or not (out / "final").exists())


@pytest.mark.parametrize(
    "failure, step, code, said",
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            2,
            EXIT_IO_ERROR,
            "no space left on device ({free} MiB free); the last complete checkpoint, {out}/checkpoints/step_0000001, "
            f"is intact: free space and {RESUME} to continue from it",
        ),
        (  # an immutable checkpoints/ folder (chattr +i): a PermissionError, bad input as anywhere else (it was 74)
            PermissionError(errno.EPERM, "Operation not permitted", "{out}/checkpoints/step_0000001.tmp/drafter"),
            1,
            EXIT_USER_ERROR,
            "permission denied ({out}/checkpoints/step_0000001.tmp/drafter); no earlier checkpoint exists: fix its "
            f"permissions and {RESUME} to start again from step 0",
        ),
    ],
    ids=["full-disk", "permission"],
)
def test_a_checkpoint_that_cannot_be_written_says_the_command_that_continues(
    failure, step, code, said, tmp_path, small_data, token_cache, monkeypatch, capsys
):
    """It said what was intact but not what to run, and the same command again is refused (`holds an earlier run`);
    the command the line names continues the run."""
    out = tmp_path / "run"
    real = checkpoint.save_drafter

    def failing(accelerator, drafter, directory: Path) -> None:
        if directory.parent.name == f"step_{step:07d}.tmp":
            if isinstance(failure, PermissionError):
                raise PermissionError(failure.errno, failure.strerror, failure.filename.format(out=out))
            raise failure
        real(accelerator, drafter, directory)

    monkeypatch.setattr(checkpoint, "save_drafter", failing)
    args = train_args(out, small_data, token_cache, *QUICK, "train.save_every=1", "data.eval=[]")
    result = run_entry_in_process(["train.py", *args], capsys)
    line = assert_one_line_error(result, code, prefix="I/O error: " if code == EXIT_IO_ERROR else "error: ")
    assert re.search(re.escape(said.format(out=out, free="FREE")).replace("FREE", r"[0-9.]+") + "$", line), line
    assert not list(out.rglob("*.tmp"))
    monkeypatch.undo()
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert (out / "final" / "model.safetensors").is_file()
