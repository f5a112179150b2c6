"""GGUF targets: a GGUF file written here from the demo target (llama.cpp's layout: its tensor names,
q/k rows permuted as llama.cpp's converter does, a gpt2-style tokenizer with the chat template)
is dequantized by `target.gguf_file` into a cached directory whose model gives the demo target's
logits and whose tokenizer encodes and renders the same; the recipe then trains on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.gguf import SOURCE_FILE, header_shape, materialize
from draftsmith.recipe import load_recipe, validated
from draftsmith.resources import bundled
from draftsmith.target import TargetShape, load_target, load_tokenizer

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.usefixtures("one_thread")

DEMO = bundled("demo/target")


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves; transformers undoes it on load."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_demo_gguf(path: Path) -> None:
    config = json.loads((DEMO / "config.json").read_text())
    tokenizer = json.loads((DEMO / "tokenizer.json").read_text())
    weights = {name: tensor.float().numpy() for name, tensor in load_file(DEMO / "model.safetensors").items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("demo-target")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    special = {token["id"] for token in tokenizer["added_tokens"] if token["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if index in special else gguf.TokenType.NORMAL for _, index in vocab]
    )
    writer.add_token_merges(
        [" ".join(merge) if isinstance(merge, list) else merge for merge in tokenizer["model"]["merges"]]
    )
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template((DEMO / "chat_template.jinja").read_text())

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config["num_hidden_layers"]):
        for ours, theirs in names.items():
            weight = weights[f"model.layers.{layer}.{ours}.weight"]
            if theirs == "attn_q":
                weight = llama_cpp_permute(weight, heads)
            elif theirs == "attn_k":
                weight = llama_cpp_permute(weight, kv_heads)
            writer.add_tensor(f"blk.{layer}.{theirs}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def demo_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "demo-target.F32.gguf"
    write_demo_gguf(path)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.slow  # dequantizes the 135M-parameter GGUF
def test_gguf_target_dequantizes_to_the_same_model_and_tokenizer(demo_gguf, cache):
    umask = os.umask(0o022)
    try:
        directory = materialize(str(demo_gguf.parent), demo_gguf.name)
    finally:
        os.umask(umask)
    assert directory.parent == cache / "targets" and directory.name.startswith("demo-target.F32-")
    # safetensors writes through a private temporary file (mode 0600): the cache's files get the umask's mode
    # (0644 under umask 022), so that a job run by another user sharing DRAFTSMITH_CACHE can load the target
    modes = {path.name: oct(path.stat().st_mode & 0o777) for path in directory.iterdir() if path.is_file()}
    assert "model.safetensors" in modes and {name: mode for name, mode in modes.items() if mode != oct(0o644)} == {}
    assert json.loads((directory / SOURCE_FILE).read_text())["gguf_file"] == str(demo_gguf.resolve())
    assert "quantization_config" not in json.loads((directory / "config.json").read_text())

    original, converted = load_target(str(DEMO)), load_target(str(directory))
    ours, theirs = load_tokenizer(str(DEMO)), load_tokenizer(str(directory))
    messages = [
        {"role": "user", "content": "Sort a list in Python, then print it."},
        {"role": "assistant", "content": "Use sorted(xs)."},
    ]
    text = ours.apply_chat_template(messages, tokenize=False)
    assert theirs.apply_chat_template(messages, tokenize=False) == text
    assert theirs(text)["input_ids"] == ours(text)["input_ids"]
    ids = torch.tensor([ours(text)["input_ids"]])
    torch.testing.assert_close(converted(ids).logits, original(ids).logits, rtol=1e-4, atol=1e-4)

    # A second use finds the cache (no conversion: the directory is untouched).
    stamp = (directory / "model.safetensors").stat().st_mtime_ns
    assert materialize(str(demo_gguf), str(demo_gguf)) == directory
    assert (directory / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_recipe_with_gguf_file_points_every_stage_at_the_cached_directory(demo_gguf, cache, tmp_path):
    cfg = load_recipe(
        [
            "recipe=medusa",
            f"target.name_or_path={demo_gguf.parent}",
            f"target.gguf_file={demo_gguf.name}",
            f"output_dir={tmp_path / 'run'}",
        ]
    )
    assert Path(cfg.target.name_or_path).parent == cache / "targets"
    assert cfg.target.gguf_file is None  # the recipe a run saves loads the directory, not the file again


def test_validation_reads_the_header_and_converts_nothing(demo_gguf, cache, tmp_path):
    """Validating a GGUF recipe (what `--cfg` prints, what every bad setting is caught by) parses the
    file's header alone: the drafter is checked against the shape written there, and nothing is
    dequantized or cached."""
    args = ["recipe=eagle3", f"target.name_or_path={demo_gguf.parent}", f"target.gguf_file={demo_gguf.name}",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    assert header_shape(str(demo_gguf.parent), demo_gguf.name) == TargetShape.from_config(
        json.loads((DEMO / "config.json").read_text()), str(demo_gguf)
    )
    assert validated(args).target.gguf_file == demo_gguf.name
    with pytest.raises(UserError, match=r"layer id\(s\) \[4\] out of range for a target with 4 layers"):
        validated([*args, "drafter.aux_layers=[0,4]"])
    assert not (cache / "targets").exists()


def test_missing_gguf_file_is_one_line(tmp_path, cache):
    with pytest.raises(UserError, match="no such file"):
        load_recipe(
            [
                "recipe=medusa",
                f"target.name_or_path={tmp_path}",
                "target.gguf_file=absent.gguf",
                f"output_dir={tmp_path / 'run'}",
            ]
        )
    assert not (cache / "targets").exists() or not any((cache / "targets").iterdir())


def test_not_a_gguf_file_is_one_line(tmp_path, cache):
    (tmp_path / "broken.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(UserError, match="cannot read GGUF target"):
        materialize(str(tmp_path), "broken.gguf")
    assert not any(path.name.endswith(".partial") for path in (cache / "targets").iterdir())
