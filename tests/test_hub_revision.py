"""A target named by its Hub id is read at a commit of its repository, and main may move on: the run, its resume, its
export's serving command and the target's own files read later keep to the commit the run read (a newcomer's
offline journey, 2026-12-07: a resume after main moved to a config with another rms_norm_eps trained on without a
word; the card's `vllm serve acme/tiny-llama` named no revision, so an engine loads whatever main holds by then)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from draftsmith.formats.repo import EXPORT_INFO
from draftsmith.hub_cache import hub_commit
from draftsmith.model_files import checkpoint_folder
from tests.helpers import DEMO, assert_one_line_error, run_entry_in_process, train_args

pytestmark = pytest.mark.slow

BEGUN, CONFIG_MOVED, WEIGHTS_MOVED = "a" * 40, "b" * 40, "c" * 40


def snapshot(repo: Path, commit: str, config: dict | None = None, scale: float = 1.0) -> None:
    """The demo target as commit `commit` of the cached repository `repo`, main pointing at it; `config`'s values
    over its config.json, its weights times `scale`."""
    folder = repo / "snapshots" / commit
    shutil.copytree(DEMO / "target", folder)
    if config:
        (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **config}))
    if scale != 1.0:
        weights = folder / "model.safetensors"
        save_file({name: tensor * scale for name, tensor in load_file(weights).items()}, weights, {"format": "pt"})
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """acme/tiny in an offline Hub cache, its main at BEGUN."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    repo = tmp_path / "hub-cache" / "models--acme--tiny"
    snapshot(repo, BEGUN)
    return repo


def test_a_run_resumes_serves_and_reads_its_targets_files_at_the_commit_it_began_on(
    hub_cache, tmp_path, small_data, token_cache, capsys
):
    run = tmp_path / "run"
    args = [*train_args(run, small_data, token_cache, "train.max_steps=4", "train.save_every=2"),
            "target.name_or_path=acme/tiny"]  # fmt: skip
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    recorded = json.loads((run / "final" / "config.json").read_text())["target"]
    assert recorded["revision"] == BEGUN  # the commit main named as the run read it
    shutil.rmtree(run / "checkpoints" / "step_0000004")
    shutil.rmtree(run / "final")

    snapshot(hub_cache, CONFIG_MOVED, config={"rms_norm_eps": 0.1})  # the same weights, computing otherwise
    assert hub_commit("acme/tiny", None) == CONFIG_MOVED
    line = assert_one_line_error(run_entry_in_process(["train.py", *args, "train.resume=true"], capsys), 2)
    assert f"began on commit {BEGUN} of target 'acme/tiny', and the target now loads commit {CONFIG_MOVED}" in line
    assert line.endswith(f"give target.revision={BEGUN} to resume it as begun")
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true", f"target.revision={BEGUN}"], capsys)
    assert resumed.returncode == 0 and "at step 2" in resumed.stderr, resumed.stderr[-2000:]

    # the target's own files read again (a sharded target's records, an MTP layer) are the commit's it loaded
    assert checkpoint_folder("acme/tiny", "test", BEGUN) == hub_cache / "snapshots" / BEGUN
    assert checkpoint_folder("acme/tiny", "test") == hub_cache / "snapshots" / CONFIG_MOVED

    export = ["-m", "export", f"recipe={run / 'recipe.yaml'}", f"checkpoint={run / 'final'}",
              f"output_dir={tmp_path / 'export-run'}", f"export.output={tmp_path / 'served'}"]  # fmt: skip
    assert run_entry_in_process([*export, f"target.revision={BEGUN}"], capsys).returncode == 0
    folder = tmp_path / "served" / "vllm"
    assert json.loads((folder / EXPORT_INFO).read_text())["target"]["revision"] == BEGUN
    (serve,) = [line for line in (folder / "README.md").read_text().splitlines() if line.startswith("vllm serve ")]
    assert serve.startswith(f"vllm serve acme/tiny --revision {BEGUN} --dtype "), serve

    # the resumed run's recipe.yaml pins the commit it resumed on; unpinned, main now holds other weights, and the
    # refusal names the commit to give
    snapshot(hub_cache, WEIGHTS_MOVED, scale=1.01)
    shutil.rmtree(tmp_path / "served")
    line = assert_one_line_error(run_entry_in_process([*export, "target.revision=null"], capsys), 2)
    assert line.endswith(f"give the target it was trained for (target.revision={BEGUN}, the commit it was made on)")
