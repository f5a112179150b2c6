"""Checkpoints record their files' checksums when saved and are verified before a run resumes from
them: a damaged one (weights cut short in a copy) is one line naming it and the file, exit 2, nothing
touched; `train.resume=latest_intact` resumes from the newest intact one instead; a checkpoint saved
before checksums were recorded still resumes, and the log says it is unverified."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import StorageError, UserError
from draftsmith.trainer import checkpoint as checkpoints
from draftsmith.trainer.checkpoint import (
    CHECKSUMS_NAME,
    STATE_NAME,
    checkpoint_damage,
    load_checkpoint,
    resume_checkpoint,
)
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, train_args, train_in_process


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` (the job lock aside) with its size and modification time."""
    return {
        str(path.relative_to(directory)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != ".draftsmith.lock"
    }


pytestmark = pytest.mark.slow  # its fixture trains two checkpoints


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, small_data, token_cache):
    """A two-step run with a checkpoint after each step."""
    output_dir = tmp_path_factory.mktemp("integrity") / "run"
    steps = ("train.max_steps=2", "train.save_every=1", "data.eval=[]")  # no eval stage: no test reads it
    args = train_args(output_dir, small_data, token_cache, *steps)
    train_in_process(args)
    return output_dir, args


def test_a_checkpoint_records_the_checksums_of_its_files(two_checkpoints):
    output_dir, _ = two_checkpoints
    checkpoint = output_dir / "checkpoints" / "step_0000002"
    recorded = json.loads((checkpoint / CHECKSUMS_NAME).read_text())["files"]
    on_disk = {str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file()} - {CHECKSUMS_NAME}
    assert set(recorded) == on_disk and {STATE_NAME, "model.safetensors", "drafter/model.safetensors"} <= on_disk
    assert checkpoint_damage(checkpoint) is None


def test_damaged_weights_are_named_in_one_line_and_latest_intact_resumes_from_the_one_before(
    two_checkpoints, tmp_path, capsys
):
    source, args = two_checkpoints
    output_dir = tmp_path / "run"
    shutil.copytree(source, output_dir)
    args = [arg.replace(str(source), str(output_dir)) for arg in args]
    newest = output_dir / "checkpoints" / "step_0000002"
    weights = newest / "model.safetensors"
    size = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[: size // 2])  # a copy cut short between machines
    before = snapshot(output_dir)

    refused = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    line = assert_one_line_error(refused, 2)
    assert line.startswith(
        f"error: checkpoint {newest} is damaged: model.safetensors is {size // 2} bytes, {size} were written"
    )
    assert "train.resume=latest_intact" in line
    assert snapshot(output_dir) == before  # nothing loaded, nothing written

    resumed = run_entry_in_process(["train.py", *args, "train.resume=latest_intact"], capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"checkpoint {newest} is damaged (model.safetensors is {size // 2} bytes" in resumed.stderr
    assert "resumed from" in resumed.stderr and "step_0000001 at step 1" in resumed.stderr
    assert checkpoint_damage(output_dir / "checkpoints" / "step_0000002") is None  # trained again


def test_changed_bytes_of_the_same_size_are_found(two_checkpoints, tmp_path):
    source, _ = two_checkpoints
    checkpoint = tmp_path / "step_0000001"
    shutil.copytree(source / "checkpoints" / "step_0000001", checkpoint)
    weights = checkpoint / "drafter" / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    assert checkpoint_damage(checkpoint) == "drafter/model.safetensors differs from what was written (sha256)"
    with pytest.raises(UserError, match=r"step_0000001 is damaged: drafter/model\.safetensors differs"):
        resume_checkpoint(tmp_path, str(checkpoint))
    weights.write_bytes(original)
    assert checkpoint_damage(checkpoint) is None
    (checkpoint / "optimizer.bin").unlink()
    assert checkpoint_damage(checkpoint) == "optimizer.bin is missing"


def test_a_checkpoint_saved_before_checksums_resumes_unverified(two_checkpoints, tmp_path, caplog):
    source, _ = two_checkpoints
    output_dir = tmp_path / "old"
    shutil.copytree(source / "checkpoints", output_dir / "checkpoints")
    for checkpoint in (output_dir / "checkpoints").iterdir():
        (checkpoint / CHECKSUMS_NAME).unlink()
    with caplog.at_level(logging.INFO, logger="draftsmith.train"):
        found = resume_checkpoint(output_dir, "true")
    assert found == output_dir / "checkpoints" / "step_0000002"
    assert f"checkpoint {found} has no {CHECKSUMS_NAME} (saved before checkpoints recorded checksums)" in caplog.text
    assert "resuming from it unverified" in caplog.text
    assert resume_checkpoint(tmp_path / "fresh", "latest_intact") is None  # nothing to resume yet: a fresh run


def test_a_resume_with_another_drafter_is_refused_in_one_line_and_the_runs_recipe_is_kept(
    two_checkpoints, tmp_path, capsys
):
    """Resuming with drafter settings the checkpoint was not trained with, or another kind's recipe, is one
    line naming what to set, exit 2, before the checkpoint loads (it was an internal error from the state
    dict's loader); the run's recipe.yaml still names what it trained, nothing else is touched."""
    source, args = two_checkpoints
    output_dir = tmp_path / "run"
    shutil.copytree(source, output_dir)
    args = [arg.replace(str(source), str(output_dir)) for arg in args]
    before = snapshot(output_dir)
    resume = ["train.py", *args, "train.resume=true"]
    wider = run_entry_in_process([*resume, "drafter.num_heads=4"], capsys)
    assert_one_line_error(wider, 2, "train.resume's")
    assert "is another architecture than the recipe's: drafter.num_heads=4 (" in wider.stderr
    other = run_entry_in_process([*[a for a in resume if a != "recipe=medusa"], "recipe=eagle3"], capsys)
    assert_one_line_error(other, 2, "train.resume's")
    assert "holds a medusa drafter, the recipe trains eagle3: " in other.stderr and "recipe=medusa" in other.stderr
    # a training setting of the drafter (its loss here): the resumed steps would train another loss, recorded as the
    # whole run's
    decayed = run_entry_in_process([*resume, "drafter.loss_decay=0.5"], capsys)
    assert_one_line_error(decayed, 2, "train.resume continues the run of train.resume's")
    assert "drafter.loss_decay=0.5 (the run began with 0.8)" in decayed.stderr and "train.init_from" in decayed.stderr
    # a target of the run's shape with other weights: it trained on from the run's weights without a word
    target = tmp_path / "other_target"
    shutil.copytree(REFERENCE_TARGET, target)
    weights = load_file(str(target / "model.safetensors"))
    weights = {name: tensor * 1.5 if "embed" in name else tensor for name, tensor in weights.items()}
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    moved = run_entry_in_process([*resume, f"target.name_or_path={target}"], capsys)
    assert_one_line_error(moved, 2, "drafter train.resume's")
    assert "has the same shape but other weights" in moved.stderr
    assert snapshot(output_dir) == before


def test_a_resume_whose_saved_recipe_is_damaged_is_one_line_before_any_work(two_checkpoints, tmp_path, capsys):
    """The run's recipe.yaml (where a resumed run reads the start it began from) cut short or edited into
    something else: one line naming it, exit 2, before data or target load (it was an internal error)."""
    source, args = two_checkpoints
    output_dir = tmp_path / "run"
    shutil.copytree(source, output_dir)
    args = [arg.replace(str(source), str(output_dir)) for arg in args]
    (output_dir / "recipe.yaml").write_text("train: [unclosed\n")
    before = snapshot(output_dir)
    done = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert_one_line_error(done, 2, f"{output_dir / 'recipe.yaml'} is not the run's recipe")
    assert "train.overwrite=true" in done.stderr and snapshot(output_dir) == before


# optimizer.bin cut to 5000 bytes: torch's zip reader raises OSError EINVAL (at half its size, a RuntimeError)
@pytest.mark.parametrize("name, kept", [("optimizer.bin", 5000), ("optimizer.bin", 0.5), ("model.safetensors", 0.5)])
def test_a_file_cut_short_in_a_checkpoint_saved_before_checksums_is_one_line_naming_it(
    two_checkpoints, tmp_path, capsys, name, kept
):
    """Without checksums.json nothing is verified before loading: a cut-short optimizer.bin was exit 70 (`internal
    error ...: OSError: [Errno 22] Invalid argument`), and neither its other damage nor model.safetensors' was named."""
    source, args = two_checkpoints
    output_dir = tmp_path / "run"
    shutil.copytree(source, output_dir)
    args = [arg.replace(str(source), str(output_dir)) for arg in args]
    for checkpoint in (output_dir / "checkpoints").iterdir():
        (checkpoint / CHECKSUMS_NAME).unlink()
    newest = output_dir / "checkpoints" / "step_0000002"
    damaged = newest / name
    damaged.write_bytes(damaged.read_bytes()[: kept if kept > 1 else damaged.stat().st_size // 2])
    result = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    line = assert_one_line_error(result, 2, f"checkpoint {newest} (saved without checksums) cannot be loaded: ")
    assert f"loaded: {damaged} may be damaged (" in line


class Payload:
    """An object no safe unpickler allows (unpickling it would run its class's code)."""


def test_a_refused_pickle_met_while_naming_a_damaged_file_is_named_as_refused(tmp_path):
    """Saved without checksums, a scheduler.bin cut short and random states torch's safe unpickler refuses (which
    accelerate skips): the search for the damaged file met the random states first and called them damaged."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    accelerator.prepare(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0))
    folder = tmp_path / "step_0000001"
    accelerator.save_state(str(folder))
    torch.save({"payload": Payload()}, folder / "random_states_0.pkl")
    (folder / "scheduler.bin").write_bytes(b"")
    with pytest.raises(UserError) as info:
        load_checkpoint(accelerator, folder)
    assert str(info.value).startswith(f"checkpoint {folder}: {folder / 'random_states_0.pkl'} holds more than tensors")


@pytest.mark.parametrize(
    "fault, reason",
    [
        (OSError(errno.EIO, "Input/output error"), "[Errno 5] Input/output error; fix the disk"),
        (RuntimeError("PytorchStreamWriter failed writing file: No space left"), "no space left on device; free space"),
    ],
)
def test_a_failed_write_on_a_disk_that_cannot_be_measured_or_listed_is_still_its_one_line(
    tmp_path, monkeypatch, fault, reason
):
    """The room left and the checkpoints kept were read inside the handler: on a failing disk their own OSError
    replaced the write's line (which survived only as its context)."""

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoints.shutil, "disk_usage", failing)
    monkeypatch.setattr(checkpoints, "completed_checkpoints", failing)
    tmp = tmp_path / "checkpoints" / "step_0000002.tmp"
    with pytest.raises(StorageError) as info, checkpoints._writing(tmp, "checkpoint for step 2", tmp_path):
        tmp.mkdir(parents=True)
        raise fault
    assert str(info.value) == (
        f"could not write the checkpoint for step 2 under {tmp.parent}: {reason} and run the same command with "
        "train.resume=true to continue from its last complete checkpoint, if any"
    )
    assert not tmp.exists()


def test_a_missing_final_and_a_training_checkpoint_given_as_the_drafter_say_where_the_drafter_is(tmp_path):
    """A run killed before its end has no final/ (it said 'not a drafter checkpoint (needs config.json ...)' of a
    folder that does not exist), and a training checkpoint holds its drafter in drafter/ (the same line, of a folder
    with a model.safetensors of its own): each says what to give instead."""
    from draftsmith.heads.base import read_checkpoint_config

    with pytest.raises(UserError, match=r"no drafter checkpoint at .*final: train first, or pass checkpoint="):
        read_checkpoint_config(tmp_path / "run" / "final")
    step = tmp_path / "run" / "checkpoints" / "step_0000360"
    (step / "drafter").mkdir(parents=True)
    (step / "drafter" / "config.json").write_text("{}")
    (step / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match=f"is a training checkpoint: its drafter is {step / 'drafter'}"):
        read_checkpoint_config(step)
