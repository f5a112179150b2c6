"""Faults a probe of training runs found, each through a real entry point in this process: a tokenized-data cache
that cannot be used, train.epochs that a set train.max_steps leaves unread, a train.resume that is no keyword
and no path, and the advice of the lines that end a run (exit 74, 75), which must hold for a training run."""

from __future__ import annotations

import errno
import os
import signal
import time

import pytest

from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe
from tests.helpers import assert_one_line_error, run_entry_in_process, train_args

RESUME_ADVICE = "run the same command with train.resume=true to continue"


@pytest.mark.parametrize("command", [["train.py"], ["-m", "data_prep.capture"]], ids=["train", "capture"])
def test_a_tokenized_data_cache_that_cannot_be_created_is_bad_input_before_the_data_is_read(
    tmp_path, monkeypatch, capsys, command
):
    """data.cache_dir a file (or under one) was exit 70 (`NotADirectoryError`) once the data had been read; its
    default, ~/.cache/draftsmith, is checked the same way. Nothing is created."""
    file, run = tmp_path / "afile", tmp_path / "run"
    file.write_text("not a directory\n")
    for given, fragment in (
        (f"data.cache_dir={file}", f"data.cache_dir='{file}' exists and is not a directory"),
        (f"data.cache_dir={file}/sub", f"data.cache_dir='{file}/sub' cannot be created: {file} is not a directory"),
    ):
        result = run_entry_in_process([*command, "recipe=medusa", f"output_dir={run}", given], capsys)
        assert_one_line_error(result, 2, fragment)
    monkeypatch.setenv("HOME", str(file))  # the default's folder under a file
    monkeypatch.delenv("DRAFTSMITH_CACHE", raising=False)
    result = run_entry_in_process([*command, "recipe=medusa", f"output_dir={run}", "data.cache_dir=null"], capsys)
    fragment = (
        f"data.cache_dir=null (its default, {file}/.cache/draftsmith) cannot be created: {file} is not a directory"
    )
    assert_one_line_error(result, 2, fragment)
    assert [p.name for p in tmp_path.iterdir()] == ["afile"]
    # a command that reads a checkpoint tokenizes nothing: its default cache is not asked of (a read-only HOME)
    result = run_entry_in_process(["-m", "eval", "recipe=medusa", f"output_dir={run}", "--cfg"], capsys)
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, key",
    [("medusa", "data.train"), ("medusa", "data.eval"), ("medusa", "eval.data"), ("eagle3", "data.draft_vocab")],
)
def test_a_data_file_that_does_not_exist_is_named_before_the_target_loads(tmp_path, monkeypatch, capsys, recipe, key):
    """The target loads before the data is tokenized (a wrapper it cannot be is refused first), but a data path that
    does not exist is still one line before it: the target's load (here made to fail) is never reached."""
    import draftsmith.trainer.setup as setup

    def no_load(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(setup, "load_target", no_load)
    missing = tmp_path / "no_such.jsonl"
    args = ["train.py", f"recipe={recipe}", f"output_dir={tmp_path / 'run'}", f"{key}=[{missing}]"]
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"data file '{missing}' does not exist")


def test_what_a_command_does_not_read_is_not_refused_and_a_variant_is_checked_for_its_command(tmp_path):
    """A run's saved recipe may hold train.epochs beside max_steps (a command-line max_steps once kept the file's
    epochs): eval never reads them. A variant of a read-only command's recipe (the sweep's export, the monitor's
    replay) is checked for that command: its chain against the checkpoint's, not the recipe's drafter section."""
    from draftsmith.recipe import derived, validated
    from draftsmith.target import load_target
    from tests.helpers import REFERENCE_TARGET, save_drafter

    assert validated(["recipe=medusa", "train.epochs=2"], "eval").train.epochs == 2
    with pytest.raises(UserError, match="train.epochs=2 is not read while train.max_steps=200"):
        validated(["recipe=medusa", "train.epochs=2"], "train")
    assert load_recipe(["recipe=medusa_llama3_8b", "train.max_steps=-1"]).train.epochs == 2  # -1: by epochs
    target = load_target(str(REFERENCE_TARGET))
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt", num_heads=5, **{"eval.num_speculative_tokens": 5})
    args = ["recipe=medusa", f"checkpoint={checkpoint}", f"output_dir={tmp_path}", "eval.num_speculative_tokens=5"]
    cfg = validated([*args, "eval.tree=0"], "export")  # the recipe's 3 heads would propose 3
    assert derived(cfg, {"export.output": str(tmp_path / "x")}, "export").eval.num_speculative_tokens == 5


def test_epochs_that_max_steps_leaves_unread_are_refused():
    """recipe=medusa sets train.max_steps=200: train.epochs=2 was ignored without a word. With max_steps=-1, or
    at its default, it passes; so does a max_steps the command line gives over a recipe file's own epochs (the
    command line sets the run's length, and the resolved recipe says epochs 1), not both on the command line."""
    with pytest.raises(UserError) as info:
        load_recipe(["recipe=medusa", "train.epochs=2"])
    assert str(info.value) == (
        "train.epochs=2 is not read while train.max_steps=200 sets the run's length: give train.max_steps=-1 with "
        "it, or train.epochs=1"
    )
    assert load_recipe(["recipe=medusa", "train.epochs=2", "train.max_steps=-1"]).train.epochs == 2
    assert load_recipe(["recipe=medusa", "train.epochs=1"]).train.max_steps == 200
    given = load_recipe(["recipe=medusa_llama3_8b", "train.max_steps=10"]).train  # its recipe file says epochs: 2
    assert (given.max_steps, given.epochs) == (10, 1)
    with pytest.raises(UserError, match=r"^train.epochs=2 is not read while train.max_steps=10 "):
        load_recipe(["recipe=medusa_llama3_8b", "train.max_steps=10", "train.epochs=2"])


@pytest.mark.parametrize("value", ["yes", "1", "on", "Latest_Intact"])
def test_a_resume_that_is_no_keyword_and_no_path_is_refused_naming_the_accepted_values(value):
    """`train.resume=yes` was read as a checkpoint's path: "is not a complete checkpoint (no trainer_state.json)"."""
    with pytest.raises(UserError) as info:
        load_recipe(["recipe=medusa", f"train.resume={value}"])
    assert str(info.value) == (
        f"train.resume={value} is none of true, false, latest_intact or a checkpoint's path (no such path here)"
    )


def test_a_resume_keyword_or_path_passes_the_recipe_check_and_a_missing_path_is_named_by_the_resume(tmp_path, capsys):
    for value in ("true", "false", "latest_intact", "latest", "null", str(tmp_path), str(tmp_path / "missing")):
        load_recipe(["recipe=medusa", f"train.resume={value}"])
    missing = tmp_path / "run" / "checkpoints" / "step_0000002"
    result = run_entry_in_process(
        ["train.py", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"train.resume={missing}"], capsys
    )
    assert_one_line_error(result, 2, f"train.resume='{missing}' does not exist; give a checkpoint's folder, or train")
    missing.mkdir(parents=True)
    result = run_entry_in_process(
        ["train.py", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"train.resume={missing}"], capsys
    )
    assert_one_line_error(result, 2, f"train.resume='{missing}' is not a complete checkpoint (no trainer_state.json)")


@pytest.mark.slow  # 2.3-3 s on a 2-core CI machine: over the fast tier's share (docs/tests.md)
def test_the_advice_to_run_again_holds_for_a_training_run(tmp_path, small_data, token_cache, monkeypatch, capsys):
    """Exit 74's line said "run the same command again", which a training run refuses (its output_dir holds an
    earlier run, exit 2): it names train.resume=true, with which the same command continues. The line of SIGTERM
    outside the training loop (exit 75) says what the run kept (trainer/main.py after_interrupt), as Ctrl-C's
    does: before anything is written, the same command, which then runs."""
    import draftsmith.trainer.loop as loop

    out = tmp_path / "run"
    quick = ("train.max_steps=2", "data.eval=[]")  # no eval stage: nothing here reads it
    args = ["train.py", *train_args(out, small_data, token_cache, *quick)]

    def full_disk(accelerator, output_dir, *rest):
        raise OSError(errno.ENOSPC, "No space left on device", str(output_dir / "run_summary.json"))

    with monkeypatch.context() as patch:
        patch.setattr(loop, "write_run_summary", full_disk)
        line = assert_one_line_error(run_entry_in_process(args, capsys), 74, prefix="I/O error: ")
    assert line.endswith(f"; free space (or fix the disk) and {RESUME_ADVICE}")
    assert_one_line_error(run_entry_in_process(args, capsys), 2, f"output_dir {out} holds an earlier run")
    assert run_entry_in_process([*args, "train.resume=true"], capsys).returncode == 0
    assert (out / "final").is_dir() and (out / "run_summary.json").is_file()

    def sigterm(*args, **kwargs):  # a scheduler's SIGTERM while the run sets up, before its loop
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)

    monkeypatch.setattr(loop, "set_up", sigterm)
    stopped = ["train.py", *train_args(tmp_path / "stopped", small_data, token_cache, *quick)]
    line = assert_one_line_error(run_entry_in_process(stopped, capsys), 75, prefix="preempted: ")
    assert line == "preempted: stopped on SIGTERM; nothing was written: run the same command again"
    monkeypatch.undo()
    assert run_entry_in_process(stopped, capsys).returncode == 0  # as the line says


def test_a_resume_of_a_run_saved_before_a_key_existed_reads_it_as_its_default(tmp_path):
    """recipe.yaml of a run saved before data.thinking, data.skip_invalid_utf8 and train.optimizer existed: a
    resume with the same command was refused ("the run began with null"), a monitor's resumed retraining on
    every check. A key the saved recipe lacks is its default; a changed one is still refused."""
    from omegaconf import OmegaConf

    from draftsmith.recipe import save_recipe
    from draftsmith.trainer.setup import require_resumed_as_begun

    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path}"])
    save_recipe(cfg, tmp_path)
    saved = OmegaConf.load(tmp_path / "recipe.yaml")
    for section, key in (("data", "thinking"), ("data", "skip_invalid_utf8"), ("train", "optimizer")):
        del saved[section][key]
    (tmp_path / "recipe.yaml").write_text(OmegaConf.to_yaml(saved))
    require_resumed_as_begun(cfg, tmp_path)
    with pytest.raises(UserError, match=r"train.lr=0.01 \(the run began with 0.002\)"):
        require_resumed_as_begun(load_recipe(["recipe=medusa", f"output_dir={tmp_path}", "train.lr=0.01"]), tmp_path)


def test_a_resume_in_another_precision_is_refused_unless_the_run_did_not_record_one(tmp_path):
    """recipe.yaml records the precision the run computed in; a resume computing in another (a bundled accelerate
    config's bf16 after a plain float32 run) is refused in one line. A run saved by an earlier draftsmith recorded
    `auto`, which does not say what ran: not refused."""
    from omegaconf import OmegaConf

    from draftsmith.recipe import derived, save_recipe
    from draftsmith.trainer.launcher import require_precision_as_begun

    cfg = load_recipe(["recipe=medusa", f"output_dir={tmp_path}"])
    save_recipe(derived(cfg, {"train.mixed_precision": "no"}), tmp_path)
    require_precision_as_begun("no", "auto", tmp_path)
    with pytest.raises(UserError, match=r"in mixed precision no, and this launch runs bf16 \(train.mixed_precision"):
        require_precision_as_begun("bf16", "auto", tmp_path)
    saved = OmegaConf.load(tmp_path / "recipe.yaml")
    saved.train.mixed_precision = "auto"
    (tmp_path / "recipe.yaml").write_text(OmegaConf.to_yaml(saved))
    require_precision_as_begun("bf16", "auto", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "settings, fragment",
    [
        (["eval.enabled=true", "eval.device=cuda"], "device 'cuda' asked for but no CUDA device is available"),
        (["eval.enabled=true", "eval.max_new_tokens=100000"], "eval.max_new_tokens=100000 leaves no room for a prompt"),
        (["recipe=eagle3", "drafter.ttt_attention=flex"], "drafter.ttt_attention=flex trains on CUDA only"),
    ],
    ids=["eval-device", "eval-room", "flex"],
)
def test_what_the_run_cannot_do_on_this_machine_is_refused_before_it_trains_or_writes(
    tmp_path, small_data, token_cache, capsys, settings, fragment
):
    """The eval stage's device and a prompt's room were refused after the whole training (its rerun then refused as
    an earlier run), flex training off CUDA at the first step, after recipe.yaml, the data's record and tb/ were
    written (following its own advice was then refused as an earlier run). Each is one line before anything is
    written."""
    import torch

    if "cuda" in fragment and torch.cuda.is_available():
        pytest.skip("a CUDA device is available")
    run = tmp_path / "run"
    result = run_entry_in_process(["train.py", *train_args(run, small_data, token_cache, *settings)], capsys)
    assert_one_line_error(result, 2, fragment)
    assert [path.name for path in run.glob("*") if not path.name.startswith(".")] == []  # its lock aside
