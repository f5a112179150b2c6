"""Fault injection with real processes: each job (training, capture, regeneration, export) is ended by the kernel
(as SIGKILL ends it) at seeded random moments while it writes (between its first write and its end, as a
reference run measured; each test checks a kill landed mid-run), run again until it finishes, and must
then hold exactly what an uninterrupted run holds (training: the same per-step losses and final weights;
the others: the same bytes). Meanwhile a reader opens every published file over and over: none may ever be partial.

Then the faults a new user's probe found, each through a real entry point in this process (fast): output
directories that cannot be created or are empty, request logs of which no line is a request, a message naming
a key that does not exist, and `draftsmith` without a command."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import zipfile
from functools import partial
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from draftsmith.outputs import LOCK_NAME
from tests.forked import ForkedCall, ForkedEntry, entry_point
from tests.helpers import (
    REFERENCE_TARGET,
    REPO,
    assert_one_line_error,
    code_folders,
    read_log,
    run_entry_in_process,
    train_args,
)

TRIALS = 1  # each trial is a kill at a seeded random moment in the writing window, and a resume


class PartialFileReader(threading.Thread):
    """Reads every published file under `root` in a loop and records those it cannot read whole.
    Published = not a temporary (`*.tmp`, inside a `*.tmp` directory, dot-files) and not the lock."""

    def __init__(self, root: Path):
        super().__init__(daemon=True)
        self.root, self.stop, self.problems, self.reads = root, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stop.wait(0.005):  # a pause between sweeps leaves the job being killed a core to run on
            try:
                paths = list(self.root.rglob("*"))
            except FileNotFoundError:  # a temporary directory was renamed or removed mid-listing
                continue
            for path in paths:
                if self.stop.is_set():
                    return
                if path.is_file() and not any(
                    part.endswith(".tmp") or part.startswith(".") for part in path.relative_to(self.root).parts
                ):
                    self.check(path)

    def check(self, path: Path) -> None:
        try:
            name = path.name
            if name.endswith(".safetensors"):
                load_file(str(path))
            elif name.endswith(".json") or name == "regenerate.settings":
                json.loads(path.read_text())
            elif name.endswith(".jsonl"):  # append-only: every complete line parses
                for line in path.read_text().splitlines(keepends=True):
                    if line.endswith("\n"):
                        json.loads(line)
            elif name.endswith(".jsonl.gz"):
                for line in gzip.decompress(path.read_bytes()).decode().splitlines():
                    json.loads(line)
            elif name.endswith(".yaml"):
                yaml.safe_load(path.read_text())
            elif name.endswith(".bin"):  # torch.save's zip format (accelerate's optimizer/scheduler state)
                with zipfile.ZipFile(path) as archive:
                    assert archive.testzip() is None
            else:
                return
            self.reads += 1
        except FileNotFoundError:  # pruned or replaced while we looked: not a partial read
            pass
        except Exception as err:  # noqa: BLE001 - any failure to read a published file is the finding
            if path.exists():
                self.problems.append(f"{path}: {type(err).__name__}: {err}")


def has_written(directory: Path) -> bool:
    """A job has written a file into `directory`."""
    return directory.is_dir() and any(p.is_file() for p in directory.rglob("*"))


def killed_after_first_write(args: list[str], watched: Path, seconds: float) -> int:
    """In a forked child: `python args`, ended by the kernel `seconds` after its first write into `watched` (its lock
    file at least: it has claimed the directory). The timer is the kernel's (SIGALRM, whose default action ends the
    process where it is, as SIGKILL does: no handler, no cleanup), armed by a thread of the child that sees the write:
    the test process, which waited and killed before, shares the cores with the job and another worker, woke late,
    found the job finished and measured it slower than it ran, and three tries in a row landed no kill."""

    def arm() -> None:
        while not has_written(watched):
            time.sleep(0.005)
        signal.setitimer(signal.ITIMER_REAL, seconds)

    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the test process's handler, if it had one, is not the kill
    threading.Thread(target=arm, daemon=True).start()
    return entry_point(args)


def run_killed_then_resumed(args: list[str], watched: Path, kill_after: float, resume: list[str], capsys) -> bool:
    """Start `python args` (forked from this process: what is tested is the job's writes, not its start), ended
    `kill_after` seconds after its first write into `watched` unless it finished (`killed_after_first_write`), then run
    `args + resume` until it exits 0 (in this process: nothing kills it), with a reader watching `watched` throughout. A
    job that finished before its kill ran faster than the reference run the moment was drawn from: it starts over in an
    emptied `watched`, killed twice as soon (up to five times). Returns whether the kill landed mid-run."""
    readers = []
    try:
        for _ in range(5):
            process = ForkedCall(partial(killed_after_first_write, args, watched, kill_after), args)
            readers.append(PartialFileReader(watched))  # started after the fork, which copies the locks threads hold
            readers[-1].start()
            if process.wait() == -signal.SIGALRM:
                break
            assert process.returncode == 0, process.output()[1][-3000:]
            kill_after *= 0.5
            readers[-1].stop.set()
            readers[-1].join()
            shutil.rmtree(watched)
        for _ in range(3):
            again = run_entry_in_process([*args, *resume], capsys)
            if again.returncode == 0:
                break
        assert again.returncode == 0, again.stderr[-3000:]
    finally:
        for reader in readers:
            reader.stop.set()
            reader.join()
    problems = [problem for reader in readers for problem in reader.problems]
    assert not problems, problems[:5]
    assert sum(reader.reads for reader in readers) > 0
    assert not (watched / LOCK_NAME).exists()
    return process.returncode == -signal.SIGALRM


def test_a_child_killed_while_it_draws_a_bar_leaves_the_test_processs_bars_free():
    """run_killed_then_resumed kills a forked export anywhere, then resumes it in this process: the resume hung
    forever on tqdm's write lock (a semaphore a fork shares) when the kill landed while the child drew one of the bars
    transformers 5.25 draws as it loads a model, whose class (tqdm.auto's) keeps a lock of its own. A child killed
    holding that class's lock leaves this process's free."""
    import multiprocessing

    from tqdm.auto import tqdm as auto_tqdm
    from tqdm.std import TqdmDefaultWriteLock

    from tests.forked import ForkedCall

    def hold() -> int:
        auto_tqdm.get_lock().acquire()
        print("held", flush=True)
        time.sleep(60)
        return 0

    lock = auto_tqdm.get_lock()  # the test process's, kept on the subclass as a bar drawn before keeps it
    child = ForkedCall(hold)
    try:
        while "held" not in child.output()[0] and child.poll() is None:
            time.sleep(0.01)
        child.kill()
        child.wait(timeout=30)
        acquired = [one.acquire(timeout=5) for one in lock.locks]
        for one, held in zip(lock.locks[::-1], acquired[::-1]):
            if held:
                one.release()
        assert all(acquired), "the killed child still holds this process's tqdm lock"
    finally:  # a dead child's hold would stop this worker's later bars: the class then gets a fresh lock
        if lock.locks[0].acquire(timeout=0):
            lock.locks[0].release()
        else:
            TqdmDefaultWriteLock.mp_lock = multiprocessing.RLock()
            auto_tqdm.set_lock(TqdmDefaultWriteLock())


def writing_window(args: list[str], watched: Path, capsys=None) -> float:
    """Run `args` to completion in this process (the reference run: nothing kills it); the seconds from
    its first write into `watched` to its end: the window in which a kill lands mid-run (before it, a job
    has done nothing to resume)."""
    first_write, finished = [], threading.Event()

    def watch() -> None:
        while not finished.is_set() and not has_written(watched):
            time.sleep(0.02)
        first_write.append(time.perf_counter())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    done = run_entry_in_process(args, capsys)
    finished.set()
    watcher.join()
    assert done.returncode == 0, done.stderr[-3000:]
    return time.perf_counter() - first_write[0]


def digests(directory: Path, pattern: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob(pattern))}


@pytest.mark.slow
def test_training_killed_anywhere_resumes_into_the_same_run(tmp_path, small_data, token_cache, capsys):
    # Muon with AdamW: two optimizers' states saved and restored as one (trainer/optim.py); AdamW's
    # resume is the rest of the suite's (tests/test_heldout.py, tests/test_packing.py). No eval stage: a kill in it
    # would change nothing this test compares (the losses and final/), and it took 1.5 s a run
    quick = (
        "train.max_steps=10", "train.save_every=2", "train.keep_checkpoints=2", "train.optimizer=muon", "data.eval=[]"
    )  # fmt: skip
    reference = tmp_path / "reference"
    window = writing_window(["train.py", *train_args(reference, small_data, token_cache, *quick)], reference, capsys)
    losses = {step: row["train/loss"] for step, row in read_log(reference).items()}
    weights = load_file(str(reference / "final" / "model.safetensors"))
    rng, landed = random.Random(14), []
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        landed.append(
            run_killed_then_resumed(
                ["train.py", *train_args(out, small_data, token_cache, *quick)],
                out,
                rng.uniform(0.0, 0.9 * window),
                ["train.resume=true"],
                capsys,
            )
        )
        assert {step: row["train/loss"] for step, row in read_log(out).items()} == losses, trial
        resumed = load_file(str(out / "final" / "model.safetensors"))
        assert all(resumed[name].equal(weights[name]) for name in weights), trial
    assert any(landed), "no kill landed mid-run: every trial finished first or was killed before writing"


@pytest.mark.slow
def test_ranks_whose_launcher_is_killed_with_its_group_stop_as_on_sigterm(tmp_path, small_data, token_cache):
    """torch-elastic (`accelerate launch --multi_gpu`, torchrun) starts each rank in a session of its own: a launcher
    killed with its process group (`kill -9`, a scheduler's) left both ranks training and holding output_dir, and the
    requeued resume was refused as the directory's holder. The kernel now sends each rank SIGTERM as its launcher
    dies (draftsmith/cli.py `stop_with_the_launcher`): each checkpoints with the other and stops (exit 75)."""
    out = tmp_path / "run"
    launch = ["python", "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29523", "train.py",
              *train_args(out, small_data, token_cache, "train.max_steps=100000", "data.eval=[]")]  # fmt: skip
    with (tmp_path / "launch.log").open("w") as log:
        launcher = subprocess.Popen(launch, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while not read_log_quietly(out) or len(ranks) < 2:  # a step logged: both ranks train
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            ranks = children_of(launcher.pid)
            time.sleep(0.2)
        os.killpg(launcher.pid, signal.SIGKILL)  # as a scheduler ends a job: the launcher's group, no handler
        launcher.wait()
        deadline = time.monotonic() + 300
        while any(running(pid) for pid in ranks):
            assert time.monotonic() < deadline, "the ranks went on training after their launcher was killed"
            time.sleep(0.2)
    finally:
        for pid in [launcher.pid, *ranks]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    said = (tmp_path / "launch.log").read_text()
    assert said.count("preempted: stopped on SIGTERM after step") == 2, said[-3000:]
    stopped_at = int(re.search(r"after step (\d+)", said).group(1))
    assert (out / "checkpoints" / f"step_{stopped_at:07d}" / "trainer_state.json").is_file()  # the resume's


def read_log_quietly(output_dir: Path) -> dict:
    """The run's logged steps so far, none before its log is written."""
    try:
        return read_log(output_dir)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def running(pid: int) -> bool:
    """Whether `pid` still runs: a zombie (ended, not yet reaped by the init process that adopted it) does not."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_capture_killed_anywhere_resumes_into_the_same_bytes(tmp_path, small_data, token_cache, capsys):
    def args(out: Path) -> list[str]:
        return [
            "-m",
            "data_prep.capture",
            *train_args(
                tmp_path / "run",
                small_data,
                token_cache,
                "data.max_conversations=48",
                "data.capture.shard_tokens=400",
                f"data.capture.output={out}",
            ),
        ]

    reference = tmp_path / "reference"
    window = writing_window(args(reference), reference, capsys)
    shards = digests(reference, "shard_*.safetensors")
    manifest = {
        key: value for key, value in json.loads((reference / "manifest.json").read_text()).items() if key != "last_run"
    }
    assert len(shards) >= 6
    rng, landed = random.Random(15), []
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        landed.append(run_killed_then_resumed(args(out), out, rng.uniform(0.0, 0.9 * window), [], capsys))
        assert digests(out, "shard_*.safetensors") == shards, trial
        assert {
            key: value for key, value in json.loads((out / "manifest.json").read_text()).items() if key != "last_run"
        } == manifest
    assert any(landed), "no kill landed mid-run"


REGENERATION = ["data.max_conversations=16", "data.regenerate.batch_size=2", "data.regenerate.max_new_tokens=24"]


def regenerate_args(run: Path, small_data, token_cache, out: Path) -> list[str]:
    """16 conversations regenerated in pairs: 8 part files."""
    quick = [*REGENERATION, f"data.regenerate.output={out}"]
    return ["-m", "data_prep.regenerate", *train_args(run, small_data, token_cache, *quick)]


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, small_data, token_cache) -> tuple[dict[str, str], float]:
    """An uninterrupted regeneration, which both regeneration tests must reproduce: its part files'
    digests, and its writing window."""
    root = tmp_path_factory.mktemp("regenerated")
    window = writing_window(regenerate_args(root / "run", small_data, token_cache, root / "out"), root / "out")
    parts = digests(root / "out", "part-*.jsonl.gz")
    assert len(parts) == 8
    return parts, window


@pytest.mark.slow
def test_regeneration_killed_anywhere_resumes_into_the_same_bytes(
    tmp_path, small_data, token_cache, regenerated, capsys
):
    parts, window = regenerated
    rng, landed = random.Random(16), []
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        args = regenerate_args(tmp_path / "run", small_data, token_cache, out)
        landed.append(run_killed_then_resumed(args, out, rng.uniform(0.0, 0.9 * window), [], capsys))
        assert digests(out, "part-*.jsonl.gz") == parts, trial
    assert any(landed), "no kill landed mid-run"


def sigterm_mid_run(args: list[str], mid_run, timeout: float = 300) -> subprocess.CompletedProcess:
    """Start `python args` (forked: what is tested is the job's stop, not its start), send SIGTERM once
    `mid_run(stderr so far)` says the job is under way (it must not have finished by then), and return how it ended."""
    process = ForkedEntry(args, timeout=timeout)
    while not mid_run(process.output()[1]):
        assert process.poll() is None, "the job ended before it could be interrupted: " + process.output()[1][-2000:]
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate()
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def assert_preempted(done: subprocess.CompletedProcess) -> None:
    """Exit 75 and, after any progress bar, one line saying what to do."""
    assert_one_line_error(done, 75, prefix="preempted: stopped on SIGTERM")


@pytest.mark.slow
def test_sigterm_stops_regeneration_and_eval_mid_run_with_exit_75(
    tmp_path, small_data, token_cache, regenerated, capsys
):
    """Outside training (which checkpoints first), SIGTERM stops a job where it is: exit 75, one line,
    the finished part files kept, and the same command finishes the same bytes."""
    out = tmp_path / "interrupted"
    args = regenerate_args(tmp_path / "run", small_data, token_cache, out)
    done = sigterm_mid_run(args, lambda _: any(out.glob("part-*.jsonl.gz")))
    assert_preempted(done)
    assert 1 <= len(digests(out, "part-*.jsonl.gz")) < 8  # the signal landed mid-run
    again = run_entry_in_process(args, capsys)
    assert again.returncode == 0, again.stderr[-2000:]
    assert digests(out, "part-*.jsonl.gz") == regenerated[0]
    assert not (out / LOCK_NAME).exists()

    from draftsmith.target import load_target
    from tests.helpers import save_drafter

    checkpoint = save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path / "ckpt")
    evaluation = [
        "-m",
        "eval",
        *train_args(tmp_path / "eval", small_data, token_cache, "eval.max_prompts=4", "eval.max_new_tokens=48"),
        f"checkpoint={checkpoint}",
    ]
    done = sigterm_mid_run(
        evaluation, lambda stderr: "prompt/s" in stderr or "s/prompt" in stderr
    )  # the eval's progress bar has moved
    assert_preempted(done)
    assert (
        not (tmp_path / "eval" / "eval" / "report.json").exists()
        and not (tmp_path / "eval" / "eval" / LOCK_NAME).exists()
    )


@pytest.mark.slow
def test_export_killed_anywhere_resumes_into_the_same_bytes(tmp_path, capsys):
    from draftsmith.target import load_target
    from tests.helpers import save_drafter

    checkpoint = save_drafter("eagle3", load_target(str(REFERENCE_TARGET)), tmp_path / "ckpt")

    def args(out: Path) -> list[str]:
        return [
            "-m",
            "export",
            "recipe=eagle3",
            f"checkpoint={checkpoint}",
            f"output_dir={tmp_path / 'run'}",
            f"export.output={out}",
            "export.engines=[vllm,sglang]",
        ]

    def contents(out: Path) -> dict[str, str]:
        """Each file's digest, with the folder's own path (in the cards' serving commands) masked."""
        masked = {
            str(p.relative_to(out)): p.read_bytes().replace(str(out.resolve()).encode(), b"<out>")
            for p in sorted(out.rglob("*"))
            if p.is_file()
        }
        return {name: hashlib.sha256(data).hexdigest() for name, data in masked.items()}

    reference = tmp_path / "reference"
    window = writing_window(args(reference), reference, capsys)
    expected = contents(reference)
    assert {
        "vllm/model.safetensors",
        "sglang/model.safetensors",
        "vllm/README.md",
        "vllm/draftsmith_export.json",
    } <= set(expected)
    rng, landed = random.Random(17), []
    for trial in range(TRIALS):
        out = tmp_path / f"trial{trial}"
        landed.append(run_killed_then_resumed(args(out), out, rng.uniform(0.0, 0.9 * window), [], capsys))
        assert contents(out) == expected, trial
    assert any(landed), "no kill landed mid-run"


# -- the probe's faults: bad input is one line and exit 2, never a traceback (exit 70) ---------------------


@pytest.mark.parametrize(
    "command, key, where, fragment",
    [
        (["-m", "data_prep.capture"], "data.capture.output", "{file}", "{value} exists and is not a directory"),
        (["-m", "data_prep.capture"], None, "features", "{run}/features (data.capture.output) exists and is not"),
        (["-m", "data_prep.regenerate"], "data.regenerate.output", "{file}/sub", "cannot be created: {file} is not a"),
        (["-m", "monitor", "check"], "monitor.state_dir", "{file}", "{value} exists and is not a directory"),
        (["-m", "draftsmith", "sweep"], "export.sweep.output", "{file}", "{value} exists and is not a directory"),
        (["-m", "eval"], None, "eval", "{run}/eval (output_dir/eval: the eval report) exists and is not a directory"),
    ],
    ids=["capture", "capture_default", "regenerate", "monitor", "sweep", "eval_default"],
)
def test_an_output_directory_that_cannot_be_created_is_bad_input_for_every_key(
    tmp_path, capsys, command, key, where, fragment
):
    """Every output key, given (the recipe check, before anything loads) or left to its default under
    output_dir (the job's lock, before it writes), names the key and the file system's reason in one
    line, exit 2, as output_dir and export.output do; nothing is created."""
    file, run = tmp_path / "afile", tmp_path / "run"
    file.write_text("not a directory\n")
    if key is None:  # a file where the job's default folder under output_dir goes
        run.mkdir()
        (run / where).write_text("not a directory\n")
    value = where.format(file=file)
    given = [] if key is None else [f"{key}={value}"]
    result = run_entry_in_process([*command, "recipe=medusa", f"output_dir={run}", *given], capsys)
    assert_one_line_error(result, 2, fragment.format(file=file, run=run, value=f"{key}='{value}'"))
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["afile", *(["run", where] if key is None else [])])


@pytest.mark.parametrize(
    "key",
    ["output_dir", "data.capture.output", "data.regenerate.output", "export.output", "export.sweep.output",
     "monitor.state_dir"],
)  # fmt: skip
def test_an_empty_output_key_is_refused_not_taken_as_the_current_folder(tmp_path, monkeypatch, capsys, key):
    """`output_dir=` (an unset shell variable) was the current folder: a folder holding the user's eval/
    was "an earlier run", moved aside with train.overwrite=true and trained into. Every output key refuses
    an empty value; the current folder is left as it was."""
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "mine.txt").write_text("the user's\n")
    monkeypatch.chdir(tmp_path)
    others = [] if key == "output_dir" else [f"output_dir={tmp_path / 'run'}"]
    quick = ["train.overwrite=true", "train.max_steps=1", "eval.enabled=false", "data.eval=[]"]  # were it run
    args = ["train.py", "recipe=medusa", *others, f"{key}=", *quick]
    assert_one_line_error(run_entry_in_process(args, capsys), 2, f"error: {key} is empty: give a directory")
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == ["eval", "eval/mine.txt"]


def served_medusa_export(folder: Path) -> Path:
    """What a check of the traffic reads of a deployed export: its draftsmith_export.json (no weights)
    and the eval report it names, of the same weights (α 0.5 over 3000 drafted tokens)."""
    from draftsmith.formats.repo import EXPORT_INFO

    weights = "0" * 64
    report = folder.parent / "report.json"
    counts = {"reached": [1000, 700, 500], "accepted": [700, 500, 300]}
    chain = {"drafted": 3000, "accepted": 1500, "per_position_counts": counts}
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps({"drafter": {"sha256": weights}, "domains": {"all": {"chain": chain}}}))
    folder.mkdir()
    source = {"checkpoint": str(folder.parent / "final"), "sha256": weights}
    (folder / EXPORT_INFO).write_text(json.dumps({"source": source, "eval_report": {"path": str(report)}}))
    return folder


def test_a_monitor_check_that_reads_no_request_is_refused_and_one_that_judges_nothing_is_not_healthy(tmp_path, capsys):
    """Request logs of which no line is a request (another log format) were "monitor: healthy", exit 0,
    having judged nothing: now one line naming the first line and the fields a request has, exit 2,
    nothing written. Once a line is a request the malformed ones are counted, not fatal, and a check
    with too few samples to judge exits 0 (no drift) without saying healthy."""
    traffic, run = tmp_path / "traffic", tmp_path / "run"
    traffic.mkdir()
    log = traffic / "gateway.jsonl"
    log.write_text("".join(json.dumps({"prompt": f"p{i}", "response": "r", "ts": i}) + "\n" for i in range(50)))
    args = ["-m", "monitor", "check", "recipe=medusa", f"output_dir={run}", f"monitor.traffic={traffic}",
            f"checkpoint={served_medusa_export(tmp_path / 'export' / 'vllm')}"]  # fmt: skip
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2, "none of its 50 logged line(s) is a request")
    assert f"(the first: {log}:1)" in line and '"messages"' in line and not run.exists()

    spec = {"speculative_decoding": {"acceptance_histogram": [3, 2, 1], "num_draft_tokens": 18}}
    request = {"messages": [{"role": "user", "content": "hi"}], "domain": "code", "metrics": spec,
               "timestamp": time.time()}  # fmt: skip
    (traffic / "served.jsonl").write_text(json.dumps(request) + "\n")
    result = run_entry_in_process(args, capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    # what was measured, and that it was too little to judge: the check's result alone on stdout
    assert result.stdout.splitlines() == [
        "monitor: too few samples: 1 logged request in the last 86400 s (code too few samples)"
    ]
    record = json.loads((run / "monitor" / "checks" / "00001.json").read_text())
    assert record["traffic"]["malformed_lines"] == 50 and record["verdict"] == "too few samples"


# a dotted recipe key in product code's strings; a module path (`export.verify.EngineSession`) or a file
# (`train.py`) has a capital or ends in .py, and the drafter section is each kind's own (not checked here)
NAMED_KEY = re.compile(r"(?<![\w./-])(?:target|data|train|eval|export|monitor)(?:\.\w+)+")


def test_every_recipe_key_a_message_names_exists():
    """A message told users to "check monitor.metrics_urls", a key that does not exist (it is
    monitor.metrics): every key product code names is one of the schema's, or an old name the recipe
    answers for (draftsmith.recipe.RENAMED)."""
    import ast

    from omegaconf import OmegaConf

    from draftsmith.recipe import RENAMED, compose
    from draftsmith.recipe_input import split_argv

    cfg, absent = compose(*split_argv(["recipe=medusa"])), object()
    files = [REPO / "train.py", *(path for root in code_folders() for path in sorted((REPO / root).rglob("*.py")))]
    unknown = [
        f"{path.relative_to(REPO)}:{node.lineno} {key}"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for key in NAMED_KEY.findall(node.value)
        if key.islower() and not key.endswith(".py") and key not in RENAMED
        if OmegaConf.select(cfg, key, default=absent) is absent
    ]
    assert not unknown, unknown


def test_draftsmith_without_a_command_says_so_on_stderr_and_lists_every_monitor_outcome(capsys):
    """No command: the usage on stdout and one line on stderr, exit 2 (stderr was empty). The usage lists
    every exit code a monitor check adds (13 was missing), as docs/faults.md does."""
    from draftsmith.monitor import Outcome

    result = run_entry_in_process(["-m", "draftsmith"], capsys)
    assert_one_line_error(result, 2, "error: no command given; commands: train, eval, capture", alone=True)
    codes = ", ".join(str(int(outcome)) for outcome in Outcome if outcome)
    assert f"`monitor check` adds its outcomes {codes}." in " ".join(result.stdout.split())
    assert f"| {codes} | `monitor check`'s outcomes" in (REPO / "docs" / "faults.md").read_text()
