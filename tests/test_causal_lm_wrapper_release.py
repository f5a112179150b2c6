"""A vision-language wrapper that transformers loads as a causal LM itself (Gemma-4 Unified's `gemma4_unified`, whose
vision tower is an encoder-free embedder sized by `mm_*` fields) is written by draftsmith.random_target in its release
form where asked (`released`): the wrapper whole, its embedder at the tiny width, which loads as the target (the
wrapper's own class, the architecture an engine reads); its type alone still writes its language model."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.random_target import write_random_target
from draftsmith.target import load_target, loaded_config

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16}


@pytest.mark.slow  # 4 s alone: transformers' Gemma-4 Unified modules imported
def test_a_causal_lm_wrappers_release_form_is_written_whole_with_a_tiny_embedder(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = write_random_target("gemma4_unified", tmp_path / "release", released=True, **SMALL)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma4UnifiedForConditionalGeneration"]
    vision = config["vision_config"]
    assert (vision["mm_embed_dim"], vision["mm_posemb_size"], vision["output_proj_dims"]) == (32, 16, 64)
    target = load_target(str(folder))
    assert loaded_config(target)["architectures"] == ["Gemma4UnifiedForConditionalGeneration"]
    ids = torch.randint(3, 4000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(folder).eval()(input_ids=ids).logits
        torch.testing.assert_close(target(input_ids=ids).logits, expected)
    plain = write_random_target("gemma4_unified", tmp_path / "text", **SMALL)
    assert json.loads((plain / "config.json").read_text())["architectures"] == ["Gemma4UnifiedForCausalLM"]
