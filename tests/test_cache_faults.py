"""Caches and files whose faults were blamed on something else: a Hugging Face datasets cache that is full,
read-only or forbidden (it was `cannot read FILE: DatasetGenerationError`, the data file blamed), a damaged
tokenized-data cache (exit 70 in every later run), a tokenizer.json that is JSON but no tokenizer (exit 70), a
full disk's line that named no folder, an existing output folder called one that "cannot be created", and a
capture shard's `.tmp` left by Ctrl-C. The faults are injected (the tests run as root in CI without mounts);
docs/faults.md names the real checks (tmpfs mounts, read-only remounts, `setpriv`)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import datasets
import huggingface_hub
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

from draftsmith import errors
from draftsmith.data_prep import capture_files
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import tokenize_conversations
from draftsmith.errors import StorageError, UserError
from draftsmith.outputs import check_output_dir
from draftsmith.target import load_tokenizer
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, train_args


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(REFERENCE_TARGET))


@pytest.fixture
def conversations(small_data):
    return load_conversations([str(small_data["eval"])])


def fault_in_load_dataset(monkeypatch, fault: OSError) -> None:
    """datasets.load_dataset failing as it does when its cache cannot be written: the OSError wrapped in its
    DatasetGenerationError (a full disk) or raised as it is (a read-only one, from makedirs)."""

    def load_dataset(*args, **kwargs):
        if fault.errno == errno.ENOSPC:
            raise datasets.exceptions.DatasetGenerationError("An error occurred") from fault
        raise fault

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def test_a_datasets_cache_that_cannot_be_written_is_named_not_the_data_file(tmp_path, monkeypatch):
    """Full: exit 74 naming the cache and HF_DATASETS_CACHE with the room left there; read-only or forbidden: exit 2
    naming both. Each was `cannot read FILE: ...`, exit 2, the data file blamed (checked for real on a 200 KB tmpfs, a
    read-only remount, and under setpriv without the override capabilities)."""
    data = tmp_path / "c.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data.write_text(json.dumps({"messages": turns}) + "\n")
    cache = tmp_path / "hf"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    named = f"the Hugging Face cache {cache} (HF_DATASETS_CACHE)"

    fault_in_load_dataset(monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(StorageError) as full:
        load_conversations([str(data)])
    code, line = errors.outcome(full.value)
    assert code == errors.EXIT_IO_ERROR and line.startswith(f"I/O error: could not write {named}: no space left"), line
    assert " MiB free)" in line and "set HF_DATASETS_CACHE to a folder on another disk" in line
    assert str(data) not in line

    for number, reason in ((errno.EROFS, "Read-only file system"), (errno.EACCES, "Permission denied")):
        fault_in_load_dataset(monkeypatch, OSError(number, reason, str(cache)))
        with pytest.raises(UserError) as refused:
            load_conversations([str(data)])
        assert str(refused.value) == (
            f"{named} cannot be written: {reason}; set HF_DATASETS_CACHE to a folder you can write"
        )

    hub = tmp_path / "hub"  # where a Hub data set's files are downloaded: named as the Hub's cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    fault_in_load_dataset(monkeypatch, OSError(errno.EROFS, "Read-only file system", str(hub / "datasets--a--b")))
    with pytest.raises(UserError, match=f"^the Hugging Face cache {hub} \\(HF_HUB_CACHE\\) cannot be written: Read"):
        load_conversations([str(data)])

    def malformed(*args, **kwargs):  # a file the builder cannot parse is still the file's fault
        raise datasets.exceptions.DatasetGenerationError("An error occurred") from ValueError("bad")

    monkeypatch.setattr(datasets, "load_dataset", malformed)
    with pytest.raises(UserError, match=f"^cannot read {data}: DatasetGenerationError"):
        load_conversations([str(data)])


DAMAGE = {
    "an arrow file cut short": lambda folder: cut(next(folder.glob("*.arrow")), 1000),
    "an arrow file cut at its end": lambda folder: cut(next(folder.glob("*.arrow")), -100),
    "an arrow file gone": lambda folder: next(folder.glob("*.arrow")).unlink(),
    "state.json cut short": lambda folder: cut(folder / "state.json", 30),
    "dataset_info.json cut short": lambda folder: cut(folder / "dataset_info.json", 30),
    "the counts cut short": lambda folder: cut(folder / "draftsmith_stats.json", 10),
    "the counts a list": lambda folder: (folder / "draftsmith_stats.json").write_text("[1]"),
}


def cut(path: Path, size: int) -> None:
    """`path` cut to `size` bytes, as a new file: the data set read before maps the old one (cut in place, a read
    of it is a SIGBUS)."""
    kept = path.read_bytes()[:size]
    path.unlink()
    path.write_bytes(kept)


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_tokenized_cache_is_removed_and_made_again(damage, tmp_path, tokenizer, conversations, caplog):
    """It was exit 70 (`ArrowInvalid: Expected to read ... metadata bytes`, `JSONDecodeError`), in every later run:
    draftsmith's own cache, made from the conversations, is tokenized again, with a warning naming the folder."""
    rows = tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path)).to_list()
    [folder] = (tmp_path / "tokenized").iterdir()
    DAMAGE[damage](folder)
    with caplog.at_level(logging.WARNING, logger="draftsmith.data"):
        again = tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))
    assert again.to_list() == rows
    assert f"the tokenized-data cache {folder} is damaged (" in caplog.text
    assert "removing it and tokenizing the conversations again" in caplog.text
    assert [path.name for path in (tmp_path / "tokenized").iterdir()] == [folder.name], "nothing set aside is left"
    caplog.clear()
    tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))
    assert "damaged" not in caplog.text


# What the reader raises for these (KeyError '_data_files', TypeError) a datasets version's bug raises too
NOT_DAMAGE = {
    "state.json of other keys": lambda folder: (folder / "state.json").write_text("{}"),
    "dataset_info.json of another shape": lambda folder: (folder / "dataset_info.json").write_text('{"features": 5}'),
}


@pytest.mark.parametrize("edit", list(NOT_DAMAGE))
def test_a_reader_error_that_no_damage_explains_is_raised_and_the_cache_kept(
    edit, tmp_path, tokenizer, conversations, caplog
):
    """A KeyError or TypeError of datasets' reader was called damage: the folder removed and tokenized again in every
    run, each then failing the same way on the new copy where a datasets version's bug raised it."""
    tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))
    [folder] = (tmp_path / "tokenized").iterdir()
    NOT_DAMAGE[edit](folder)
    with caplog.at_level(logging.WARNING, logger="draftsmith.data"), pytest.raises((KeyError, TypeError)):
        tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))
    assert "damaged" not in caplog.text and list((tmp_path / "tokenized").iterdir()) == [folder]


def test_a_tokenized_cache_on_a_disk_that_fails_is_not_called_damaged(tmp_path, tokenizer, conversations, monkeypatch):
    """EIO or permissions while reading the cache are the disk's or the user's (exit 74, 2), not damage to remove."""
    tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))

    def failing(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error", str(tmp_path))

    monkeypatch.setattr(datasets, "load_from_disk", failing)
    with pytest.raises(OSError) as info:
        tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))
    assert info.value.errno == errno.EIO and len(list((tmp_path / "tokenized").iterdir())) == 1


def test_a_full_tokenized_cache_names_its_folder_and_leaves_nothing(tmp_path, tokenizer, conversations, monkeypatch):
    """datasets' write errors name no file: the line was `I/O error: no space left on device; free space ...`, and the
    cache is often on another disk than the output (checked for real with DRAFTSMITH_CACHE on a 60 KB tmpfs)."""

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full_disk)
    with pytest.raises(StorageError) as info:
        tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))
    code, line = errors.outcome(info.value)
    root = tmp_path / "tokenized"
    assert code == errors.EXIT_IO_ERROR, line
    assert line.startswith(f"I/O error: could not write the tokenized-data cache {root} (data.cache_dir): no space")
    assert " MiB free); free space there" in line and "set data.cache_dir to a folder on another disk" in line
    assert list(root.iterdir()) == [], "no scratch folder is left"

    def forbidden(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(root / "x"))

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", forbidden)
    with pytest.raises(UserError, match=f"^the tokenized-data cache {root} \\(data.cache_dir\\) cannot be written: "):
        tokenize_conversations(conversations, tokenizer, 128, cache_dir=str(tmp_path))


@pytest.mark.parametrize(
    "command, advice",
    [
        (["train.py"], "run the same command with train.resume=true to continue"),
        (["-m", "data_prep.capture"], "run the same command again to continue"),
    ],
    ids=["train", "capture"],
)
def test_a_full_cache_s_line_says_how_its_command_continues(command, advice, tmp_path, small_data, monkeypatch, capsys):
    """The line ended `run the same command again to continue (a training run: with train.resume=true)` in every
    command: data_prep, which writes the cache, does not know which command runs; run_cli adds that command's advice."""

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", full_disk)
    cache = tmp_path / "cache"
    result = run_entry_in_process([*command, *train_args(tmp_path / "run", small_data, cache)], capsys)
    line = assert_one_line_error(result, errors.EXIT_IO_ERROR, prefix="I/O error: ")
    named = f"the tokenized-data cache {cache / 'tokenized'} (data.cache_dir)"
    assert line.startswith(f"I/O error: could not write {named}: no space left on device"), line
    assert line.endswith(f"set data.cache_dir to a folder on another disk, and {advice}"), line


@pytest.mark.slow  # 2.3-3 s on a 2-core CI machine: over the fast tier's share (docs/tests.md)
def test_a_full_disk_under_a_capture_s_shard_says_how_to_continue(tmp_path, small_data, monkeypatch, capsys):
    """safetensors' full disk while a shard was written was `I/O error: could not write PATH.tmp: Error while
    serializing: ... (os error 28); the shards before it are intact`: no room left, nothing to do. A shard is the
    capture's output: its line is a full output's, with the capture's advice."""

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    features = tmp_path / "run" / "features"
    args = ["-m", "data_prep.capture", *train_args(tmp_path / "run", small_data, tmp_path / "cache")]
    line = assert_one_line_error(run_entry_in_process(args, capsys), errors.EXIT_IO_ERROR, prefix="I/O error: ")
    assert line.startswith(f"I/O error: no space left on device ({features / 'shard_00_00000.safetensors.tmp'}, ")
    assert line.endswith(" MiB free); free space (or fix the disk) and run the same command again to continue"), line
    assert not list(features.glob("shard_*")), "no shard, whole or not, is left"


def test_a_full_disks_line_names_the_path_and_the_room_left(tmp_path):
    """The exception's own path, with the free space of the nearest folder that exists (a full disk's alone)."""
    code, line = errors.outcome(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "gone" / "f.tmp")))
    assert code == errors.EXIT_IO_ERROR and f"no space left on device ({tmp_path / 'gone' / 'f.tmp'}, " in line
    free = shutil.disk_usage(tmp_path).free / 2**20
    assert abs(float(line.split(", ")[1].split(" MiB free)")[0]) - free) < 64, line
    code, line = errors.outcome(OSError(errno.EIO, "Input/output error", str(tmp_path / "b")))
    assert code == errors.EXIT_IO_ERROR and f"input/output error ({tmp_path / 'b'}); free space" in line, line


def test_a_tokenizer_json_that_is_no_tokenizer_is_named(tmp_path, monkeypatch):
    """{"version": "1.0", "model": {"type": "BPE"}} was `KeyError: 'added_tokens'` (exit 70), a list a TypeError, null
    an AttributeError; a loader's error the file does not explain is raised as it is (a bug stays visible)."""
    folder = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    good = (folder / "tokenizer.json").read_text()
    for text in ('{"version": "1.0", "model": {"type": "BPE"}}', "[1, 2]", "null", '{"added_tokens": []}'):
        (folder / "tokenizer.json").write_text(text)
        with pytest.raises(UserError) as info:
            load_tokenizer(str(folder))
        code, line = errors.outcome(info.value)
        assert code == 2 and f"{folder / 'tokenizer.json'} is not a tokenizer (" in line, (text, line)

    (folder / "tokenizer.json").write_text(good)
    from transformers import AutoTokenizer

    def bug(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", bug)
    with pytest.raises(KeyError, match="a bug"):
        load_tokenizer(str(folder))


def test_an_existing_folder_that_cannot_be_written_is_not_called_uncreatable(tmp_path, monkeypatch):
    """`output_dir='/ro/existing' cannot be created under /ro/existing`: the folder is there; its writing is refused
    (checked for real on a read-only remount and in a `chattr +i` folder, eval's output_dir among them)."""
    existing = tmp_path / "run"
    existing.mkdir()

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    with pytest.raises(UserError, match=rf"^output_dir='{existing}' exists but cannot be written in: Read-only file"):
        check_output_dir(existing)
    with pytest.raises(UserError, match=rf"^output_dir='{existing / 'new'}' cannot be created under {existing}: Read"):
        check_output_dir(existing / "new")


@pytest.mark.parametrize("stop", [KeyboardInterrupt, errors.Preempted])
def test_a_shard_write_that_is_stopped_leaves_no_tmp(stop, tmp_path, monkeypatch):
    """Ctrl-C during a capture left `shard_00_00000.safetensors.tmp` until the next run."""
    plan = capture_files.ShardPlan(rank=0, index=0, start=0, stop=1, tokens=2)

    def stopped(fd):
        raise stop()

    monkeypatch.setattr(os, "fsync", stopped)
    with pytest.raises(stop):
        capture_files.write_shard(tmp_path, plan, {"x": torch.zeros(2)}, ["a"])
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    entry = capture_files.write_shard(tmp_path, plan, {"x": torch.zeros(2)}, ["a"])
    assert [path.name for path in tmp_path.iterdir()] == [entry["file"]]
