"""The fields a tiny target's config.json carries as its family's releases do (draftsmith.declared_fields's
`release_fields`), which vLLM reads where transformers has others or none: each equal to what transformers computes
from the written folder (its modules, its rotary embedding, its config read back), none of them changing the target
transformers builds, and none written for a family whose engines read the name otherwise."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.random_target import write_random_target
from draftsmith.tiny_config import build_config

pytestmark = pytest.mark.usefixtures("one_thread")

# the fields written for a family whose sliding layers are built apart from its full ones (MiMo-V2-Flash's)
PER_LAYER_FORM = {"hybrid_layer_pattern", "moe_layer_freq", "swa_num_attention_heads", "swa_head_dim", "swa_rope_theta"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """model type -> (config.json, the causal LM transformers builds from the folder) of a tiny target at the
    matrix's shape (head_dim 64), written once."""

    @functools.cache
    def write(model_type: str):
        folder = write_random_target(model_type, tmp_path_factory.mktemp(model_type))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return json.loads((folder / "config.json").read_text()), model

    return write


def attention_heads(attention) -> tuple[int, int, int, int]:
    """Query heads, key-value heads, key and value widths of an attention module, read off its weights."""
    width = attention.head_dim
    kv_heads = attention.k_proj.weight.shape[0] // width
    return attention.q_proj.weight.shape[0] // width, kv_heads, width, attention.v_proj.weight.shape[0] // kv_heads


def test_mimo_v2_flash_carries_its_releases_per_layer_fields_as_transformers_builds_the_layers(written):
    config, model = written("mimo_v2_flash")
    built = model.config
    sliding = built.layer_types.index("sliding_attention")
    full = built.layer_types.index("full_attention")
    layers = model.model.layers
    assert config["hybrid_layer_pattern"] == [int(kind == "sliding_attention") for kind in built.layer_types]
    assert config["moe_layer_freq"] == [int(hasattr(layer.mlp, "experts")) for layer in layers]
    swa = [config[f"swa_{name}"] for name in ("num_attention_heads", "num_key_value_heads", "head_dim", "v_head_dim")]
    assert tuple(swa) == attention_heads(layers[sliding].self_attn)
    assert swa[1] == 2 * config["num_key_value_heads"]  # built apart: twice the full layers' key-value heads
    assert config["add_swa_attention_sink_bias"] == (layers[sliding].self_attn.sinks is not None) is True
    assert config["add_full_attention_sink_bias"] == (layers[full].self_attn.sinks is not None) is False
    assert config["layernorm_epsilon"] == layers[0].input_layernorm.variance_epsilon
    # the window as the class reads it back from the release's name for it
    assert type(built).from_dict({**config, "sliding_window": -1}).sliding_window == built.sliding_window
    assert config["sliding_window_size"] == built.sliding_window - 1
    rope = built.rope_parameters
    assert (config["rope_theta"], config["swa_rope_theta"]) == (
        rope["full_attention"]["rope_theta"],
        rope["sliding_attention"]["rope_theta"],
    )


def test_mimo_v2_flash_rotates_one_even_width_that_transformers_and_the_fields_agree_on(written):
    """The rotary width: transformers' rotary embedding's (its inverse frequencies, in pairs), `rotary_dim`, and
    head_dim × the top-level `partial_rotary_factor` vLLM's MiMo-V2 reads: all 22 of 64 (the class's 0.334 turns 21,
    which transformers rounds up to 22 and an engine does not)."""
    config, model = written("mimo_v2_flash")
    turned = {2 * len(b) for n, b in model.model.rotary_emb.named_buffers() if n.endswith("_attention_inv_freq")}
    assert turned == {config["rotary_dim"]} == {int(config["head_dim"] * config["partial_rotary_factor"])} == {22}
    assert config["v_head_dim"] == config["head_dim"] == 64  # value heads as wide as the keys (not the class's 128)


def test_hy_v3_carries_the_fields_vllm_reads_as_transformers_builds_the_layers(written):
    config, model = written("hy_v3")
    layers = model.model.layers
    first_experts = next(i for i, layer in enumerate(layers) if hasattr(layer.mlp, "experts"))
    assert config["first_k_dense_replace"] == first_experts == 1
    assert config["expert_hidden_dim"] == layers[first_experts].mlp.experts.down_proj.shape[-1]
    assert config["qk_norm"] is True and all(hasattr(layer.self_attn, "q_norm") for layer in layers)
    assert config["route_norm"] is True  # transformers' HY-V3 router always renormalises: no field says otherwise


def test_afmoe_carries_the_router_fields_vllm_reads_as_transformers_routes(written):
    """transformers' AFMoE router scores the experts by a sigmoid, picks them with its `expert_bias` and renormalises
    the chosen ones' weights (then scales them by `route_scale`), in no groups: the fields vLLM's model reads say so
    (vLLM failed on a tiny target without them: "'AfmoeConfig' object has no attribute 'score_func'")."""
    config, model = written("afmoe")
    assert {name: config[name] for name in ("score_func", "route_norm", "n_group", "topk_group")} == {
        "score_func": "sigmoid", "route_norm": True, "n_group": 1, "topk_group": 1,
    }  # fmt: skip
    mlp = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "expert_bias"))
    hidden = torch.randn(1, 5, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    bias = torch.randn(config["num_experts"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, weights, chosen = mlp.router(hidden, bias)
    scores = torch.sigmoid(mlp.router.gate(hidden[0]).float())
    expected = scores.gather(1, (scores + bias).topk(config["num_experts_per_tok"], dim=1).indices)
    torch.testing.assert_close(weights, expected / expected.sum(-1, keepdim=True) * config["route_scale"])


@pytest.mark.parametrize("model_type", ["mimo_v2_flash", "hy_v3", "exaone_moe", "afmoe"])
def test_the_added_fields_change_nothing_transformers_builds(model_type, written):
    config, model = written(model_type)
    added = {"qk_norm", "route_norm", "expert_hidden_dim", "layernorm_epsilon", "first_k_dense_replace"}
    added |= {"score_func", "n_group", "topk_group"}
    added |= PER_LAYER_FORM | {"sliding_window_size", "rope_theta", "partial_rotary_factor", "swa_v_head_dim"}
    without = {name: value for name, value in config.items() if name not in added}
    bare = type(model.config).from_dict(without).to_dict()
    full = AutoConfig.from_pretrained(model.config._name_or_path).to_dict()
    assert {name: full[name] for name in bare if name != "_name_or_path"} == {
        name: value for name, value in bare.items() if name != "_name_or_path"
    }


@pytest.mark.parametrize("model_type", ["exaone_moe", "gemma3_text", "glm4_moe_lite"])
def test_families_whose_layers_one_config_describes_get_no_per_layer_form(model_type, tmp_path):
    """Exaone-MoE's and Gemma-3's sliding layers are built as their full ones; glm4_moe_lite's vLLM model reads
    `moe_layer_freq` as a number (every n-th layer), which a per-layer list would break."""
    config = json.loads((write_random_target(model_type, tmp_path) / "config.json").read_text())
    assert not PER_LAYER_FORM & config.keys()


def test_a_field_the_class_has_is_kept():
    """DeepSeek-V3's own `first_k_dense_replace` (2 given here) stays, not the count its layer kinds would give."""
    from draftsmith.declared_fields import declare_as_released
    from draftsmith.random_target import build_model

    config = build_config("deepseek_v3", 4096, first_k_dense_replace=2, num_hidden_layers=3)
    declare_as_released(config, build_model(config))
    assert config.first_k_dense_replace == 2 and config.route_norm == config.norm_topk_prob
