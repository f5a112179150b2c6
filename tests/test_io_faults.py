"""Files that cannot be read and disks that fill, through the real entry points in this process: an input the
user gave that its permissions forbid reading is bad input (exit 2, `cannot read PATH: permission denied`), a
full disk is exit 74 naming the file it was writing, whichever writer met it (Python's, safetensors'), and a
failed write leaves no temporary file behind. The faults are injected (the tests run as root, whom file
permissions do not stop, and where no small file system can be mounted); docs/faults.md names the real
checks (`setpriv` without the override capabilities, a 300 KB tmpfs)."""

from __future__ import annotations

import builtins
import errno
import gzip
import io
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError

from draftsmith import errors
from draftsmith.errors import UserError
from draftsmith.files import read_json, write_text_atomic
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from draftsmith.trainer import setup
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, save_drafter, train_args

pytestmark = pytest.mark.usefixtures("one_thread")

FULL_DISK = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors 0.8's words


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_drafter("medusa", load_target(str(REFERENCE_TARGET)), tmp_path_factory.mktemp("io") / "final")


def unreadable(monkeypatch, *paths: Path) -> None:
    """Opening any of `paths` fails as for a user its permissions forbid reading it (io.open is what pathlib's
    read_text opens with, builtins.open what `open` is)."""
    real_open, refused = io.open, {str(path) for path in paths}

    def guarded_open(file, *args, **kwargs):
        if str(file) in refused:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)


def export(checkpoint: Path, tmp_path: Path, capsys, *extra: str):
    args = ["-m", "export", "recipe=medusa", f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'run'}",
            f"export.output={tmp_path / 'export'}", *extra]  # fmt: skip
    return run_entry_in_process(args, capsys)


def evaluate(checkpoint: Path, tmp_path: Path, capsys, *extra: str):
    args = ["-m", "eval", "recipe=medusa", f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'run'}",
            "eval.max_prompts=1", "eval.max_new_tokens=4", "eval.tree=0", *extra]  # fmt: skip
    return run_entry_in_process(args, capsys)


@pytest.mark.parametrize("name", ["config.json", "model.safetensors"])
def test_an_unreadable_checkpoint_file_is_bad_input_naming_it(checkpoint, tmp_path, monkeypatch, capsys, name):
    """config.json was exit 70 (PermissionError) everywhere; model.safetensors exit 70 in export (its sha256) and
    `corrupt weights file (No such file or directory ...)` in eval, safetensors' words for a file it may not read."""
    unreadable(monkeypatch, checkpoint / name)
    line = f"error: cannot read {checkpoint / name}: permission denied"
    assert assert_one_line_error(export(checkpoint, tmp_path, capsys), 2) == line
    assert not (tmp_path / "export" / "vllm").exists()
    assert assert_one_line_error(evaluate(checkpoint, tmp_path, capsys), 2) == line
    with pytest.raises(UserError, match="^cannot read .*: permission denied$"):
        from draftsmith.heads.base import load_drafter

        load_drafter(checkpoint)  # the warm start's read too (train.init_from)


def test_an_engine_folders_unreadable_weights_are_named_as_such(tmp_path, monkeypatch):
    """An engine folder (an export's vllm/, read by train.init_from and eval): safetensors called its weights
    missing, and the line said `corrupt weights file (No such file or directory ...)`."""
    from draftsmith.formats.folder import engine_format

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    unreadable(monkeypatch, tmp_path / "model.safetensors")
    with pytest.raises(UserError, match=f"^cannot read {tmp_path / 'model.safetensors'}: permission denied$"):
        engine_format(tmp_path)


def test_a_permission_error_anywhere_else_is_bad_input_and_a_full_disk_names_its_file():
    """run_cli's mapping: a PermissionError no reader turned into its line is still exit 2, naming the path."""
    code, line = errors.outcome(PermissionError(errno.EACCES, "Permission denied", "/data/x.jsonl"))
    assert code == 2 and line.startswith("error: cannot access /data/x.jsonl: permission denied;")
    code, line = errors.outcome(OSError(errno.ENOSPC, "No space left on device", "/out/report.json"))
    assert code == 74 and line.startswith("I/O error: no space left on device (/out/report.json, ")
    assert " MiB free); free space" in line, line  # the room left where it was written


def test_an_unreadable_recipe_file_or_data_folder_says_it_cannot_be_read(tmp_path, monkeypatch, capsys, small_data):
    """They said `not valid YAML ([Errno 13] ...)` and `holds no .jsonl/... file`."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("drafter: {type: medusa}\n")
    unreadable(monkeypatch, recipe)
    with pytest.raises(UserError, match=f"^cannot read {recipe}: permission denied$"):
        load_recipe([f"recipe={recipe}"])

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "eval.jsonl").write_text(small_data["eval"].read_text())
    real_scandir = os.scandir

    def guarded_scandir(path="."):
        if str(path) == str(folder):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", guarded_scandir)
    from draftsmith.data_prep.conversations import load_conversations

    with pytest.raises(UserError, match=f"^cannot read data directory '{folder}': permission denied$"):
        load_conversations([str(folder)])
    # a folder inside a readable one: its files were left out of the data without a word
    outer = tmp_path / "outer"
    (outer / "later").mkdir(parents=True)
    (outer / "eval.jsonl").write_text(small_data["eval"].read_text())
    (outer / "later" / "more.jsonl").write_text(small_data["eval"].read_text())
    assert len(load_conversations([str(outer)])) == 2 * len(load_conversations([str(outer / "eval.jsonl")]))
    folder = outer / "later"  # what guarded_scandir refuses now
    with pytest.raises(UserError, match=f"^cannot read data directory '{folder}': permission denied$"):
        load_conversations([str(outer)])


def test_a_full_disk_while_writing_a_file_removes_its_temporary_file_and_names_it(tmp_path, monkeypatch):
    """write_text_atomic (the eval report, the export record) and regenerate's part files left `<name>.tmp`, and
    the exit-74 line did not say where (a write's OSError names no file)."""
    from draftsmith.data_prep.regenerate import write_part

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for path, write in [
        (tmp_path / "report.json", lambda path: write_text_atomic(path, "{}\n")),
        (tmp_path / "part-00000.jsonl.gz", lambda path: write_part(path, [{"messages": []}])),
    ]:
        with monkeypatch.context() as patch:
            patch.setattr(Path, "write_text", full_disk)
            patch.setattr(gzip.GzipFile, "write", full_disk)
            with pytest.raises(OSError) as info:
                write(path)
        code, line = errors.outcome(info.value)
        assert code == 74 and f"no space left on device ({path}, " in line, line
        assert list(tmp_path.iterdir()) == [], "nothing half-written is left"
    write_text_atomic(tmp_path / "report.json", "{}\n")  # and a write that succeeds still renames into place
    assert read_json(tmp_path / "report.json") == {} and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_full_disk_while_appending_a_line_leaves_no_half_line_nor_an_empty_file(tmp_path, monkeypatch):
    """log.jsonl and the sweep's rows are appended: a write the disk cut short left a half line (a resume's reader
    then fails on it) or a 0-byte log.jsonl, and the exit-74 line named no file."""
    from draftsmith import files

    class CutShort(io.FileIO):
        def write(self, data):  # what an unbuffered write on a filling disk does: writes part, says how much
            return super().write(bytes(data)[:3])

    log = tmp_path / "log.jsonl"
    files.append_lines(log, ['{"step": 1}\n'])
    for path in (log, tmp_path / "sweep.jsonl"):
        monkeypatch.setattr(files, "open", lambda name, mode, buffering: CutShort(name, mode), raising=False)
        with pytest.raises(OSError) as info:
            files.append_lines(path, ['{"step": 2}\n', '{"step": 3}\n'])
        monkeypatch.undo()
        code, line = errors.outcome(info.value)
        assert code == 74 and f"no space left on device ({path}, " in line, line
    assert log.read_text() == '{"step": 1}\n' and not (tmp_path / "sweep.jsonl").exists()


def test_a_full_disk_in_safetensors_exits_74_naming_the_file(checkpoint, tmp_path, monkeypatch, capsys, token_cache):
    """safetensors' SafetensorError for a full disk was exit 70 in export and in speculators_features."""
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        raise SafetensorError(FULL_DISK)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    line = assert_one_line_error(export(checkpoint, tmp_path, capsys), 74, prefix="I/O error: ")
    assert line.startswith(f"I/O error: no space left on device ({tmp_path / 'export' / 'vllm.tmp'}/"), line
    assert not [path for path in (tmp_path / "export").rglob("*") if path.name != ".draftsmith.lock"]

    output = tmp_path / "features"
    args = ["-m", "data_prep.speculators_features", str(output), "recipe=eagle3", "data.max_conversations=1",
            "data.max_length=64", f"data.cache_dir={token_cache}"]  # fmt: skip
    line = assert_one_line_error(run_entry_in_process(args, capsys), 74, prefix="I/O error: ")
    assert f"no space left on device ({output / 'hidden_states' / 'hs_0.safetensors.tmp'}, " in line, line
    assert not list((output / "hidden_states").iterdir())


def test_misleading_lines_of_eval_export_and_a_warm_start(
    checkpoint, tmp_path, capsys, small_data, token_cache, monkeypatch
):
    """eval of a checkpoint= that is not there told to pass checkpoint=; export.batch_sweep= a folder said it does
    not exist; a train.init_from folder holding no drafter was refused only after the target loaded."""
    missing = tmp_path / "nope"
    line = assert_one_line_error(evaluate(missing, tmp_path, capsys), 2)
    assert line == f"error: no drafter checkpoint at {missing}"
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    line = assert_one_line_error(export(checkpoint, tmp_path, capsys, f"export.batch_sweep={sweep}"), 2)
    assert line == f"error: export.batch_sweep={sweep} is a directory: give the sweep's JSONL file in it"

    empty = tmp_path / "empty"
    empty.mkdir()
    run = checkpoint.parent  # a run's folder: its final/ is the checkpoint, as the line says
    monkeypatch.setattr(setup, "load_target", lambda *a, **k: pytest.fail("the target loaded before the refusal"))
    for start, line in ((empty, f"{empty} holds neither a drafter checkpoint nor an exported drafter folder"),
                        (run, "; its final/ does (pass that)")):  # fmt: skip
        args = train_args(tmp_path / "run", small_data, token_cache, f"train.init_from={start}")
        assert line in assert_one_line_error(run_entry_in_process(["train.py", *args], capsys), 2)
        assert not (tmp_path / "run").exists()


def test_a_push_with_the_hub_offline_is_refused_before_anything_is_written(checkpoint, tmp_path, monkeypatch, capsys):
    """It wrote every engine folder and only then failed (`offline mode is enabled`)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    result = export(checkpoint, tmp_path, capsys, "export.push.repo_id=org/x")
    assert_one_line_error(result, 2, "export.push.repo_id=org/x pushes to the Hub, which HF_HUB_OFFLINE=1 forbids")
    assert not (tmp_path / "export").exists()


def test_a_stage_file_nested_deeper_than_json_reads_is_corrupt(tmp_path):
    """A state.json or a checkpoint's config.json edited into nesting a thousand levels deep was exit 70
    (RecursionError): it is as corrupt as one cut short, one line naming it."""
    nested = tmp_path / "state.json"
    nested.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match=r"state.json: corrupt monitor state \(maximum recursion depth exceeded"):
        read_json(nested, "monitor state")
