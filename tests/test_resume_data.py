"""A resume names the run's data by path, and the same bytes under another path (the repo's demo/ data through a
clone's path, a relative path for an absolute one, a copied capture) are the run's data: compared by content, not
by path. Other bytes, or a path that cannot be read here, are still refused as changed data."""

from __future__ import annotations

import json
import shutil

import pytest

from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe, save_recipe
from draftsmith.trainer.setup import require_resumed_as_begun

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
