"""P-EAGLE's chain is at most the depths it trained (drafter.ttt_steps): an export γ beyond them is refused by the
recipe check, before any model loads; and a speculators P-EAGLE folder is read with the depths its config names
(what speculators writes: `speculators_config`'s proposal method's speculative_tokens = the depths it trained,
`num_depths` too in 0.6), not draftsmith's default, and refused in one line when it names none."""

from __future__ import annotations

import json

import pytest

import draftsmith.export.run as export_run
from draftsmith.errors import UserError
from draftsmith.export.run import export_checkpoint
from draftsmith.formats.folder import open_drafter
from draftsmith.formats.repo import EXPORT_INFO
from draftsmith.heads import drafter_class
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape, load_target
from tests.helpers import KINDS, REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, save_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

PEAGLE = {"parallel_drafting": "true", "mask_token_id": "5", "eval.tree": "0"}
# the eval's γ within every ttt_steps below: the export's alone is checked
PARALLEL = ["drafter.parallel_drafting=true", "drafter.mask_token_id=5", "eval.tree=0", "eval.num_speculative_tokens=1"]


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


def test_an_export_gamma_beyond_the_trained_depths_is_refused_before_any_model_loads(target, tmp_path, capsys):
    with pytest.raises(UserError, match=r"export.num_speculative_tokens=3 but this eagle3 drafter proposes at most 2;"):
        load_recipe(["recipe=eagle3", *PARALLEL, "drafter.ttt_steps=2", "export.num_speculative_tokens=3"])
    load_recipe(["recipe=eagle3", *PARALLEL, "drafter.ttt_steps=3", "export.num_speculative_tokens=3"])
    load_recipe(["recipe=eagle3", "drafter.ttt_steps=2", "export.num_speculative_tokens=5"])  # sequential: any

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", **PEAGLE, ttt_steps=7)
    output = tmp_path / "export"
    args = [f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path / 'run'}", f"export.output={output}"]
    loaded = []
    real_load_target = export_run.load_target
    export_run.load_target = lambda *a, **k: loaded.append(a) or real_load_target(*a, **k)
    try:
        result = run_entry_in_process(
            ["-m", "export", *args, f"checkpoint={checkpoint}", "eval.tree=0", "export.num_speculative_tokens=12"],
            capsys,
        )
    finally:
        export_run.load_target = real_load_target
    assert_one_line_error(result, 2, "export.num_speculative_tokens=12 but this eagle3 drafter proposes at most 7")
    assert not loaded and not output.exists()


def speculators_peagle_folder(target, tmp_path, **config_changes):
    """A P-EAGLE folder as speculators saves one: draftsmith's export of a ttt_steps=3 drafter without its
    export info (speculators writes none), its proposal method's speculative_tokens the depths it trained."""
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", **PEAGLE, ttt_steps=3)
    args = [f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path / 'run'}", f"export.output={tmp_path / 'export'}"]
    folder = export_checkpoint(load_recipe([*args, "eval.num_speculative_tokens=2"]), checkpoint, target=target)["vllm"]
    (folder / EXPORT_INFO).unlink()
    config = json.loads((folder / "config.json").read_text())
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 3
    config.update(config_changes)
    if config_changes.pop("no_proposal", False):
        config.pop("no_proposal")
        del config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_speculators_peagle_folder_is_read_with_the_depths_it_trained(target, tmp_path):
    shape = TargetShape.of(target, str(REFERENCE_TARGET))
    eagle3 = drafter_class("eagle3")
    drafter = open_drafter(speculators_peagle_folder(target, tmp_path / "a"), shape, target)
    assert drafter.config.ttt_steps == 3 and eagle3.max_chain(drafter.config) == 3  # not the default 7
    # speculators 0.6's top-level num_depths
    drafter = open_drafter(speculators_peagle_folder(target, tmp_path / "b", num_depths=5), shape, target)
    assert drafter.config.ttt_steps == 5
    with pytest.raises(UserError, match="a P-EAGLE folder whose config.json names no depth it trained") as refused:
        open_drafter(speculators_peagle_folder(target, tmp_path / "c", no_proposal=True), shape, target)
    assert "\n" not in str(refused.value)
