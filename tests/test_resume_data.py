"""A resume names the run's data by path, and the same bytes under another path (the repo's demo/ data through a
clone's path, a relative path for an absolute one, a copied capture) are the run's data: compared by content, not
by path. Other bytes, or a path that cannot be read here, are still refused as changed data."""

from __future__ import annotations

import json
import shutil

import pytest

from draftsmith.errors import UserError
from draftsmith.files import file_sha256
from draftsmith.recipe import load_recipe, save_recipe
from draftsmith.trainer.resume_checks import DATA_CONTENT_NAME, record_data_content, require_resumed_as_begun
from tests.helpers import assert_one_line_error, run_entry_in_process, train_args

RECORDS = [
    {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]} for i in (1, 2)
]


def write_jsonl(path, records=RECORDS):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def recipe(output, *overrides):
    return load_recipe(["recipe=medusa", f"output_dir={output}", *overrides])


def test_the_same_bytes_under_another_path_resume_and_other_bytes_are_refused(tmp_path, monkeypatch):
    run, clone = tmp_path / "run", tmp_path / "clone"
    began = write_jsonl(tmp_path / "main" / "demo" / "train.jsonl")
    save_recipe(recipe(run, f"data.train=[{began}]"), run)

    copy = write_jsonl(clone / "demo" / "train.jsonl")  # the clone's copy of the same file
    require_resumed_as_begun(recipe(run, f"data.train=[{copy}]"), run)
    monkeypatch.chdir(clone)  # a relative path to it
    require_resumed_as_begun(recipe(run, "data.train=[demo/train.jsonl]"), run)
    require_resumed_as_begun(recipe(run, "data.train=[demo]"), run)  # its folder, and a glob of it
    require_resumed_as_begun(recipe(run, "data.train=['demo/*.jsonl']"), run)

    edited = write_jsonl(clone / "edited" / "train.jsonl", RECORDS[:1])
    moved = tmp_path / "gone" / "train.jsonl"
    both = f"data.train=[{copy},{copy}]"  # the same file twice: more conversations than the run began with
    for changed in (f"data.train=[{edited}]", f"data.train=[{moved}]", both, "data.train=[owner/dataset]"):
        with pytest.raises(UserError, match=r"this recipe changes data.train=.* \(the run began with") as refused:
            require_resumed_as_begun(recipe(run, changed), run)
        assert "\n" not in str(refused.value)


def test_a_capture_copied_elsewhere_resumes_and_another_capture_is_refused(tmp_path):
    run, capture = tmp_path / "run", tmp_path / "features"
    capture.mkdir()
    (capture / "manifest.json").write_text(json.dumps({"shards": [{"sha256": "ab"}]}))
    save_recipe(recipe(run, f"data.features={capture}"), run)
    copied = shutil.copytree(capture, tmp_path / "elsewhere" / "features")
    require_resumed_as_begun(recipe(run, f"data.features={copied}"), run)
    (copied / "manifest.json").write_text(json.dumps({"shards": [{"sha256": "cd"}]}))
    with pytest.raises(UserError, match=r"this recipe changes data.features="):
        require_resumed_as_begun(recipe(run, f"data.features={copied}"), run)


def begin(run, *overrides):
    """A run's folder as train leaves it when it begins: its recipe.yaml and the record of what its data read."""
    cfg = recipe(run, *overrides)
    run.mkdir()
    record_data_content(cfg, run)
    save_recipe(cfg, run)


def test_a_resume_compares_the_bytes_the_run_began_with_not_those_its_path_holds_today(tmp_path):
    run = tmp_path / "run"
    began = write_jsonl(tmp_path / "main" / "train.jsonl")
    begin(run, f"data.train=[{began}]")
    # a copy of the bytes the run began with resumes, its original path gone (the run's machine, elsewhere)
    copy = shutil.copy(began, tmp_path / "copy.jsonl")
    began.unlink()
    require_resumed_as_begun(recipe(run, f"data.train=[{copy}]"), run)

    # the file edited after the run began, at its path or copied elsewhere: other conversations from the saved position
    write_jsonl(began, RECORDS[:1])
    edited = shutil.copy(began, tmp_path / "edited.jsonl")
    with pytest.raises(UserError, match=r"data.train=\[.*\] \(the run began with"):
        require_resumed_as_begun(recipe(run, f"data.train=[{edited}]"), run)
    with pytest.raises(UserError, match=r"whose bytes changed since the run began") as refused:
        require_resumed_as_begun(recipe(run, f"data.train=[{began}]"), run)
    assert "\n" not in str(refused.value) and "resume with the run's values and data" in str(refused.value)


def test_a_hub_data_set_beside_local_files_compares_by_its_name(tmp_path):
    run = tmp_path / "run"
    began = write_jsonl(tmp_path / "main" / "train.jsonl")
    begin(run, f"data.train=[owner/dataset,{began}]")
    require_resumed_as_begun(recipe(run, f"data.train=[owner/dataset,{began}]"), run)  # nothing changed
    copy = shutil.copy(began, tmp_path / "copy.jsonl")
    require_resumed_as_begun(recipe(run, f"data.train=[owner/dataset,{copy}]"), run)  # its local file elsewhere
    with pytest.raises(UserError, match=r"data.train=.* \(the run began with"):
        require_resumed_as_begun(recipe(run, f"data.train=[owner/other,{copy}]"), run)


def test_a_run_begun_before_the_record_compares_what_its_paths_hold_today(tmp_path):
    run = tmp_path / "run"
    began = write_jsonl(tmp_path / "main" / "train.jsonl")
    save_recipe(recipe(run, f"data.train=[{began}]"), run)  # no data_content.json
    write_jsonl(began, RECORDS[:1])  # edited at its path: not known to have changed
    require_resumed_as_begun(recipe(run, f"data.train=[{began}]"), run)
    (run / DATA_CONTENT_NAME).write_text("{not json")
    with pytest.raises(UserError, match=r"corrupt record of the run's data .*remove it to compare"):
        require_resumed_as_begun(recipe(run, f"data.train=[{began}]"), run)


@pytest.mark.slow
def test_train_records_its_data_as_it_begins_and_refuses_a_resume_over_data_edited_since(
    tmp_path, small_data, token_cache, capsys
):
    data, out = shutil.copy(small_data["train"], tmp_path / "train.jsonl"), tmp_path / "run"
    steps = ("train.max_steps=2", "train.save_every=1", "data.eval=[]")  # no eval stage: nothing here reads it
    args = train_args(out, {**small_data, "train": data}, token_cache, *steps)
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    assert json.loads((out / DATA_CONTENT_NAME).read_text())["data.train"] == [file_sha256(data)]
    lines = data.read_text().splitlines(keepends=True)
    data.write_text("".join(lines[1:] + lines[:1]))  # the same conversations in another order
    resume = f"train.resume={out / 'checkpoints' / 'step_0000001'}"
    refused = run_entry_in_process(["train.py", *args, resume], capsys)
    assert_one_line_error(refused, 2, "whose bytes changed since the run began")
    data.write_text("".join(lines))
    resumed = run_entry_in_process(["train.py", *args, resume], capsys)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((out / DATA_CONTENT_NAME).read_text())["data.train"] == [file_sha256(data)]


def test_a_training_start_reads_each_data_file_once(tmp_path, small_data, token_cache, capsys, monkeypatch):
    """A start hashed data.train's files three times: to load them (the datasets builder's name), to count the
    eval report's prompts data.train answers, and to record them for its resumes (data_content.json). Now the
    load's digests are passed to the others: each file is read for its sha256 once."""
    import hashlib

    from draftsmith.trainer import loop

    read, real_digest, real_set_up = [], hashlib.file_digest, loop.set_up
    monkeypatch.setattr(hashlib, "file_digest", lambda file, name: read.append(file.name) or real_digest(file, name))

    def set_up_alone(cfg, output_dir):  # the start alone: no training step is needed here
        real_set_up(cfg, output_dir)
        raise UserError("the start is over")

    monkeypatch.setattr(loop, "set_up", set_up_alone)
    data, out = shutil.copy(small_data["train"], tmp_path / "train.jsonl"), tmp_path / "run"
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": "q1"}]}])
    args = train_args(out, {**small_data, "train": data}, token_cache, "eval.enabled=true", f"eval.data=[{prompts}]")
    assert_one_line_error(run_entry_in_process(["train.py", *args], capsys), 2, "the start is over")
    assert read.count(str(data)) == 1 and sorted(read) == sorted(set(read)), read
    assert json.loads((out / DATA_CONTENT_NAME).read_text())["data.train"] == [file_sha256(data)]
