"""What an export refuses to vouch for, and the lines its checks give: a report measured in another dtype than
the export loads the target in, a P-EAGLE chain longer than the depths it trained, an engine check that found
no acceptance where draftsmith's own decoding found none either; and the folder's weights in the one dtype its
config names whatever dtype the target was loaded in."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import draftsmith.export.run as export_run
from draftsmith.errors import ExportCheckFailed, UserError
from draftsmith.export.verify import compare
from draftsmith.files import checkpoint_digest
from draftsmith.heads import drafter_class
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import KINDS, REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, save_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
PEAGLE = {"parallel_drafting": "true", "mask_token_id": "5", "eval.tree": "0"}


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


def recipe_args(kind: str, output: Path, *extra: str) -> list[str]:
    return [f"recipe={KINDS[kind]}", f"output_dir={output.parent / 'run'}", f"export.output={output}", *extra]


def write_report(checkpoint: Path, dtype: str) -> Path:
    """The eval report train writes beside the checkpoint (<run>/eval/report.json), as much of it as the
    export reads before the target loads: which weights it measured, and in which dtype, with the sections of a
    report (export/run.py find_report checks they are there), empty."""
    path = checkpoint.parent / "eval" / "report.json"
    path.parent.mkdir(parents=True)
    drafter = {"path": str(checkpoint.resolve()), "sha256": checkpoint_digest(checkpoint)}
    path.write_text(json.dumps({"drafter": drafter, "dtype": dtype, **REPORT_SECTIONS}))
    return path


REPORT_SECTIONS = {"temperature": 0.0, "methods": [], "baselines": {}, "domains": {"all": {"chain": {"tau": 1.0}}}}


# -- the report's dtype ------------------------------------------------------------------------------------------
def test_an_export_in_another_dtype_than_its_report_measured_is_refused_before_the_target_loads(
    target, tmp_path, capsys, monkeypatch
):
    """The probe exported a float32 report's checkpoint with target.dtype=bfloat16: exit 0, a card whose
    serving command says bfloat16 over an acceptance table measured in float32. One line naming both dtypes
    and what to do, before the target loads, nothing written."""
    checkpoint = save_drafter("eagle3", target, tmp_path / "run" / "final")
    write_report(checkpoint, "float32")

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(export_run, "load_target", no_target)
    output = tmp_path / "export"
    args = ["-m", "export", *recipe_args("eagle3", output, f"checkpoint={checkpoint}", "target.dtype=bfloat16")]
    line = assert_one_line_error(
        run_entry_in_process(args, capsys), 2, "measured the drafter with the target in float32"
    )
    assert "loads it in bfloat16 (target.dtype=bfloat16)" in line
    assert "evaluate the checkpoint with target.dtype=bfloat16 and pass that report as export.report" in line
    assert "or export with target.dtype=float32" in line
    assert not output.exists()


def test_a_report_in_the_dtype_the_export_loads_the_target_in_is_taken(target, tmp_path):
    """target.dtype=auto is float32 on a CPU, the dtype of a CPU eval's report; a report of an earlier draftsmith
    (no dtype) is taken as before."""
    checkpoint = save_drafter("medusa", target, tmp_path / "run" / "final")
    report = write_report(checkpoint, "float32")
    digest = checkpoint_digest(checkpoint)
    for dtype in ("auto", "float32"):
        cfg = load_recipe(recipe_args("medusa", tmp_path / "export", f"target.dtype={dtype}"))
        assert export_run.find_report(cfg, checkpoint, digest)["_path"] == str(report)
    report.write_text(json.dumps({"drafter": json.loads(report.read_text())["drafter"], **REPORT_SECTIONS}))
    cfg = load_recipe(recipe_args("medusa", tmp_path / "export", "target.dtype=bfloat16"))
    assert export_run.find_report(cfg, checkpoint, digest)["_path"] == str(report)


def test_a_given_targets_dtype_is_the_one_its_report_is_checked_against(target, tmp_path):
    """The sweep hands export its loaded target: the check compared the report with target.dtype's dtype (float32 on
    a CPU) while the card served the given bfloat16 target, so a float32 report passed under a bfloat16 command and
    a bfloat16 one was refused. The given target's dtype is the one compared."""
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    checkpoint = save_drafter("eagle3", target, tmp_path / "run" / "final")
    report = write_report(checkpoint, "float32")
    cfg = load_recipe(recipe_args("eagle3", tmp_path / "export", "export.engines=[vllm]"))
    with pytest.raises(UserError, match=r"in float32, but this export loads it in bfloat16 \(as it was given\)"):
        export_run.export_checkpoint(cfg, checkpoint, target=bf16)
    assert not (tmp_path / "export" / "vllm").exists()
    report.write_text(json.dumps(json.loads(report.read_text()) | {"dtype": "bfloat16"}))
    assert export_run.find_report(cfg, checkpoint, checkpoint_digest(checkpoint), bf16)["_path"] == str(report)


def test_an_eagle3_folder_from_a_bfloat16_target_is_float32_throughout(target, tmp_path):
    """The embedding table EAGLE-3's folder ships was the target's as loaded (bfloat16) among float32 tensors,
    under a layer config saying float32: it is written in float32 too, the values unchanged."""
    bf16 = copy.deepcopy(target).to(torch.bfloat16)
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    cfg = load_recipe(recipe_args("eagle3", tmp_path / "export", "target.dtype=bfloat16", "export.engines=[vllm]"))
    folder = export_run.export_checkpoint(cfg, checkpoint, target=bf16)["vllm"]
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        floats = {name: weights.get_slice(name).get_dtype() for name in weights.keys()}
        floats = {name: dtype for name, dtype in floats.items() if dtype.startswith(("F", "BF"))}
        embedding = weights.get_tensor("embed_tokens.weight")
    assert config["transformer_layer_config"]["torch_dtype"] == "float32"
    assert set(floats.values()) == {"F32"}, floats
    assert torch.equal(embedding, bf16.get_input_embeddings().weight.float())


# -- P-EAGLE's chain -------------------------------------------------------------------------------------------
def test_a_peagle_chain_is_at_most_the_depths_it_trained(target, tmp_path, capsys):
    """Chain position k of P-EAGLE's one forward is its training-time test's step k: ttt_steps is as deep as
    it trained, as PARD's parallel_tokens is; a sequential EAGLE-3 chain feeds each step its own output, at
    any depth. The recipe check, the eval of a checkpoint and the export refuse a longer chain."""
    eagle3 = drafter_class("eagle3")
    assert eagle3.max_chain(eagle3.Config(parallel_drafting=True, mask_token_id=5, ttt_steps=4)) == 4
    assert eagle3.max_chain(eagle3.Config(ttt_steps=4)) is None
    parallel = [f"drafter.{key}={value}" if "." not in key else f"{key}={value}" for key, value in PEAGLE.items()]
    with pytest.raises(UserError, match="eval.num_speculative_tokens=3 but a eagle3 drafter with this config"):
        load_recipe(["recipe=eagle3", *parallel, "drafter.ttt_steps=2", "eval.num_speculative_tokens=3"])
    load_recipe(["recipe=eagle3", *parallel, "drafter.ttt_steps=3", "eval.num_speculative_tokens=3"])
    load_recipe(["recipe=eagle3", "drafter.ttt_steps=2", "eval.num_speculative_tokens=5"])

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", **PEAGLE, ttt_steps=7)
    output = tmp_path / "export"
    args = ["-m", "export", *recipe_args("eagle3", output, f"checkpoint={checkpoint}", "eval.tree=0")]
    result = run_entry_in_process([*args, "export.num_speculative_tokens=12"], capsys)
    assert_one_line_error(result, 2, "num_speculative_tokens=12 but this eagle3 drafter proposes at most 7")
    result = run_entry_in_process([*args, "eval.num_speculative_tokens=8"], capsys)
    assert_one_line_error(result, 2, "proposes at most 7 tokens")
    assert not output.exists()


# -- the engine check's line -------------------------------------------------------------------------------------
def engine_reply(accepted: int, drafts: int = 248) -> dict:
    outputs = [[1, 2, 3]]
    metrics = {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": accepted,
               "accepted_per_position": [accepted, 0, 0]}  # fmt: skip
    return {"vllm_version": "0.32.0", "runs": {"plain": {"outputs": outputs},
                                                "speculative": {"outputs": outputs, "metrics": metrics}}}  # fmt: skip


def draftsmith_run(tau: float) -> dict:
    return {"plain": [[1, 2, 3]], "tau": tau, "at_least": [tau - 1, 0.0, 0.0]}


def test_a_check_where_neither_engine_accepted_a_draft_says_the_drafter_is_undertrained():
    """The probe's DFlash check failed with `vLLM accepted no draft token in 248 drafts`, which blames the export,
    while draftsmith's own decoding of the same prompts accepted none either: the line says both found none and
    to train longer; still a failed check (exit 3: nothing is published). Where draftsmith's decoding accepted
    drafts, the line is as before: the engine reads the drafter otherwise."""
    with pytest.raises(ExportCheckFailed) as failed:
        compare(engine_reply(0), draftsmith_run(1.0), gamma=3, tolerance=0.02, prompts=1, max_new=3)
    line = str(failed.value)
    assert "vLLM accepted no draft token in 248 drafts, nor did draftsmith's own decoding" in line
    assert "the drafter is undertrained, not misread; train it longer" in line and "\n" not in line
    with pytest.raises(ExportCheckFailed) as failed:
        compare(engine_reply(0), draftsmith_run(1.5), gamma=3, tolerance=0.02, prompts=1, max_new=3)
    assert str(failed.value).endswith("failed: vLLM accepted no draft token in 248 drafts")
    summary = compare(engine_reply(124), draftsmith_run(1.5), gamma=3, tolerance=0.02, prompts=1, max_new=3)
    assert summary["tau_engine"] == 1.5


def test_a_bfloat16_plain_output_parting_from_draftsmiths_beyond_a_near_tie_fails_the_check():
    """A bfloat16 check compared vLLM's plain output with draftsmith's only in float32: Medusa-2's Qwen3-Next row
    passed with `equals_draftsmith_plain` false and nothing saying where or by how much, and a served target other
    than the one draftsmith evaluated would have passed the same way. The plain partings are recorded (prompt,
    position, tokens, gap in bfloat16 units) and judged by the near-tie rule the speculative ones are: a near
    tie passes, a parting beyond one fails in one line naming it; in float32 (no partings) any parting fails."""
    from draftsmith.export.verify import parting_gaps
    from tests.helpers import bfloat16_partings

    model, prompts, plain, closest, farthest, parted = bfloat16_partings()

    def check(served, plain_partings=True):
        metrics = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 5,
                   "accepted_per_position": [3, 1, 1]}  # fmt: skip
        runs = {"plain": {"outputs": served}, "speculative": {"outputs": served, "metrics": metrics}}
        engine = {"vllm_version": "0.32.0", "runs": runs}
        ours = {"plain": plain, "tau": 1.5, "at_least": [0.3, 0.1, 0.1]}
        partings = parting_gaps(model, prompts, served, plain) if plain_partings else None
        return compare(engine, ours, 3, 0.02, len(prompts), 24, [], partings)

    summary = check(parted(closest))  # vLLM with and without the drafter alike, its plain output at a near tie
    assert summary["lossless"] and not summary["equals_draftsmith_plain"] and summary["partings"] == []
    (tie,) = summary["plain_partings"]
    assert (tie["prompt"], tie["position"], tie["near_tie"]) == (closest[1], closest[2], True)
    assert tie["tokens"] == [closest[3], plain[closest[1]][closest[2]]] and tie["units"] == round(closest[0], 2)
    from draftsmith.export.card import served_note

    line = served_note("vllm", {**summary, "engine_arguments": {"dtype": "bfloat16", "max_model_len": 64}}, "")
    assert f"plain decoding in bfloat16 on 1 of them, each at a near tie (up to {tie['units']} units)" in line
    assert check(plain)["plain_partings"] == []
    far = f"on 1 prompt\\(s\\) not at a bfloat16 near tie \\(prompt {farthest[1]}, token {farthest[2]}: "
    with pytest.raises(ExportCheckFailed, match=rf"failed: vLLM's plain greedy output differs from draftsmith's {far}"):
        check(parted(farthest))
    with pytest.raises(ExportCheckFailed, match=r"failed: vLLM's plain greedy output differs from draftsmith's$"):
        check(parted(closest), plain_partings=False)


# -- what `checkpoint` export reads ------------------------------------------------------------------------------
def test_export_reads_a_checkpoint_not_an_engine_folder_as_the_keys_help_says(target, tmp_path):
    """docs/recipe.md said export reads "a draftsmith checkpoint or an export's engine folder"; export refuses an
    engine folder (it is an export already): the help says so, and the refusal is one line."""
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    cfg = load_recipe(recipe_args("medusa", tmp_path / "export", "export.engines=[vllm]"))
    folder = export_run.export_checkpoint(cfg, checkpoint, target=target)["vllm"]
    again = load_recipe(recipe_args("medusa", tmp_path / "again", "export.engines=[vllm]"))
    with pytest.raises(UserError, match="is not a draftsmith checkpoint config") as refused:
        export_run.export_checkpoint(again, folder, target=target)
    assert str(refused.value).endswith(
        "(no draftsmith_format): an engine folder (an export, or speculators'), served as it is; train.init_from "
        "trains on from it"
    )
    row = next(
        line for line in (ROOT / "docs" / "recipe.md").read_text().splitlines() if line.startswith("| `checkpoint`")
    )
    assert "export exports it (a draftsmith checkpoint only: an engine folder is an export already)" in row


# -- a push of an export served from subfolders ----------------------------------------------------------------
def test_a_medusa_2_push_is_refused_before_anything_is_exported(target, tmp_path, capsys, monkeypatch):
    """A Medusa-2 export serves its heads (`medusa/`) beside the merged target (`target/`): its card named
    `ORG/NAME/medusa` and `vllm serve ORG/NAME/target` after a push, which no engine loads (a Hub repo's root
    only). One line before the target loads, nothing exported."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # a push is asked for; refused before any Hub is asked
    checkpoint = save_drafter("medusa2", target, tmp_path / "run" / "final")
    output = tmp_path / "served"
    args = recipe_args("medusa2", output, f"checkpoint={checkpoint}", "export.push.repo_id=acme/medusa2-demo")
    result = run_entry_in_process(["-m", "draftsmith", "export", *args], capsys)
    assert_one_line_error(result, 2, "a Medusa-2 export is served from subfolders (medusa/ and the model beside them)")
    assert not output.exists()


# -- a speculators folder read (eval, train.init_from) -----------------------------------------------------------
def test_what_a_speculators_folders_config_says_beside_its_tensors_is_read_or_refused_in_one_line(
    target, tmp_path, caplog
):
    """A newcomer's journey with speculators' own EAGLE-3 folders (2026-12-07): an unknown speculators_model_type was
    blamed on the folder's architectures; an algorithm other than its type's and a later speculators release were
    read without a word; layer ids out of order were blamed on drafter.aux_layers, a key never set; a folder made for
    another target of the same shape was said to have trained embeddings only; a folder without its weights file
    was not said to lack it."""
    import shutil

    from draftsmith.formats.folder import open_drafter
    from draftsmith.target import TargetShape

    shape = TargetShape.of(target, str(REFERENCE_TARGET))
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    folder = export_run.export_checkpoint(load_recipe(recipe_args("eagle3", tmp_path / "export")), checkpoint,
                                          target=target)["vllm"]  # fmt: skip
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_config"]["algorithm"] == "eagle3"

    def edited(name: str, **changes) -> Path:
        copy_ = tmp_path / name
        shutil.copytree(folder, copy_)
        (copy_ / "config.json").write_text(json.dumps({**copy.deepcopy(config), **changes}))
        return copy_

    def refused(path: Path) -> str:
        with pytest.raises(UserError) as error:
            open_drafter(path, shape, target)
        assert "\n" not in str(error.value)
        return str(error.value)

    line = refused(edited("type", speculators_model_type="eagle4"))
    assert line.endswith("(config.json speculators_model_type 'eagle4'; it reads speculators' eagle3, peagle)"), line
    speculators = {**config["speculators_config"], "algorithm": "eagle4"}
    line = refused(edited("algorithm", speculators_config=speculators))
    assert "speculators_config.algorithm 'eagle4' is not its speculators_model_type's ('eagle3')" in line, line
    line = refused(edited("ids", eagle_aux_hidden_state_layer_ids=[1, 3, 2]))
    assert "eagle_aux_hidden_state_layer_ids [1, 3, 2] are not distinct and increasing" in line, line
    with caplog.at_level("WARNING"):
        open_drafter(edited("later", speculators_version="2.3.0"), shape, target)
    assert "was saved by speculators 2.3.0; draftsmith reads speculators 0.9's folders" in caplog.text
    caplog.clear()
    verifier = {**config["speculators_config"], "verifier": {"name_or_path": "acme/other-model"}}
    with caplog.at_level("WARNING"):
        open_drafter(edited("other", speculators_config=verifier), shape, target)
    assert "it names verifier 'acme/other-model', this target is " in caplog.text
    weights = load_file(str(folder / "model.safetensors"))
    other = edited("embedding", speculators_config=verifier)
    save_file({**weights, "embed_tokens.weight": weights["embed_tokens.weight"] + 1}, str(other / "model.safetensors"))
    line = refused(other)
    assert "is not the target's embedding (made for another target: it names verifier 'acme/other-model'" in line
    (edited("no-weights") / "model.safetensors").unlink()
    line = refused(tmp_path / "no-weights")
    assert line.endswith("(config.json + model.safetensors): it has a config.json and no model.safetensors"), line


def test_the_cards_training_line_names_the_decoding_settings_apart(tmp_path):
    """A DFlash journey's export given drafter.tree_topk=2 (a decoding setting, over the checkpoint's 4) printed it
    under the card's Training heading as if the drafter had trained with it: the decoding settings have their own
    line."""
    from draftsmith.export.card import training_section

    info = {"drafter_type": "dflash", "source": {"checkpoint": str(tmp_path / "final")},
            "drafter_config": {"type": "dflash", "num_layers": 1, "block_size": 8, "tree_topk": 2}}  # fmt: skip
    lines = training_section(info)
    assert "- drafter: `dflash` with num_layers=1, block_size=8" in lines
    assert "- decoded with tree_topk=2 (settings of decoding alone, which the export may have set)" in lines
