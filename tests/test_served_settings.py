"""A drafter's SERVED settings (DrafterConfig.SERVED: how it decodes and is served, read when it does: DSpark's
adaptive verification, the dynamic trees' sizes) are taken by eval, export and sweep from their command line over
the folder's own, so a trained drafter is measured and served another way without training again. Every other
drafter setting stays the folder's (tests/test_export.py refuses it on their command line). What an eval report
and an export record describe must be one way of serving: the export refuses a report measured another way."""

from __future__ import annotations

import json
import re
import shlex

import pytest

from draftsmith.errors import UserError
from draftsmith.export.sweep_checks import require_same_load
from draftsmith.heads import CONFIGS
from draftsmith.heads.base import architecture
from draftsmith.target import load_target
from tests.helpers import REFERENCE_TARGET, REPO, assert_one_line_error, run_entry_in_process, save_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


def eval_args(recipe: str, checkpoint, run_dir, *extra: str) -> list[str]:
    return ["-m", "eval", f"recipe={recipe}", f"checkpoint={checkpoint}", "eval.max_prompts=1",
            "eval.max_new_tokens=16", "data.max_length=128", f"output_dir={run_dir}", *extra]  # fmt: skip


def export_args(recipe: str, checkpoint, run_dir, *extra: str) -> list[str]:
    output = run_dir.parent / "export"
    return ["-m", "export", f"recipe={recipe}", f"checkpoint={checkpoint}", f"export.output={output}",
            "export.engines=[vllm]", f"output_dir={run_dir}", *extra]  # fmt: skip


def documented(checkpoint) -> list[list[str]]:
    """docs/eval.md's commands that serve a trained DSpark with adaptive verification, run on `checkpoint`."""
    section = (REPO / "docs" / "eval.md").read_text().split("**Serving a trained drafter another way.**")[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    commands = [shlex.split(line.replace("checkpoint=runs/dspark/final", f"checkpoint={checkpoint}")) for line in
                block.splitlines()]  # fmt: skip
    assert [command[:3] for command in commands] == [["python", "-m", "eval"], ["python", "-m", "export"]]
    return [command[1:] for command in commands]


def test_every_served_setting_is_a_setting_of_its_kind_outside_the_architecture():
    """A SERVED key changes nothing the weights compute (a warm start may change it too) and is a field of its kind."""
    assert any(config.SERVED for config in CONFIGS.values())
    for kind, config in CONFIGS.items():
        names = {field for field in config.__dataclass_fields__}
        assert set(config.SERVED) <= set(config.SETTINGS) & names, kind
        assert not set(config.SERVED) & set(architecture(config())), kind


@pytest.mark.slow
def test_a_dspark_trained_without_adaptive_verification_is_evaluated_and_exported_with_it(tmp_path, capsys):
    """The eval decodes with the costs it cuts chains by, losslessly; the export of the report's checkpoint without
    the setting is refused in one line (its card would show an acceptance measured another way), with it the
    speculative config switches vLLM's adaptive verification on; the checkpoint is untouched."""
    target = load_target(str(REFERENCE_TARGET))
    run_dir = tmp_path / "run"
    checkpoint = save_drafter("dspark", target, run_dir / "final", markov_rank=8)
    saved = (checkpoint / "config.json").read_text()
    assert json.loads(saved)["drafter"]["adaptive_verification"] is False
    evaluate, export = documented(checkpoint)
    assert run_entry_in_process([*evaluate, *eval_args("dspark", checkpoint, run_dir)[4:]], capsys).returncode == 0
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    assert report["drafter"]["config"]["adaptive_verification"] is True
    assert len(report["methods"]["chain"]["step_costs"]["verify_ms"]) == 4  # 0..γ drafts verified, γ 3
    assert report["domains"]["all"]["chain"]["lossless"]

    refused = run_entry_in_process(export_args("dspark", checkpoint, run_dir), capsys)
    assert_one_line_error(
        refused, 2, "measured another way of serving the drafter: drafter.adaptive_verification=false ("
    )
    assert not (tmp_path / "export").exists()
    assert run_entry_in_process([*export, *export_args("dspark", checkpoint, run_dir)[4:]], capsys).returncode == 0
    info = json.loads((tmp_path / "export" / "vllm" / "draftsmith_export.json").read_text())
    assert info["speculative_config"]["enable_adaptive_verification"] is True
    assert info["drafter_config"]["adaptive_verification"] is True
    assert (checkpoint / "config.json").read_text() == saved


def test_a_served_setting_the_drafter_cannot_take_is_refused_before_anything_is_written(tmp_path, capsys):
    """Adaptive verification reads the confidence head's survivals: a DSpark without one is refused in one line
    (before the target loads: formats/folder.py's served_settings checks the checkpoint's config with it)."""
    target = load_target(str(REFERENCE_TARGET))
    checkpoint = save_drafter("dspark", target, tmp_path / "ckpt", markov_rank=8, confidence_head=False)
    args = eval_args("dspark", checkpoint, tmp_path / "run", "drafter.adaptive_verification=true")
    assert_one_line_error(run_entry_in_process(args, capsys), 2, "adaptive_verification needs confidence_head: true")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # 2.3-3 s on a 2-core CI machine: over the fast tier's share (docs/tests.md)
def test_an_engine_folder_is_evaluated_with_the_tree_size_the_command_line_gives(tmp_path, capsys):
    """A read-back engine folder takes a SERVED key as a checkpoint does (its other settings stay its format's)."""
    target = load_target(str(REFERENCE_TARGET))
    run_dir = tmp_path / "run"
    checkpoint = save_drafter("medusa", target, run_dir / "final")
    assert run_entry_in_process(export_args("medusa", checkpoint, run_dir), capsys).returncode == 0
    folder = tmp_path / "export" / "vllm"
    args = eval_args("medusa", folder, tmp_path / "again", "drafter.tree_topk=3", "eval.tree=6")
    assert run_entry_in_process(args, capsys).returncode == 0
    report = json.loads((tmp_path / "again" / "eval" / "report.json").read_text())
    assert report["drafter"]["config"]["tree_topk"] == 3
    assert report["domains"]["all"]["tree"]["lossless"]


def test_a_sweep_resumed_with_the_drafter_served_another_way_is_refused(tmp_path):
    rows = [{"engine": {"vllm_version": "0.32.0"}, "load": {"threads": 1, "drafter": {"adaptive_verification": False}}}]
    settings = {"threads": 1, "drafter": {"adaptive_verification": True}}
    with pytest.raises(UserError, match=r'served with \{"adaptive_verification": false\}, and this sweep serves it '):
        require_same_load(tmp_path / "sweep.jsonl", rows, settings, "0.32.0")
    require_same_load(
        tmp_path / "sweep.jsonl", rows, {**settings, "drafter": {"adaptive_verification": False}}, "0.32.0"
    )
    del rows[0]["load"]["drafter"]  # rows from before the settings were recorded: measured with the checkpoint's
    require_same_load(tmp_path / "sweep.jsonl", rows, settings, "0.32.0")
