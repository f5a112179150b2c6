"""`drafter.mtp_depths` of GLM-5-Next's layout (the wrapper `Glm5NextForConditionalGeneration`). vLLM's Glm5NextMTP
(models/glm5next/common/mtp.py) builds `text_config.num_nextn_predict_layers` depths, layer N + j of the wrapper's
language model, each V3.2's wrapper (enorm, hnorm, eh_proj, shared_head.norm; position 0's embedding zeroed, the
normed output fed back) around its own block with pooled sparse attention, and runs depth `spec_step_idx % count` at
draft step i. vLLM 0.34.0's speculative config first reads that count (as `n_predict`), so its model runner V2 hands
the model the step (MultiModuleMTPSpeculator); 0.32 and 0.33 read `num_nextn_predict_layers` at the wrapper's top,
where the release has none, and run depth 0 at every step. draftsmith trains and decodes step i by depth i % 2 over
the whole sequence (heads/mtp_depths.py), and the export names vLLM 0.34 and later. Written from vLLM 0.34.0's source:
no engine has served it here (vLLM's CPU build runs no sparse attention, nor the V2 runner)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.eval.loop import generate
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.target import TargetShape, config_json, load_target
from tests.helpers import trains_one_step
from tests.test_mtp_depths import scored_outputs, token_run
from tests.test_mtp_depths_layouts import release_with_depths, vllm_depth

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
TOPK = {"index_topk": 32}  # two pools of 16 keys: every sequence below runs past the selection


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(folder, model, drafter with 2 depths) of a tiny GLM-5-Next release shipping 2 MTP layers, built once."""
    folder = release_with_depths(tmp_path_factory.mktemp("glm5_next"), "glm5_next", **TOPK)
    model = load_target(str(folder))
    return folder, model, MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder)).eval()


@pytest.mark.slow
def test_training_step_i_runs_depth_i_mod_2_over_the_whole_sequence_as_vllm_0_34_runs_it(release, monkeypatch):
    """ttt_steps=3 are vLLM 0.34's draft steps 0, 1, 2 at every position t: layer N + i % 2's wrapper, read by its
    release names under the wrapper's language model, around that depth's block, on step i-1's normed output at t
    (step 0: the target's final hidden states) and x_{t+i+1}; what the loss scores is that normed output."""
    folder, model, drafter = release
    weights, config = load_file(str(folder / "model.safetensors")), json.loads((folder / "config.json").read_text())
    length = 48
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), model.get_input_embeddings().weight
    with torch.no_grad():
        width, hidden = length - 3, target_out.final[0, : length - 3]
        for step in range(3):
            ahead = ids[0, step + 1 : step + 1 + width]
            hidden, logits_input = vllm_depth(weights, config, "glm5_next", step % 2, drafter, hidden, ahead, embedding)
            assert torch.allclose(outputs[step][0, :width], logits_input, atol=1e-4), step


@pytest.mark.slow
def test_both_depths_train_decode_losslessly_and_export_for_vllm_0_34_under_the_wrappers_names(release, tmp_path):
    """One training step moves depth 1 too; greedy decoding with chains of 2 past the selection is the target's own;
    the folder holds layers N and N + 1 under the wrapper's names with the count 2 in its text_config, read back alike,
    and names vLLM 0.34.0 and later (every release at γ 1, which runs depth 0 alone)."""
    folder, model, _ = release
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder))
    shipped = drafter.checkpoint_tensors()
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(5)))
    moved = drafter.eval().checkpoint_tensors()
    assert any(not torch.equal(moved[n], t) for n, t in shipped.items() if n.startswith(mtp_depths.DEPTHS))
    prompt = torch.randint(3, 4000, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    assert generate(model, prompt, 16, drafter=drafter.proposer(), gamma=2).tokens == generate(model, prompt, 16).tokens
    info = TargetInfo(TargetShape.of(model, str(folder)), model.config.to_dict(), str(folder), config_json(model))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(Source(drafter, tmp_path, model, info), 2, tmp_path / "export")
    check_tensors(repo, "export")
    config = json.loads((folder / "config.json").read_text())
    layers = config["text_config"]["num_hidden_layers"]
    assert {name.split(".")[3] for name in repo.tensors} == {str(layers), str(layers + 1)}
    assert all(name.startswith("model.language_model.layers.") for name in repo.tensors)
    assert repo.config["text_config"]["num_nextn_predict_layers"] == 2 and not repo.compilation_config
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())
    settings = asdict(drafter.config)
    assert exporter.releases(settings, 2).first == "0.34.0" and exporter.releases(settings, 1) == exporter.vllm_releases
