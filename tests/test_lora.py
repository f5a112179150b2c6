"""drafter.lora's target_modules against the modules a model has (heads/lora.py)."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.errors import UserError
from draftsmith.heads.lora import LoraSection
from draftsmith.random_target import tiny_target_config


@pytest.fixture(scope="module")
def latent_attention_target():
    """DeepSeek-V3's attention has q_a_proj, q_b_proj, kv_a_proj_with_mqa and kv_b_proj: no q_proj, k_proj, v_proj."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_target_config("deepseek_v3"))


def adapted_leaves(model) -> set[str]:
    return {name.rpartition(".")[2] for name, module in model.named_modules() if hasattr(module, "lora_A")}


def test_names_the_target_lacks_are_said_and_the_others_adapted(latent_attention_target, caplog):
    """peft adapted o_proj alone without a word: the default list's q_proj, k_proj, v_proj match nothing here."""
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.lora"):
        model = LoraSection().adapted(latent_attention_target, "DeepseekV3ForCausalLM")
    assert adapted_leaves(model) == {"o_proj"}
    (said,) = [record.getMessage() for record in caplog.records]
    assert said.startswith(
        "drafter.lora.target_modules: q_proj, k_proj, v_proj match no module of DeepseekV3ForCausalLM"
    )
    assert "so only o_proj get adapters" in said and "kv_b_proj" in said
    model.unload()  # the module-scoped target without peft's layers for the next test


def test_names_the_target_has_adapt_without_a_word_and_a_dotted_name_is_a_suffix(latent_attention_target, caplog):
    lora = LoraSection(target_modules=["self_attn.kv_b_proj", "q_b_proj"])
    with caplog.at_level(logging.WARNING, logger="draftsmith.heads.lora"):
        model = lora.adapted(latent_attention_target, "DeepseekV3ForCausalLM")
    assert adapted_leaves(model) == {"kv_b_proj", "q_b_proj"} and not caplog.records
    model.unload()


def test_no_name_the_target_has_is_refused_with_its_linear_layers(latent_attention_target):
    with pytest.raises(
        UserError,
        match=r"^drafter.lora does not fit DeepseekV3ForCausalLM: no module named k_proj, "
        r"v_proj \(its linear layers: down_proj, gate_proj, kv_a_proj_with_mqa, ",
    ):
        LoraSection(target_modules=["k_proj", "v_proj"]).adapted(latent_attention_target, "DeepseekV3ForCausalLM")
