"""Nothing is lost: an earlier run is never deleted implicitly, one job writes a directory at a time,
SIGTERM stops training with a checkpoint that resumes bit-identically, non-finite values are caught
where they appear, and a full disk during a checkpoint leaves the previous one intact."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.data_prep.features import MANIFEST_NAME, file_sha256
from draftsmith.errors import EXIT_DIVERGED, EXIT_IO_ERROR, EXIT_PREEMPTED, StorageError, UserError
from draftsmith.outputs import LOCK_NAME, DirectoryLock
from tests.forked import ForkedEntry
from tests.helpers import REFERENCE_TARGET, REPO, assert_one_line_error, read_log, run_entry_in_process, train_args

pytestmark = pytest.mark.slow


def start_train(args: list[str]) -> ForkedEntry:
    """`train.py args` forked from this process, to be stopped or paused: what is tested is what training does then,
    not the interpreter's start."""
    return ForkedEntry(["train.py", *args], timeout=600)


def wait_for(condition, process: subprocess.Popen | ForkedEntry | None = None, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not condition():
        assert process is None or process.poll() is None, f"process ended early: {process.communicate()[1][-2000:]}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


# The runs whose eval stage (the eval split's accuracy after training: 0.5-2 s a run) no assertion here reads
NO_EVAL = "data.eval=[]"


def logged_steps(output_dir: Path) -> int:
    path = output_dir / "log.jsonl"
    return (
        max((json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")), default=0)
        if path.exists()
        else 0
    )


# -- 1. never delete implicitly ---------------------------------------------------------------------
def test_a_rerun_is_refused_resumed_or_started_over_and_nothing_is_deleted(tmp_path, small_data, token_cache, capsys):
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, NO_EVAL, "train.max_steps=2", "train.save_every=1")
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")}
    again = run_entry_in_process(["train.py", *args], capsys)  # without train.resume: refused
    line = assert_one_line_error(again, 2)
    assert "holds an earlier run (checkpoints step_0000001, step_0000002)" in line
    assert "train.resume=true" in line and "train.overwrite=true" in line
    both = run_entry_in_process(["train.py", *args, "train.resume=true", "train.overwrite=true"], capsys)
    assert_one_line_error(both, 2, "both set")
    assert {p: p.stat().st_mtime_ns for p in (out / "checkpoints").rglob("*")} == before  # untouched

    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)  # the latest checkpoint; finished
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step_0000002" in resumed.stderr
    # train.overwrite=true starts over: the earlier run moves aside, and nothing of it is resumed or mixed in.
    fresh = run_entry_in_process(
        ["train.py", *args[:-2], "train.max_steps=1", "train.save_every=1", "train.overwrite=true"], capsys
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000001"]
    assert sorted(read_log(out)) == [1]
    (replaced,) = (out / "replaced").iterdir()
    assert sorted(p.name for p in (replaced / "checkpoints").iterdir()) == ["step_0000001", "step_0000002"]


def test_a_resume_continues_as_the_run_began_or_is_refused_in_one_line(tmp_path, small_data, token_cache, capsys):
    """A resume on another split of the run's step (micro_batch_size 2 x grad_accum 4 for 4 x 2) trains what the
    uninterrupted run trains: its conversations (the data position was counted in micro-batches of the old split: it
    trained some twice) and its steps (accelerate's saved count of micro-batches, 6 at step 3, fell mid-step under
    grad_accum 4: every later optimizer step spanned two of the run's, losses off by 1e-2). Each step logs the
    learning rate it trained at (0 at the first of a warm-up; it logged the next step's). Another step size, an
    optimizer setting, the schedule or the data order changed (the saved optimizer kept the old lr while recipe.yaml
    said the new; the first step resumed under a longer schedule trained at the old one's last rate, 0), is one line
    naming it, the run as it was; so is max_steps below the step another run's checkpoint resumes at (ignored)."""
    args = lambda out, *extra: train_args(out, small_data, token_cache, NO_EVAL, "train.grad_accum=2", *extra)  # noqa: E731
    straight, split = tmp_path / "straight", tmp_path / "split"
    done = run_entry_in_process(["train.py", *args(straight, "train.max_steps=4", "train.save_every=3")], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = read_log(straight)
    # warm-up 2 to train.lr 0.002, then cosine to 0 at step 4: step 1 trains at 0, step 4 halfway down
    assert [theirs[step]["train/lr"] for step in range(1, 5)] == [0.0, 0.001, 0.002, 0.001]

    # its copy resumed from step 3 as 2 x 4: an older checkpoint than its newest, so a branch there
    shutil.copytree(straight, split)
    resplit = ["train.micro_batch_size=2", "train.grad_accum=4", "train.max_steps=4", "train.save_every=3"]
    checkpoint = split / "checkpoints" / "step_0000003"
    resumed = run_entry_in_process(["train.py", *args(split, *resplit, f"train.resume={checkpoint}")], capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed on another split of the run's 8 conversations a step" in resumed.stderr
    ours = read_log(split)
    assert ours[4]["train/tokens"] == theirs[4]["train/tokens"] and ours[4]["train/lr"] == theirs[4]["train/lr"]
    assert ours[4]["train/loss"] == pytest.approx(theirs[4]["train/loss"], rel=1e-6)
    weights, straight_weights = (load_file(str(out / "final" / "model.safetensors")) for out in (split, straight))
    for name, tensor in straight_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-6, atol=1e-6)
    # the newer checkpoint, another branch a later train.resume=true would jump back to, moved aside; log.jsonl
    # lost the row logged past step 3 before the resumed run logged step 4 again (it was [.., 3, 4, 4])
    assert [json.loads(line)["step"] for line in (split / "log.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert sorted(p.name for p in (split / "checkpoints").iterdir()) == ["step_0000003", "step_0000004"]
    assert [p.name for p in (split / "replaced").glob("*/checkpoints/*")] == ["step_0000004"]

    before = sorted(p.name for p in (split / "checkpoints").iterdir()), (split / "recipe.yaml").read_text()
    for extra, fragment in (
        (["train.grad_accum=1"], "this run's steps are of 8 conversations (processes 1, micro_batch_size 2, grad_"),
        (["train.lr=0.01"], "this recipe changes train.lr=0.01 (the run began with 0.002)"),
        (["train.seed=3"], "train.seed=3 (the run began with 0)"),
        (["train.max_steps=6"], "train.max_steps=6 (the run began with 4)"),
        (["train.warmup_steps=0"], "train.warmup_steps=0 (the run began with 2)"),
    ):
        refused = run_entry_in_process(["train.py", *args(split, *resplit, "train.resume=true", *extra)], capsys)
        line = assert_one_line_error(refused, 2, fragment)
        assert "start a new run from its checkpoint with train.init_from" in line
    assert (sorted(p.name for p in (split / "checkpoints").iterdir()), (split / "recipe.yaml").read_text()) == before
    # a checkpoint of another run (no recipe.yaml to keep to): a max_steps below its step is refused
    newest = split / "checkpoints" / "step_0000004"
    elsewhere = args(tmp_path / "elsewhere", *resplit[:2], "train.max_steps=3", f"train.resume={newest}")
    assert_one_line_error(
        run_entry_in_process(["train.py", *elsewhere], capsys), 2, "train.max_steps=3 is below the step 4"
    )

    # a finished run whose checkpoints are gone: train.resume=true started over and replaced its final/
    shutil.rmtree(split / "checkpoints")
    refused = run_entry_in_process(["train.py", *args(split, *resplit, "train.resume=true")], capsys)
    assert_one_line_error(refused, 2, "holds a finished run (final/) and no checkpoint to resume from")


# -- 2. one writer per directory --------------------------------------------------------------------
def test_a_second_job_on_a_busy_directory_is_refused_and_the_first_finishes(tmp_path, small_data, token_cache, capsys):
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, NO_EVAL, "train.max_steps=4", "train.save_every=2")
    first = start_train(args)
    wait_for(lambda: logged_steps(out) >= 1, first)  # running, holding the directory
    first.send_signal(signal.SIGSTOP)  # paused there, the lock held: it cannot finish before the second job asks
    try:
        second = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    finally:
        first.send_signal(signal.SIGCONT)
    line = assert_one_line_error(second, 2)
    assert f"is in use by another job (pid {first.pid} on " in line and "train.py" in line
    stdout, stderr = first.communicate(timeout=600)
    assert first.returncode == 0, stderr[-2000:]
    assert (out / "final" / "model.safetensors").is_file() and sorted(read_log(out))[-1] == 4
    assert not (out / LOCK_NAME).exists()  # released at the end


def test_a_lock_whose_holder_died_is_taken_over_with_a_warning(tmp_path, small_data, token_cache, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv = ['a job that dies']; from draftsmith.outputs import DirectoryLock; "
            f"DirectoryLock({str(out)!r}).acquire(); "
            "import time; time.sleep(600)",
        ],
        cwd=REPO,
    )
    wait_for(lambda: (out / LOCK_NAME).exists() and (out / LOCK_NAME).read_text().strip(), holder)
    with pytest.raises(UserError, match=f"in use by another job \\(pid {holder.pid} .*a job that dies"):
        DirectoryLock(out).acquire()
    holder.kill()  # kill -9: no cleanup; the lock file stays, the kernel drops the flock
    holder.wait()
    assert (out / LOCK_NAME).exists()
    args = train_args(out, small_data, token_cache, NO_EVAL, "train.max_steps=1")
    result = run_entry_in_process(["train.py", *args], capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"taking over the lock of pid {holder.pid}" in result.stderr and "that job is gone" in result.stderr


# -- 3. preemption ----------------------------------------------------------------------------------
def test_sigterm_saves_a_checkpoint_exits_75_and_resume_is_bit_identical(tmp_path, small_data, token_cache, capsys):
    # no periodic checkpoints: preemption must make one. One thread in every run, in this process and in
    # the preempted one: bit-identity across processes needs equal thread counts, and an in-process run
    # otherwise computes with whatever count an earlier test in this worker left (draftsmith/threads.py)
    # 8 steps: the stop lands at step 3-5 (the signal follows step 3's log line), and the resume trains the rest
    steps = [NO_EVAL, "train.max_steps=8", "train.save_every=0", "train.cpu_threads=1"]
    straight = tmp_path / "straight"
    done = run_entry_in_process(["train.py", *train_args(straight, small_data, token_cache, *steps)], capsys)
    assert done.returncode == 0, done.stderr[-2000:]

    preempted = tmp_path / "preempted"
    process = start_train(train_args(preempted, small_data, token_cache, *steps))
    wait_for(lambda: logged_steps(preempted) >= 3, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED, stderr[-2000:]
    assert "preempted: stopped on SIGTERM after step" in stderr and "train.resume=true" in stderr
    (checkpoint,) = (preempted / "checkpoints").iterdir()
    stopped_at = int(checkpoint.name.removeprefix("step_"))
    assert 3 <= stopped_at < 8

    resumed = run_entry_in_process(
        ["train.py", *train_args(preempted, small_data, token_cache, *steps, "train.resume=true")], capsys
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = read_log(straight), read_log(preempted)
    assert [b[step]["train/loss"] for step in range(1, 9)] == [a[step]["train/loss"] for step in range(1, 9)]
    final_a, final_b = (
        load_file(str(straight / "final" / "model.safetensors")),
        load_file(str(preempted / "final" / "model.safetensors")),
    )
    assert all(torch.equal(final_a[name], final_b[name]) for name in final_a)


def test_a_resume_inside_a_log_interval_logs_the_uninterrupted_runs_line(tmp_path, small_data, token_cache, capsys):
    """The first log line after a resume averaged the steps since the resume only: a stop at step 2 of a 4-step
    interval logged steps 3-4's mean loss at step 4, not steps 1-4's. The checkpoint keeps the open interval."""
    steps = [NO_EVAL, "train.max_steps=6", "train.save_every=2", "train.keep_checkpoints=3", "train.log_every=4",
             "train.cpu_threads=1"]  # fmt: skip
    straight = tmp_path / "straight"
    done = run_entry_in_process(["train.py", *train_args(straight, small_data, token_cache, *steps)], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    # the run as a stop after step 2 left it: its checkpoint of step 2 and what it had logged then (nothing)
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_0000002", stopped / "checkpoints" / "step_0000002")
    shutil.copy(straight / "recipe.yaml", stopped / "recipe.yaml")
    args = ["train.py", *train_args(stopped, small_data, token_cache, *steps, "train.resume=true")]
    resumed = run_entry_in_process(args, capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = read_log(straight), read_log(stopped)
    assert sorted(b) == [4, 6]
    for step in (4, 6):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
        assert b[step]["train/padding_fraction"] == a[step]["train/padding_fraction"], step


# -- 4. non-finite values ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_features(tmp_path_factory, small_data, token_cache) -> Path:
    """A Medusa capture whose conversation 0 has a NaN in its final hidden state (the shard and its
    manifest rewritten consistently, as a faulty capture tool would leave them)."""
    from draftsmith.data_prep.capture import capture
    from draftsmith.recipe import load_recipe

    root = tmp_path_factory.mktemp("nan")
    features = root / "features"
    capture(
        load_recipe(
            train_args(
                root / "capture", small_data, token_cache, "data.max_conversations=8", f"data.capture.output={features}"
            )
        )
    )
    manifest = json.loads((features / MANIFEST_NAME).read_text())
    entry = manifest["shards"][0]
    path = features / entry["file"]
    tensors = load_file(str(path))
    first = slice(int(tensors["offsets"][0]), int(tensors["offsets"][1]))
    tensors["final"][first, 7] = float("nan")  # every token of conversation 0
    rewrite_shard(features, manifest, entry, tensors)
    return features


def rewrite_shard(features: Path, manifest: dict, entry: dict, tensors: dict) -> None:
    """A capture's shard rewritten with `tensors`, its manifest entry consistent with it."""
    from safetensors import safe_open

    path = features / entry["file"]
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    save_file(tensors, str(path), metadata=metadata)
    entry["bytes"], entry["sha256"] = path.stat().st_size, file_sha256(path)
    (features / MANIFEST_NAME).write_text(json.dumps(manifest))


def test_a_nan_batch_is_skipped_and_counted_then_the_run_stops_naming_where(
    tmp_path, small_data, token_cache, nan_features, capsys
):
    # Skipped and counted: the run finishes with finite weights.
    skipping = tmp_path / "skipping"
    args = train_args(
        skipping,
        small_data,
        token_cache,
        "data.max_conversations=8",
        f"data.features={nan_features}",
        "train.max_steps=6",
        "train.max_nonfinite=5",
    )
    result = run_entry_in_process(["train.py", *args], capsys)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "non-finite loss or gradient at step" in result.stderr and "target final hidden state" in result.stderr
    log = read_log(skipping)
    assert log[6]["train/skipped_steps"] >= 1
    assert all(torch.isfinite(t).all() for t in load_file(str(skipping / "final" / "model.safetensors")).values())

    # Past train.max_nonfinite: one line naming the step, the samples and the tensor.
    stopping = tmp_path / "stopping"
    args = train_args(
        stopping,
        small_data,
        token_cache,
        "data.max_conversations=8",
        f"data.features={nan_features}",
        "train.max_steps=6",
        "train.max_nonfinite=0",
    )
    result = run_entry_in_process(["train.py", *args], capsys)
    line = assert_one_line_error(result, EXIT_DIVERGED, prefix="training diverged: ")
    assert "more than train.max_nonfinite=0 steps skipped" in line and "at step " in line
    assert "target final hidden state" in line and "shard_00_00000.safetensors conversation 0" in line


def test_a_run_whose_every_step_was_skipped_publishes_nothing_and_ends_as_diverged(
    tmp_path, small_data, token_cache, nan_features, capsys
):
    """Every step non-finite (the NaN conversation alone), fewer than train.max_nonfinite of them: no update was ever
    made, and the run ended exit 0 with final/ holding the drafter's initialization. It ends as diverged (exit 4),
    saying so, with no final/."""
    features = tmp_path / "features"
    shutil.copytree(nan_features, features)
    manifest = json.loads((features / MANIFEST_NAME).read_text())
    for entry in manifest["shards"]:
        tensors = load_file(str(features / entry["file"]))
        tensors["final"][:, 7] = float("nan")  # every conversation's every token
        rewrite_shard(features, manifest, entry, tensors)
    run = tmp_path / "run"
    args = train_args(run, small_data, token_cache, "data.max_conversations=8", f"data.features={features}",
                      "train.max_steps=3", "train.max_nonfinite=5")  # fmt: skip
    result = run_entry_in_process(["train.py", *args], capsys)
    line = assert_one_line_error(result, EXIT_DIVERGED, prefix="training diverged: ")
    assert "every one of the run's 3 step(s) was skipped for a non-finite loss or gradient" in line
    assert not (run / "final").exists()


def test_a_drafter_layer_that_produces_nan_is_named(tmp_path):
    from draftsmith.heads import drafter_class
    from draftsmith.target import load_target, run_target
    from draftsmith.trainer.nonfinite import locate_nonfinite

    target = load_target(str(REFERENCE_TARGET))
    medusa = drafter_class("medusa")
    drafter = medusa.from_target(medusa.Config(num_heads=2), target, "demo")
    drafter.blocks[1].layers[0].linear.weight.data[0, 0] = float("inf")
    ids = torch.randint(3, 4000, (2, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    target_out = run_target(target, ids, batch["attention_mask"], drafter.request)
    loss, _, _ = drafter(batch, target_out)
    assert locate_nonfinite(drafter, batch, target_out, loss) == "drafter module blocks.1.layers.0.linear"
    # A non-finite target output is named first, and the drafter's forward still runs: under ZeRO-3 it gathers the
    # weights, collectives every rank makes (a rank that returned before it left the others waiting in them)
    forwards = []
    drafter.register_forward_hook(lambda module, args, output: forwards.append(module))
    target_out.final[0, 0, 0] = float("nan")
    assert locate_nonfinite(drafter, batch, target_out, loss) == "target final hidden state" and forwards


def test_capture_refuses_to_write_nonfinite_features(tmp_path, small_data, token_cache, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    broken = tmp_path / "broken-target"
    model = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET)
    model.model.norm.weight.data[3] = float("nan")  # every final hidden state gets a NaN
    model.save_pretrained(broken)
    AutoTokenizer.from_pretrained(REFERENCE_TARGET).save_pretrained(broken)
    features = tmp_path / "features"
    args = train_args(
        tmp_path / "capture", small_data, token_cache, "data.max_conversations=4", f"data.capture.output={features}"
    )
    result = run_entry_in_process(["-m", "data_prep.capture", *args, f"target.name_or_path={broken}"], capsys)
    line = assert_one_line_error(result, 2)
    assert "the target's final is not finite at token 0 of" in line and "train.jsonl:" in line  # source:record
    assert not list(features.glob("shard_*.safetensors")) and not (features / MANIFEST_NAME).exists()


# -- 5. a full disk during a checkpoint ----------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 30 MiB tmpfs where the machine lets us mount one (root, no seccomp ban); None elsewhere."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if (
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mount)], capture_output=True).returncode
        != 0
    ):
        yield None
        return
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_during_a_checkpoint_leaves_the_previous_one_intact(
    small_disk, tmp_path, small_data, token_cache, monkeypatch, capsys
):
    # One head: a checkpoint (weights, AdamW state, the drafter) is ~17 MB, so the first fits in
    # 30 MiB and the second does not.
    quick = (
        "drafter.num_heads=1",
        "eval.num_speculative_tokens=1",
        "train.max_steps=4",
        "train.save_every=1",
        "train.keep_checkpoints=2",
    )
    if small_disk is not None:
        out = small_disk / "run"
        result = run_entry_in_process(["train.py", *train_args(out, small_data, token_cache, *quick)], capsys)
        line = assert_one_line_error(result, EXIT_IO_ERROR, prefix="I/O error: ")
    else:  # no tmpfs here: the same failure injected where the checkpoint's weights are written
        from draftsmith.trainer.main import main as train_main

        out = tmp_path / "run"
        real_save, calls = torch.save, []

        def full_disk(*args, **kwargs):
            calls.append(1)
            if len(calls) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_save(*args, **kwargs)

        monkeypatch.setattr(torch, "save", full_disk)
        with pytest.raises(StorageError) as info:
            train_main(train_args(out, small_data, token_cache, *quick))
        line = f"I/O error: {info.value}"
    assert "could not write the checkpoint for step 2" in line and "no space left on device" in line
    assert f"the last complete checkpoint, {out / 'checkpoints' / 'step_0000001'}, is intact" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_0000001"]  # no partial step_0000002.tmp
    weights = load_file(str(out / "checkpoints" / "step_0000001" / "drafter" / "model.safetensors"))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())


@pytest.mark.slow  # a process killed on cue
def test_a_publish_killed_before_its_cleanup_is_followed_by_a_publish_that_lands(tmp_path):
    """final/, best/ and an export folder are replaced by one function (draftsmith.files.publish_folder).
    A job SIGKILLed between its last rename and removing the earlier folder (`<name>.old`) leaves the
    new folder in place and the old one beside it; the next publish of the same folder (best/ again,
    mid-training) still lands, and cleans up."""
    import draftsmith.export.run as export_run
    import draftsmith.trainer.checkpoint as checkpoint
    from draftsmith.files import publish_folder

    assert checkpoint.publish_folder is publish_folder is export_run.publish_folder
    directory, marker = tmp_path / "best", tmp_path / "renamed"
    for name, text in (("best", "first"), ("best.tmp", "second"), ("again", "third")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_text(text)
    stall = (  # the first rmtree (of a stale .old) runs; at the second, both renames are done: stall there
        "import shutil, sys, time\n"
        "from pathlib import Path\n"
        "from draftsmith.files import publish_folder\n"
        "real, calls = shutil.rmtree, []\n"
        "def rmtree(path, **kwargs):\n"
        "    calls.append(path)\n"
        "    if len(calls) == 2:\n"
        f"        Path({str(marker)!r}).touch()\n"
        "        time.sleep(60)\n"
        "    real(path, **kwargs)\n"
        "shutil.rmtree = rmtree\n"
        f"publish_folder(Path({str(tmp_path / 'best.tmp')!r}), Path({str(directory)!r}))\n"
    )
    child = subprocess.Popen([sys.executable, "-c", stall])
    deadline = time.time() + 60
    while not marker.exists() and child.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert (directory / "weights").read_text() == "second" and (tmp_path / "best.old" / "weights").is_file()
    publish_folder(tmp_path / "again", directory)
    assert (directory / "weights").read_text() == "third" and not (tmp_path / "best.old").exists()


def test_a_file_the_new_folder_does_not_hold_is_moved_aside_not_removed(tmp_path, caplog):
    """A re-export in place removed a user's file beside the export's, and an export written into the engine folder
    (a folder of its own inside it), with the earlier folder: they move to replaced/<time>/ with a warning."""
    import logging

    from draftsmith.files import publish_folder

    published, staged = tmp_path / "out" / "vllm", tmp_path / "out" / "vllm.tmp"
    for folder in (published, staged):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_text(folder.name)
    (published / "notes.txt").write_text("mine")
    (published / "vllm").mkdir()
    (published / "vllm" / "config.json").write_text("{}")
    caplog.set_level(logging.WARNING, logger="draftsmith.outputs")
    publish_folder(staged, published)
    [moved] = (tmp_path / "out" / "replaced").iterdir()
    assert (moved / "vllm" / "notes.txt").read_text() == "mine" and (moved / "vllm" / "vllm" / "config.json").is_file()
    assert sorted(p.name for p in published.iterdir()) == ["model.safetensors"]
    assert (published / "model.safetensors").read_text() == "vllm.tmp"
    assert "held 2 file(s) the new one does not" in caplog.text and str(moved) in caplog.text


def test_weights_a_zero_3_rank_holds_in_its_partition_are_checked_before_a_checkpoint():
    """DeepSpeed ZeRO-3 leaves every parameter's local tensor empty (its sum 0 on every rank) and keeps the rank's
    partition in `ds_tensor`: the check summed the empty tensors and passed non-finite weights into a checkpoint. A
    stand-in parameter of that shape (ZeRO-3 needs CUDA) is refused; an unpartitioned one is summed as before."""
    from types import SimpleNamespace

    from draftsmith.errors import TrainingDiverged
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import finite_weights_checksum

    accelerator = SimpleNamespace(unwrap_model=lambda module: module, device=torch.device("cpu"), num_processes=1)
    module = torch.nn.Linear(2, 2, bias=False)
    torch.nn.init.ones_(module.weight)
    assert finite_weights_checksum(accelerator, module, TrainerState()) == 4.0
    module.weight.data = torch.empty(0)
    module.weight.ds_tensor = torch.tensor([1.0, float("inf")])
    with pytest.raises(TrainingDiverged, match="the drafter's weights are not finite after step 0"):
        finite_weights_checksum(accelerator, module, TrainerState())
