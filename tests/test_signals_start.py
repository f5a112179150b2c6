"""Ctrl-C or SIGTERM in a command's first second, while it imports torch, transformers and the rest: `python -m eval`
stopped then printed a KeyboardInterrupt traceback (its imports ran before run_cli), exited 70 (`internal error ...
Could not import module 'LlamaConfig'`: the stop, raised inside numpy's import, left it half-imported for the next
import to fail on), or went on and exited 0 (a library swallowed the stop). A stop that lands in an import now waits
for the import's end (errors.outside_imports), and the command's imports run under run_cli; a library's error raised
while a stop unwinds is the stop (errors.stop_behind)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, run_cli
from draftsmith.target import load_target
from tests.helpers import REFERENCE_TARGET, REPO, assert_one_line_error, save_drafter, stops_handled


def run_stopped(main) -> tuple[int, float]:
    """`main` under run_cli as `eval`, this process's Ctrl-C handler put back after: its exit code and seconds."""
    handler = signal.getsignal(signal.SIGINT)
    started = time.monotonic()
    try:
        with pytest.raises(SystemExit) as stopped:
            run_cli(main, [], "eval")
    finally:
        signal.signal(signal.SIGINT, handler)
    return stopped.value.code, time.monotonic() - started


@pytest.mark.parametrize(
    "signum, code, line",
    [
        (signal.SIGINT, EXIT_INTERRUPTED, "interrupted"),
        (
            signal.SIGTERM,
            EXIT_PREEMPTED,
            "preempted: stopped on SIGTERM; what was finished is kept: run the same command again to continue",
        ),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_a_stop_inside_an_import_is_raised_once_the_import_is_over(signum, code, line, tmp_path, monkeypatch, capsys):
    """The signal lands in the middle of a module's import; the module is imported whole, and the stop is raised
    after it, where the command is (here a sleep, which it ends), as its one line."""
    (tmp_path / "stopped_while_imported.py").write_text(
        f"import signal\nsignal.raise_signal({int(signum)})\nWHOLE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    imported = {}

    def main(args):
        import stopped_while_imported

        imported["whole"] = stopped_while_imported.WHOLE
        time.sleep(30)

    try:
        exit_code, seconds = run_stopped(main)
    finally:
        sys.modules.pop("stopped_while_imported", None)
    assert exit_code == code and imported == {"whole": True}
    assert seconds < 5, "the sleep after the import was not ended by the stop"
    assert capsys.readouterr().err.splitlines() == [line]


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_PREEMPTED)])
def test_a_stop_inside_a_finalizer_is_raised_once_it_is_over(signum, code, capsys):
    """Python drops an exception raised in a `__del__` ("Exception ignored in"): a stop that landed in one (a regex
    pattern's, collected while `python -m draftsmith.random_target` built its model) was lost, and the command went
    on and exited 0. It waits for the finalizer's end and is raised where the command is (here a sleep it ends)."""

    class StoppedWhileCollected:
        def __del__(self):
            signal.raise_signal(signum)

    def main(args):
        StoppedWhileCollected()  # collected at once, its __del__ run inside this line
        time.sleep(30)

    exit_code, seconds = run_stopped(main)
    assert exit_code == code
    assert seconds < 5, "the sleep after the finalizer was not ended by the stop"
    assert "Exception ignored" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "signum, code, line",
    [
        (signal.SIGINT, EXIT_INTERRUPTED, "interrupted"),
        (signal.SIGTERM, EXIT_PREEMPTED, "preempted: stopped on SIGTERM; what was finished is kept: "),
    ],
    ids=["ctrl-c", "sigterm"],
)
def test_a_library_error_raised_while_a_stop_unwinds_is_the_stop(signum, code, line, capsys):
    """A stop raised inside OmegaConf's building of the recipe's schema: its cleanup failed on the half-built node and
    OmegaConf re-raised that as its own error (`AttributeError: 'NoneType' object has no attribute
    '_invalidate_flags_cache' full_key: adam_betas`), exit 70, in `draftsmith eval` stopped as it read its recipe."""

    def main(args):
        try:
            try:
                signal.raise_signal(signum)
            finally:
                raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")
        except AttributeError as err:
            raise AttributeError(f"{err}\n    full_key: adam_betas") from None

    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:
            run_cli(main, [], "eval")
    finally:
        signal.signal(signal.SIGINT, handler)
    assert stopped.value.code == code
    assert capsys.readouterr().err.splitlines()[-1].startswith(line)


def test_a_background_job_keeps_ignoring_ctrl_c():
    """A command started as a background job (`draftsmith train ... &` in a script) inherits SIGINT ignored, so that
    the Ctrl-C typed for the foreground job does not stop it: run_cli leaves it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # put back by tests/conftest.py's ctrl_c_as_in_the_foreground

    def main(args):
        signal.raise_signal(signal.SIGINT)

    with pytest.raises(SystemExit) as finished:
        run_cli(main, [], "eval")
    assert finished.value.code == 0 and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path_factory.mktemp("start") / "final")


# Each entry point of the docs (README, docs/, draftsmith/cli.py): how it is started, for a job that runs well past the
# stops below ({checkpoint}, {out}: a saved drafter, a folder of the test's own). `python -m draftsmith COMMAND`:
# tests/test_cli.py::test_a_stop_while_the_command_loads_is_its_one_line.
ENTRY_POINTS = {
    "train": ["train.py", "recipe=medusa", "train.max_steps=2"],
    "eval": ["-m", "eval", "recipe=medusa", "checkpoint={checkpoint}", "eval.max_prompts=1"],
    "capture": ["-m", "data_prep.capture", "recipe=medusa"],
    "regenerate": ["-m", "data_prep.regenerate", "recipe=medusa"],
    "speculators_features": ["-m", "data_prep.speculators_features", "{out}/features", "recipe=eagle3"],
    "export": ["-m", "export", "recipe=medusa", "checkpoint={checkpoint}"],
    "sweep": ["-m", "export.sweep", "recipe=medusa", "checkpoint={checkpoint}"],
    "monitor": ["-m", "monitor", "check", "recipe=medusa", "checkpoint={checkpoint}"],
    "random_target": ["-m", "draftsmith.random_target", "qwen3", "{out}/target"],
}
# what takes a command's start a second or more to import (torch) or a few tenths (omegaconf, numpy)
HEAVY_MODULES = ("torch", "transformers", "datasets", "accelerate", "omegaconf", "numpy")
# Run as `python -c PROBE ENTRY...`: the entry point up to where it would set its handlers (run_cli or entry_point,
# replaced here), printing the heavy modules it imported before
PROBE = f"""
import runpy, sys
import draftsmith.cli, draftsmith.errors
def handlers_set(*args, **kwargs):
    print(sorted(set(sys.modules) & set({HEAVY_MODULES!r})))
    sys.exit(0)
draftsmith.cli.entry_point = draftsmith.cli.run_cli = draftsmith.errors.run_cli = handlers_set
entry = sys.argv[1:]
sys.argv = entry[1:] if entry[0] == "-m" else entry
if entry[0] == "-m":
    runpy.run_module(entry[1], run_name="__main__", alter_sys=True)
else:
    runpy.run_path(entry[0], run_name="__main__")
"""


def command_line(entry: str, checkpoint: Path, out: Path) -> list[str]:
    own = [arg.format(checkpoint=checkpoint, out=out) for arg in ENTRY_POINTS[entry]]
    if entry == "random_target":
        return own
    common = [f"target.name_or_path={REFERENCE_TARGET}", f"data.cache_dir={out / 'cache'}", f"output_dir={out / 'run'}"]
    return [*own, *common]


def test_every_entry_point_sets_its_stop_handlers_before_its_heavy_imports(tmp_path):
    """`python -m export`, `-m data_prep.capture`, ... imported torch (their package's re-exports, their module's own
    imports) before run_cli set the handlers: a stop in their first 0.2-2 s was a traceback, exit 143 or exit 70. Each
    now sets them first, and imports the rest under them."""
    entries = {entry: command_line(entry, tmp_path / "checkpoint", tmp_path) for entry in ENTRY_POINTS}
    entries["draftsmith"] = ["-m", "draftsmith", "capture", "recipe=medusa"]
    probes = {
        entry: subprocess.Popen(
            [sys.executable, "-c", PROBE, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for entry, args in entries.items()
    }
    imported = {}
    for entry, probe in probes.items():
        out, err = probe.communicate(timeout=60)
        assert probe.returncode == 0, (entry, err[-2000:])
        imported[entry] = out.strip()
    assert imported == dict.fromkeys(probes, "[]")


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_stop_in_the_first_second_of_a_command_is_its_one_line(entry, checkpoint, tmp_path):
    """A real signal at two points of the imports (from the moment the command handles its stops): each one
    line, exit 130 or 75; never 70, 1, 0 or a traceback. `monitor check` here has nothing to monitor: a stop that
    waited for the end of monitor/check.py's import (torch) must win over the refusal (exit 2) that follows it."""
    trials = [(signal.SIGTERM, 0), (signal.SIGINT, 0.3)]  # as the handlers are set, and into the heavy imports
    for number, (signum, delay) in enumerate(trials):
        command = [sys.executable, *command_line(entry, checkpoint, tmp_path / str(number))]
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not stops_handled(process.pid) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(delay)
        process.send_signal(signum)
        out, err = process.communicate(timeout=120)
        code, prefix = (EXIT_INTERRUPTED, "interrupted") if signum == signal.SIGINT else (EXIT_PREEMPTED, "preempted")
        finished = subprocess.CompletedProcess(command, process.returncode, out, err)
        assert_one_line_error(finished, code, prefix=prefix, alone=True)
