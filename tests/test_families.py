"""Target families: every decoder-only family that transformers and vLLM both implement goes through
draftsmith with no code of its own. Tiny random-weight targets of each family (draftsmith.random_target:
hidden 256, 4 layers, GQA, mixtures of experts with 4 experts, sliding windows shorter than the test's
sequences so that every windowed layer actually drops keys) prove, per family:

- the layer-index convention: a captured layer id i is transformers' hidden_states[i + 1];
- the eval loop: plain decoding equals transformers' own greedy `generate` (the family's real masks and
  cache), a batch decodes as each prompt alone, and a tree's one-forward verification equals the
  forwards of each of its paths, also past a sliding window;
- EAGLE-3 with Llama draft layers (and Qwen3 ones) trains, saves and loads, resumes exactly (its
  weights and optimizer state reloaded, it continues as the run that never stopped), and decodes
  losslessly.

The real engine's side (vLLM serving each family's drafter with draftsmith's acceptance) is
tests/test_families_vllm.py; the whole matrix of kinds is benchmarks/target_matrix.py.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import subprocess

import pytest
import torch
from omegaconf import OmegaConf

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, generate_batch
from draftsmith.eval.target_checks import keeps_each_position
from draftsmith.families import (
    BLOCK_INDEXED,
    COMPRESSED,
    FULL,
    LINEAR,
    SLIDING,
    clamp_lists,
    layer_types,
    reads_in_order,
)
from draftsmith.heads import drafter_class, drafters
from draftsmith.heads.base import load_drafter
from draftsmith.random_target import build_model
from draftsmith.target import FeatureRequest, run_target
from draftsmith.tiny_config import build_config
from draftsmith.tiny_wrapper import tiny_wrapper_config
from draftsmith.wrapped_text import TextOfWrapper
from tests.helpers import (
    OracleDrafter,
    assert_one_line_error,
    assert_tree_forward_equals_path_forwards,
    demo_drafter_section,
    fast_tier,
    product_strings,
    random_target_command,
    run_entry_in_process,
    train_args,
    trains_and_decodes_its_target_losslessly,
    trains_one_step,
    transformers_greedy,
)

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma2", "gemma3_text", "phi3", "gpt_oss",
    "glm4", "cohere", "granite", "qwen3_next", "qwen3_5_text", "deepseek_v3", "glm4_moe", "glm4_moe_lite",
    "minimax_m2", "gemma4_text", "deepseek_v32", "deepseek_v4", "glm_moe_dsa", "glm5_next", "qwen4_exp", "hy_v4",
    "minimax_m3_vl", "dots3_note", "inkling_text", "gemma4_unified_text", "muse_glimmer", "muse_spark", "mistral4",
    "bailing_hybrid", "kimi_linear", "glmga", "exaone4_5", "granitemoehybrid", "bamba", "falcon_h1",
)  # fmt: skip
# experts; scaled embedding and (1+w) norms; fused projections; sinks, a hybrid window and experts; LayerNorm with a
# parallel block; linear attention; latent attention with grouped, bias-corrected routing
QUIRKS = ("qwen3_moe", "gemma3_text", "phi3", "gpt_oss", "cohere", "qwen3_next", "deepseek_v3")
# the fast tier runs the per-family tests on Llama and a window, sinks, linear and latent attention; the other
# quirks' families and the rest in the slow tier
FAST_QUIRKS = ("gemma3_text", "gpt_oss", "qwen3_next", "deepseek_v3")
# whose linear-attention layers transformers keeps a state per position for (Qwen4-Exp's and Inkling's hold several)
LINEAR_FAMILIES = ("qwen3_next", "qwen3_5_text", "glm5_next", "bailing_hybrid", "kimi_linear", "granitemoehybrid",
                   "bamba", "falcon_h1")  # fmt: skip
TIERED = fast_tier(list(FAMILIES), lambda family: family == "llama" or family in FAST_QUIRKS)
VOCAB, WINDOW = 256, 12  # a window far shorter than the sequences below
# GLM-GA's rotary embedding splits a head's frequencies in the sections its rope parameters give, else in those of a
# 64-wide head ([8, 12, 12]): a 16-wide head's in the same shares
ROPE_SECTIONS = {"glmga": [2, 3, 3]}


def tiny(model_type: str, attn: str | None = None):
    """A 2-layer model of the family at a small width (fast), its sliding-window layers WINDOW wide; with
    linear attention 3 layers, so that a draft of its first 2 layers holds both kinds too; with compressed
    attention 3 layers, both compressed kinds first, pooling every 2 and 4 positions, the indexer picking 3
    of the pooled entries (the sequences below are several times longer). A wrapper transformers has no causal LM
    class for (GLM-5-Next) is built whole and run as draftsmith loads it: its language model and lm_head."""
    config = build_config(
        model_type, VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, sliding_window=WINDOW,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
    )  # fmt: skip
    if model_type in ROPE_SECTIONS:
        config.rope_parameters = {**config.rope_parameters, "mrope_section": ROPE_SECTIONS[model_type]}
    kinds = set(getattr(config, "layer_types", None) or ())
    if LINEAR in kinds:  # the family's attention kind: that of its 4-layer default's last layer
        attention = layer_types(build_config(model_type, VOCAB, {"eos_token_id": 2}))[-1]
        config.num_hidden_layers = 3
        if hasattr(config, "attn_layer_indices"):  # kinds its class derives from the attention layers' (Bamba's)
            config.attn_layer_indices = [1]
        else:
            config.layer_types = [LINEAR, attention, LINEAR]
        for per_layer in ("mlp_layer_types", "indexer_types", *clamp_lists(config.to_dict())):  # one entry per layer
            if len(getattr(config, per_layer, None) or ()) == 2:
                setattr(config, per_layer, [*getattr(config, per_layer), getattr(config, per_layer)[-1]])
    elif kinds & set(COMPRESSED):
        config.num_hidden_layers, config.layer_types = 3, [*COMPRESSED, SLIDING]
        config.compress_rates, config.index_topk = dict(zip(COMPRESSED, (2, 4))), 3
        config.mlp_layer_types = [*config.mlp_layer_types, config.mlp_layer_types[-1]]  # one per layer
    elif SLIDING in kinds and kinds <= {SLIDING, FULL}:
        config.layer_types = [SLIDING, FULL]  # hybrid: both kinds in 2 layers
    if getattr(config, "indexer_budget", None):  # a block-sparse indexer: 2 blocks of 4, the sequences many more
        config.indexer_budget = 2 * config.indexer_compress_ratio
    if getattr(config, "index_block_size", None):  # one that picks blocks of keys: 2 blocks, the local one among them
        config.index_topk_blocks = 2
    if attn is not None:
        config._attn_implementation = attn
    wrapper = tiny_wrapper_config(model_type, config)
    model = build_model(wrapper or config, std=0.2)
    return (TextOfWrapper.of(model) if wrapper else model).requires_grad_(False)


@pytest.fixture(scope="module", params=TIERED)
def family(request):
    return request.param, tiny(request.param)


def random_prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def one_state(hidden: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """A layer's output [B, T, H]: DeepSeek-V4's hyper-connections pass [B, T, hc_mult, H], read as their mean
    (test_a_multi_stream_targets_taps_are_vllms_mean_of_each_layers_mixed_streams); Qwen4-Exp's lay them side by
    side, [B, T, hc_count * H] (`width`: H)."""
    if width is not None and hidden.shape[-1] != width:
        hidden = hidden.unflatten(-1, (-1, width))
    return hidden.mean(dim=-2) if hidden.dim() == 4 else hidden


def test_captured_layer_i_is_hidden_states_i_plus_1(family):
    _, model = family
    ids = torch.tensor([random_prompt(20, 0)])
    out = run_target(model, ids, request=FeatureRequest(layers=(-1, 0, 1)))
    reference = model(ids, output_hidden_states=True).hidden_states
    for layer in (-1, 0, 1):
        torch.testing.assert_close(out.layers[layer], one_state(reference[layer + 1], model.config.hidden_size))
    torch.testing.assert_close(out.logits, model(ids).logits)


def test_plain_loop_equals_generate_past_the_window(family):
    """The loop's cache keeps every key and its masks hide those out of a layer's window: the tokens
    are transformers' own greedy ones (its sliding-window cache and masks) far past the window."""
    name, model = family
    prompt = random_prompt(2 * WINDOW, 1)
    ours = generate(model, prompt, 3 * WINDOW).tokens
    theirs = transformers_greedy(model, prompt, 3 * WINDOW)
    assert ours == theirs, name


def test_batch_decodes_as_each_prompt_alone(family):
    _, model = family
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 2 * WINDOW, WINDOW + 3))]
    together = [result.tokens for result in generate_batch(model, prompts, 2 * WINDOW)]
    assert together == [generate(model, prompt, 2 * WINDOW).tokens for prompt in prompts]


def test_tree_forward_equals_path_forwards_past_the_window(family):
    """On attention layers; a linear-attention state reads a draft in order, so a tree is one line."""
    name, model = family
    if reads_in_order(model.config):
        with pytest.raises(UserError, match="verifies chains only"):
            generate(model, random_prompt(8, 2), 4, drafter=OracleDrafter([3] * 4, 8, VOCAB, 1.0), tree=[(0,), (1,)])
        return
    prefix = random_prompt(2 * WINDOW, 2)
    parents = torch.tensor([-1, -1, 0, 0, 1, 2, 2, 4, -1])
    tokens = torch.tensor(random_prompt(len(parents), 3))
    assert_tree_forward_equals_path_forwards(model, prefix, tokens, parents)


def test_eagle3_trains_resumes_and_decodes_losslessly(family, tmp_path):
    name, model = family
    assert_eagle3_trains_resumes_and_decodes(name, model, "llama", tmp_path)


# Qwen3 draft layers differ from Llama's in the drafter only: a dense, a sliding-window, a linear-attention
# and a latent-attention target suffice (every family with Llama layers above)
@pytest.mark.parametrize("name", fast_tier(["qwen3", "gemma3_text", "qwen3_next", "deepseek_v3"], "qwen3".__eq__))
def test_eagle3_with_qwen3_draft_layers_trains_resumes_and_decodes_losslessly(name, tmp_path):
    assert_eagle3_trains_resumes_and_decodes(name, tiny(name), "qwen3", tmp_path)


def assert_eagle3_trains_resumes_and_decodes(name: str, model, layer_family: str, tmp_path) -> None:
    """EAGLE-3 with draft layers of the chosen family on any target: its loss trains it; the saved
    checkpoint reloads to the same drafter, and with the optimizer's state (as the trainer resumes:
    the drafter's weights from its checkpoint, the optimizer's state by parameter order) two more steps
    land exactly where the uninterrupted run's do; its chain decodes exactly plain greedy's tokens."""
    eagle3 = drafter_class("eagle3")
    config = eagle3.Config(aux_layers=[-1, 0], draft_vocab_size=VOCAB, ttt_steps=2, layer_family=layer_family)
    drafter = eagle3.from_target(config, model, name)
    assert drafter.config.decoder["config"]["model_type"] == layer_family
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    target_out = run_target(model, ids, request=eagle3.features(drafter.config, drafter.target))

    def steps(drafter, optimizer, count: int) -> list[float]:
        losses = []
        for _ in range(count):
            loss_sum, tokens, _ = drafter.loss(batch, target_out)
            loss = loss_sum / tokens
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    losses = steps(drafter, optimizer, 2)
    drafter.save_pretrained(tmp_path)
    reloaded = load_drafter(tmp_path, target_model=model)
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[key]), key
    resumed = torch.optim.AdamW(reloaded.parameters(), lr=1e-2)
    resumed.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as saved: its own tensors, not the run's
    losses += steps(drafter, optimizer, 2)
    assert losses[-1] < losses[0], losses
    assert steps(reloaded, resumed, 2) == losses[2:]
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(tensor, reloaded.state_dict()[key]), key
    prompt = random_prompt(WINDOW + 5, 5)
    plain = generate(model, prompt, 2 * WINDOW).tokens
    for proposer in (drafter.eval().proposer(), reloaded.eval().proposer()):
        assert generate(model, prompt, 2 * WINDOW, drafter=proposer, gamma=3).tokens == plain


# EAGLE-3 on the fast tier's quirk families: test_eagle3_trains_resumes_and_decodes_losslessly, which resumes it too.
# Not here: `mtp`, which reads the MTP layer a target's checkpoint ships (tests/test_mtp.py, on the families that have
# one), and `gemma4_assistant`, which reads a Gemma-4 target's KV cache (tests/test_gemma4_assistant.py).
TARGET_BOUND = {"mtp", "gemma4_assistant"}


@pytest.mark.parametrize("kind", fast_tier(sorted(set(drafters()) - TARGET_BOUND), lambda kind: kind != "eagle3"))
@pytest.mark.parametrize(  # the fast tier: linear attention, latent attention with experts
    "model_type",
    fast_tier(
        [*QUIRKS, "deepseek_v4", "glm5_next", "muse_spark"],
        lambda family: family in ("qwen3_next", "deepseek_v3"),
    ),
)
def test_every_kind_trains_and_decodes_losslessly_on_family_quirks(kind, model_type):
    """Each registered kind, as its demo recipe configures it, on targets whose families differ from
    Llama in every way the stages meet: one training step moves it, and it decodes plain greedy's tokens."""
    model = tiny(model_type)
    config = OmegaConf.to_object(demo_drafter_section(kind, ()))
    if kind == "draft_model" and model_type in ("glm5_next", "muse_spark"):  # a draft of the first layers: a causal
        # LM of the language model, which transformers lacks
        config.num_layers = model.config.num_hidden_layers  # attention among them: the class is what is missing
        with pytest.raises(UserError, match=r"a causal LM of its language model, and transformers .* no causal LM"):
            drafters()[kind].from_target(config, model, model_type)
        return
    if hasattr(config, "aux_layers"):
        config.aux_layers = [-1, 0]
    if hasattr(config, "target_layers"):
        config.target_layers = [0]
    if hasattr(config, "init") and reads_in_order(model.config):
        config.num_layers = 2  # a draft of the target's layers: linear attention, then the attention it needs
    drafter = drafters()[kind].from_target(config, model, model_type)
    trains_one_step(drafter, model, torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(6)))
    proposer = drafter.eval().proposer()
    verifier = proposer.verifier if proposer.verifier is not None else model
    prompt = random_prompt(WINDOW + 5, 7)
    plain = generate(verifier, prompt, 2 * WINDOW).tokens
    gamma = min(3, drafters()[kind].max_chain(drafter.config) or 3)
    assert generate(verifier, prompt, 2 * WINDOW, drafter=proposer, gamma=gamma).tokens == plain


def test_a_draft_of_the_first_layers_keeps_their_slice_of_per_layer_inputs_and_overrides(tmp_path):
    """Gemma-4 feeds each layer an input of its own, from embeddings and a projection stacked layer after
    layer ([vocabulary, layers x width]), sizes some layers apart (`per_layer_config`: a wider head on its
    last) and makes its last layer full attention whatever it is given: a draft model of the target's first
    two layers (sliding, full) keeps their slice of the inputs and the overrides of its own layers only,
    rebuilds as it was saved, and decodes losslessly; a draft ending on a sliding layer, which the class
    would turn into full attention, is one line naming the layer count that works."""
    config = build_config(
        "gemma4_text", VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, sliding_window=WINDOW,
        hidden_size=64, intermediate_size=128, head_dim=16, layer_types=[SLIDING, FULL, SLIDING, FULL],
    )  # fmt: skip
    assert config.num_hidden_layers == 4 and config.to_dict()["per_layer_config"]  # the quirks are there
    model = build_model(config, std=0.2).requires_grad_(False)
    draft = drafter_class("draft_model")
    with pytest.raises(UserError, match=r"turns a draft of the target's first 1 layers .* set drafter.num_layers=2$"):
        draft.from_target(draft.Config(num_layers=1), model, "")
    drafter = draft.from_target(draft.Config(num_layers=2), model, "")
    assert layer_types(drafter.model.config) == [SLIDING, FULL]
    overrides = {layer: sizes for layer, sizes in config.to_dict()["per_layer_config"].items() if int(layer) < 2}
    assert len(overrides) < len(config.to_dict()["per_layer_config"])  # the target has overrides past the draft
    assert drafter.model.config.to_dict()["per_layer_config"] == overrides
    width = 2 * model.config.hidden_size_per_layer_input
    ours, theirs = drafter.state_dict(), model.state_dict()
    assert torch.equal(
        ours["model.model.embed_tokens_per_layer.weight"], theirs["model.embed_tokens_per_layer.weight"][:, :width]
    )
    assert torch.equal(
        ours["model.model.per_layer_model_projection.weight"], theirs["model.per_layer_model_projection.weight"][:width]
    )
    drafter.save_pretrained(tmp_path / "draft")  # rebuilt from its saved config as it was made
    reloaded = load_drafter(tmp_path / "draft", drafter.target, model)
    assert all(torch.equal(tensor, reloaded.state_dict()[name]) for name, tensor in drafter.state_dict().items())
    prompt = random_prompt(WINDOW + 5, 7)
    proposer = reloaded.eval().proposer()
    assert (
        generate(model, prompt, 2 * WINDOW, drafter=proposer, gamma=3).tokens
        == generate(model, prompt, 2 * WINDOW).tokens
    )


def test_a_draft_of_the_first_layers_takes_the_first_entries_of_every_per_layer_list():
    """DeepSeek-V3.2 lists each layer's MLP kind (`mlp_layer_types`, dense then experts), which its config class
    checks against the layer count: a one-layer draft of it keeps the first entry (it failed with an internal
    error, found by benchmarks/target_matrix.py) and decodes losslessly."""
    model = tiny("deepseek_v32")
    assert isinstance(model.config.to_dict().get("mlp_layer_types"), list)
    draft = drafter_class("draft_model")
    drafter = draft.from_target(draft.Config(num_layers=1), model, "").eval()
    assert drafter.model.config.mlp_layer_types == model.config.mlp_layer_types[:1]
    prompt = random_prompt(20, 5)
    assert generate(model, prompt, 20, drafter=drafter.proposer(), gamma=3).tokens == generate(model, prompt, 20).tokens


def assert_chains_lossless_far_past_the_window_and_trees_refused(model, fed_again: bool) -> None:
    """Oracle chains decoding three prompts far past the window equal plain decoding, prompt by prompt (drafts
    accepted and rejected) and in a batch, and so do drafts never accepted; a tree is refused in one line. Where the
    states are put back from a copy (`fed_again`), the tokens carried past drafts never accepted are fed on their own
    once more than REFEED_LIMIT; elsewhere no verify forward is wider than the root and the draft."""
    from draftsmith.eval.loop import REFEED_LIMIT

    prompts = [random_prompt(length, seed) for seed, length in enumerate((12, 5, 20))]
    plain = [generate(model, prompt, 2 * WINDOW).tokens for prompt in prompts]
    assert 2 * WINDOW > REFEED_LIMIT + 1  # one token a cycle: the carried tokens pass the limit
    widths = []
    hook = model.register_forward_pre_hook(lambda _, __, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        never = generate(model, prompts[0], 2 * WINDOW, drafter=OracleDrafter(plain[0], 12, VOCAB, 0.0), gamma=3)
    finally:
        hook.remove()
    assert never.tokens == plain[0] and never.counts.accepted == 0
    widest = max(widths[-2 * WINDOW :])  # the verify forwards (one a token: none accepted), not a check's or prefill
    assert REFEED_LIMIT < widest <= REFEED_LIMIT + 1 + 3 if fed_again else widest == 1 + 3
    oracles = [
        OracleDrafter(tokens, len(prompt), VOCAB, hit_rate=rate, seed=i)
        for i, (tokens, prompt, rate) in enumerate(zip(plain, prompts, (0.9, 0.5, 0.7)))
    ]
    alone = [generate(model, p, 2 * WINDOW, drafter=o, gamma=3) for p, o in zip(prompts, oracles)]
    assert [row.tokens for row in alone] == plain
    counts = [row.counts for row in alone]
    assert sum(c.accepted for c in counts) > 0 and any(c.accepted < c.drafted for c in counts)  # both outcomes
    oracles = [OracleDrafter(t, len(p), VOCAB, hit_rate=r, seed=9) for t, p, r in zip(plain, prompts, (0.9, 0.2, 0.6))]
    assert [row.tokens for row in generate_batch(model, prompts, 2 * WINDOW, oracles, gamma=3)] == plain
    with pytest.raises(UserError, match="verifies chains only"):
        generate(model, prompts[0], 4, drafter=OracleDrafter([3] * 4, 12, VOCAB, 1.0), tree=[(0,), (1,)])


@pytest.mark.parametrize("model_type", fast_tier(["deepseek_v4", "qwen4_exp"], lambda name: name == "deepseek_v4"))
def test_compressed_attention_is_put_back_after_every_rejected_draft(model_type):
    """DeepSeek-V4's compressed attention pools several positions into one entry (and its window layers keep
    only their window), so no entry can be cut back to a position: the loop keeps the cache's state before
    each verify forward, puts it back after a rejection and feeds the accepted tokens again. Speculative
    decoding far past the window and many pooled entries equals plain decoding, prompt by prompt and in a
    batch (decoded a row at a time), with drafts accepted and rejected; a tree is refused in one line.
    Qwen4-Exp's states are put back so too (linear attention, and its n-gram embeddings' token history and
    convolution), while its block-sparse attention's keys and indexer keys are cut, far past its budget."""
    model = tiny(model_type)
    assert not keeps_each_position(model)
    assert_chains_lossless_far_past_the_window_and_trees_refused(model, fed_again=True)


@pytest.mark.parametrize("model_type", fast_tier(list(LINEAR_FAMILIES), "qwen3_next".__eq__))
def test_linear_attention_keeps_each_positions_state_and_feeds_no_accepted_token_again(model_type, caplog):
    """Gated DeltaNet (Qwen3-Next, Qwen3.5, GLM-5-Next, Bailing), Kimi Delta Attention and Mamba-2 (Granite-4.0-H,
    Bamba, Falcon-H1): transformers keeps each layer's state at every position of a verify forward, proven on the
    model, and the loop drops the rejected positions' states as an engine does: no accepted token is fed again,
    every verify forward is the root and the draft, and chains far past the window equal plain decoding; the log says
    which way the eval's speeds were measured."""
    model = tiny(model_type)
    with caplog.at_level(logging.INFO, logger="draftsmith.eval"):
        assert keeps_each_position(model)
    assert "the target's linear-attention states: kept at each verify position" in caplog.text
    assert_chains_lossless_far_past_the_window_and_trees_refused(model, fed_again=False)


@pytest.mark.slow  # the copy's path runs in the fast tier on DeepSeek-V4 (above)
def test_linear_attention_whose_code_keeps_the_last_state_alone_is_put_back_from_a_copy(monkeypatch, caplog):
    """A family whose transformers code ignores the cache's request for every position's state (it keeps the last one
    alone, as the code of a family written before transformers 5.25 does) fails the proof on its model, so the loop
    puts its states back from a copy and feeds the accepted tokens again: still plain greedy's tokens."""
    from transformers.cache_utils import DynamicCache

    monkeypatch.setattr(DynamicCache, "get_recurrent_states_to_keep", lambda self, layer_idx=None: 0)
    model = tiny("qwen3_next")
    with caplog.at_level(logging.INFO, logger="draftsmith.eval"):
        assert not keeps_each_position(model)
    assert "linear-attention states: put back from a copy after a rejected draft" in caplog.text
    assert_chains_lossless_far_past_the_window_and_trees_refused(model, fed_again=True)


def test_a_pooled_cache_written_in_place_is_not_put_back_silently():
    """The compressed layers' state is kept by reference (they rebind their tensors); a write in place, which a
    later transformers could make, would change the kept state too: torch's version counters catch it."""
    from draftsmith.caches import RecurrentCheckpoint, new_cache

    model = tiny("deepseek_v4")
    cache = new_cache(model)
    model(torch.tensor([random_prompt(20, 0)]), cache=cache, use_cache=True)
    checkpoint = RecurrentCheckpoint(cache)
    assert checkpoint
    model(torch.tensor([random_prompt(3, 1)]), cache=cache, use_cache=True)
    checkpoint.restore()  # rebound only: put back
    assert cache.get_seq_length() == 20
    checkpoint = RecurrentCheckpoint(cache)
    cache.layers[0].keys.add_(1.0)
    with pytest.raises(RuntimeError, match="wrote a kept tensor in place"):
        checkpoint.restore()


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]], ids=["chain", "tree"])
@pytest.mark.parametrize(
    "model_type, layers",
    fast_tier([("deepseek_v32", 2), ("hy_v4", 3), ("dots3_note", 2)], lambda case: case[0] == "deepseek_v32"),
)
def test_sparse_attention_rolls_its_indexer_keys_back_past_the_selection(model_type, layers, tree):
    """DeepSeek-V3.2: each query attends to the `index_topk` keys its indexer scores highest, from the
    indexer keys the cache keeps beside the attention's; the loop cuts, moves and gathers those with the
    keys, so speculative decoding far past index_topk equals plain decoding, prompt by prompt and in a
    batch whose rows accept differently. HY-V4 too, whose third layer reuses the second's selection (a shared
    indexer) and whose layers pass hyper-connection streams; and Dots3-Note, whose second layer is a sliding-window
    one sized apart (a mask per kind: its indexed layers take the full-attention one)."""
    config = build_config(
        model_type, VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0},
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, head_dim=16, index_topk=8,
    )  # fmt: skip
    model = build_model(config, std=0.2).requires_grad_(False)
    prompts = [random_prompt(length, seed) for seed, length in enumerate((12, 5, 20))]
    plain = [generate(model, prompt, 24).tokens for prompt in prompts]
    assert len(prompts[2]) + 24 > 5 * config.index_topk  # the selection leaves most keys out
    oracles = [
        OracleDrafter(tokens, len(prompt), VOCAB, hit_rate=rate, seed=i)
        for i, (tokens, prompt, rate) in enumerate(zip(plain, prompts, (0.9, 0.5, 0.7)))
    ]
    alone = [generate(model, p, 24, drafter=o, gamma=3, tree=tree) for p, o in zip(prompts, oracles)]
    assert [row.tokens for row in alone] == plain
    counts = [row.counts for row in alone]
    assert sum(c.accepted for c in counts) > 0 and any(c.accepted < c.drafted for c in counts)  # both outcomes
    oracles = [OracleDrafter(t, len(p), VOCAB, hit_rate=r, seed=9) for t, p, r in zip(plain, prompts, (0.9, 0.2, 0.6))]
    together = generate_batch(model, prompts, 24, oracles, gamma=3, tree=tree)
    assert [row.tokens for row in together] == plain


@pytest.mark.parametrize(
    "model_type, kinds", [("minimax_m3_vl", [BLOCK_INDEXED, FULL]), ("inkling_text", ["hybrid_sliding", "hybrid"])]
)
def test_block_sparse_and_convolved_attention_are_cut_back_and_verify_chains_one_row_at_a_time(model_type, kinds):
    """MiniMax-M3: a sparse layer's indexer picks, per query, 2 blocks of 4 keys (the one the query is in among
    them) from the indexer keys the cache keeps beside the attention's, blocks counted from the cache's first slot:
    the loop cuts those keys back with the attention's. Inkling: short convolutions over the last tokens before
    each attention (a window state, put back after a rejected draft, the accepted tokens fed again) and keys cut
    back. Speculative chains far past the selection and the window equal plain decoding, drafts accepted and rejected,
    prompt by prompt and in a batch (decoded a row at a time: left padding would move the blocks, and pass through the
    convolutions); a tree (its nodes off their positions' slots, or read in order) is refused in one line."""
    model = tiny(model_type)
    assert layer_types(model.config) == kinds and getattr(model.config, "index_topk_blocks", 2) == 2
    assert not keeps_each_position(model)  # Inkling's layers hold four states each; MiniMax-M3 holds none
    assert_chains_lossless_far_past_the_window_and_trees_refused(model, fed_again=model_type == "inkling_text")


def test_default_taps_of_a_hybrid_linear_attention_target_are_attention_layers():
    """Qwen3-Next: three linear-attention layers to each full-attention one; EAGLE-3's and DFlash's
    default taps move to full-attention layers (below the last), every layer's kind from the config."""
    config = build_config("qwen3_next", VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=16, head_dim=16)
    assert [i for i, kind in enumerate(layer_types(config)) if kind == "full_attention"] == [3, 7, 11, 15]
    model = build_model(config).requires_grad_(False)
    eagle3 = drafter_class("eagle3")
    drafter = eagle3.from_target(eagle3.Config(draft_vocab_size=VOCAB), model, "qwen3_next")
    assert drafter.config.aux_layers == [3, 7, 11]  # EAGLE-3's [1, 7, 12], each moved to a full-attention layer
    dflash = drafter_class("dflash")
    assert dflash.from_target(dflash.Config(num_layers=2), model, "qwen3_next").config.target_layers == [3, 11]


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type, kinds",
    [
        ("minimax_m3_vl", {"minimax_m3_sparse", FULL}),
        ("dots3_note", {"indexed_attention", SLIDING}),
        ("inkling_mm_model", {"hybrid", "hybrid_sliding"}),
        ("inkling2", {"hybrid", "hybrid_sliding"}),
    ],
)
def test_random_target_writes_every_layer_kind_of_a_family_at_sizes_its_class_accepts(model_type, kinds, tmp_path):
    """The command writes each family with every layer kind a release has and loads as a target: MiniMax-M3's sparse
    layers (a kind only its code has; a release's config turns it on), Dots3-Note's sliding layers sized apart (their
    latent head the sum of its parts, which the class checks: it was an internal error), Inkling's full-attention
    layers (one in six, past the tiny depth) and Inkling-2's lm_head rows unpadded (a negative padding was an
    internal error)."""
    from draftsmith.target import load_target

    with pytest.raises(SystemExit) as done:
        random_target_command([model_type, str(tmp_path / "target")])
    assert done.value.code == 0
    config = json.loads((tmp_path / "target" / "config.json").read_text())
    assert set(config.get("text_config", config)["layer_types"]) == kinds
    target = load_target(str(tmp_path / "target"))
    ids = torch.tensor([random_prompt(20, 0)])
    assert torch.isfinite(run_target(target, ids).logits).all()


def test_a_tiny_config_its_class_refuses_is_one_line():
    """A family's config class checks its sizes (Dots3-Note: each layer kind's overrides alike): sizes it refuses are
    a one-line refusal naming the class, not an internal error."""
    overrides = {2: {"head_dim": 7, "qk_nope_head_dim": 2}}  # layer 3, sliding too, left as the others
    with pytest.raises(UserError, match=r"^transformers' Dots3NoteTextConfig refuses the tiny dots3_note target: "):
        build_config("dots3_note", VOCAB, per_layer_config=overrides)


def test_random_target_command_writes_a_target_or_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        random_target_command(["qwen3", str(tmp_path / "qwen3"), "--seed-from-demo"])
    assert done.value.code == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "qwen3").iterdir()}
    capsys.readouterr()
    # recipe=mtp's target: the first MTP layer in the release's layout, by its own command (the refusal without it
    # names it)
    from draftsmith.heads.mtp import check_target_folder

    with pytest.raises(SystemExit) as done:
        random_target_command(["glm4_moe", str(tmp_path / "glm4_moe"), "--seed-from-demo"])
    # its head size, which transformers 5.25's class derives and no longer has a field for, is in its config.json as in
    # a release's: vLLM 0.32's model of it reads the key (its export check stopped at start without it)
    assert json.loads((tmp_path / "glm4_moe" / "config.json").read_text())["head_dim"] == 64
    with pytest.raises(UserError, match=r"from python -m draftsmith.heads.mtp_random_layer DIRECTORY\)$"):
        check_target_folder(str(tmp_path / "glm4_moe"))
    added = run_entry_in_process(["-m", "draftsmith.heads.mtp_random_layer", str(tmp_path / "glm4_moe")], capsys)
    assert added.returncode == 0 and added.stdout.strip() == str(tmp_path / "glm4_moe"), added.stderr[-2000:]
    check_target_folder(str(tmp_path / "glm4_moe"))
    bad_seed = ["-m", "draftsmith.heads.mtp_random_layer", str(tmp_path / "glm4_moe"), "--seed", "abc"]
    refused = run_entry_in_process(bad_seed, capsys)  # argparse's usage block came first, as random_target's did
    assert assert_one_line_error(refused, 2).startswith("error: argument --seed: invalid int value: 'abc' (python -m")
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        random_target_command(["no_such_family", str(tmp_path / "x")])
    refused = subprocess.CompletedProcess([], done.value.code, "", capsys.readouterr().err)
    assert assert_one_line_error(refused, 2).startswith("error: transformers has no model type 'no_such_family'")
    with pytest.raises(SystemExit) as done:  # `"$OUT"` with OUT unset was the current folder (exit 70 in an empty one)
        random_target_command(["llama", ""])
    refused = subprocess.CompletedProcess([], done.value.code, "", capsys.readouterr().err)
    assert assert_one_line_error(refused, 2) == "error: DIRECTORY is empty: give the folder to write the target to"
    with pytest.raises(SystemExit) as done:  # argparse's refusal came after its 7-line usage block
        random_target_command(["llama", str(tmp_path / "x"), "--seed", "abc"])
    refused = subprocess.CompletedProcess([], done.value.code, "", capsys.readouterr().err)
    assert assert_one_line_error(refused, 2).startswith("error: argument --seed: invalid int value: 'abc' (python -m")
    assert not (tmp_path / "x").exists()
    # families whose own code fails at a tiny shape were internal errors (exit 70): one line each, nothing written
    for family, said in [
        ("dbrx", "cannot build a tiny dbrx target: AttributeError: 'DbrxAttentionConfig' object"),
        ("falcon", "transformers' FalconConfig refuses the tiny falcon target: property 'head_dim'"),
    ]:
        with pytest.raises(SystemExit) as done:
            random_target_command([family, str(tmp_path / family)])
        refused = subprocess.CompletedProcess([], done.value.code, "", capsys.readouterr().err)
        assert_one_line_error(refused, 2, said)
        assert not (tmp_path / family).exists() and not (tmp_path / f"{family}.tmp").exists()


@pytest.mark.slow
def test_a_seeded_target_trained_on_the_demo_conversations_predicts_them_better(tmp_path):
    """`--train-steps N` trains the seeded target (every weight: DeepSeek-V3's latent attention and experts have no
    demo tensors) on the demo's conversations before it is written: its next-token loss on them falls below the seeded
    target's; seeded alone, such a target repeats one token (random_target's docstring; the matrix's rows record
    `target_variety`). Two steps suffice: the 4 rows' summed loss falls by 3.3 (35.5 to 32.2; by 6.2 after 4 steps,
    which cost 4.6 s more)."""
    from transformers import AutoTokenizer

    from draftsmith.random_target import DEMO_CONVERSATIONS
    from draftsmith.resources import bundled
    from draftsmith.target import load_target

    losses = {}
    for steps in ("0", "2"):
        with pytest.raises(SystemExit) as done:
            random_target_command(["deepseek_v3", str(tmp_path / steps), "--seed-from-demo", "--train-steps", steps])
        assert done.value.code == 0
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / steps)
        with gzip.open(bundled(DEMO_CONVERSATIONS), "rt") as lines:
            first = [json.loads(next(lines))["messages"] for _ in range(4)]
        ids = [tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)[:128] for messages in first]
        target = load_target(str(tmp_path / steps))
        with torch.no_grad():
            losses[steps] = [float(target(torch.tensor([row]), labels=torch.tensor([row])).loss) for row in ids]
    assert sum(losses["2"]) < sum(losses["0"]) - 0.5, losses


def test_the_command_writes_a_wrappers_release_whole_when_asked(tmp_path, capsys):
    """`--released`: a vision-language wrapper's model type written as its releases ship it (the wrapper's
    architecture, its language model under the release's names), which loads as the same causal LM as without."""
    from draftsmith.model_files import tensor_names
    from draftsmith.target import load_target

    for flags in ([], ["--released"]):
        with pytest.raises(SystemExit) as done:
            random_target_command(["qwen3_vl", str(tmp_path / (flags[0][2:] if flags else "text")), *flags])
        assert done.value.code == 0
    released = json.loads((tmp_path / "released" / "config.json").read_text())
    assert released["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert "model.language_model.norm.weight" in tensor_names(tmp_path / "released")
    whole, text = load_target(str(tmp_path / "released")), load_target(str(tmp_path / "text"))
    assert whole.state_dict().keys() == text.state_dict().keys()


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl"])
def test_a_family_splitting_its_rotary_frequencies_by_section_is_written_to_run_at_the_tiny_head(tmp_path, model_type):
    """Qwen2-VL's code splits each head's rotary frequencies into its multimodal sections, by default the release's
    [16, 24, 24] (of a 128-wide head): at the tiny head they are scaled to it, or the target fails its first forward
    and does not load."""
    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target

    folder = write_random_target(model_type, tmp_path / "target")
    text = json.loads((folder / "config.json").read_text())["text_config"]
    assert (
        text["rope_parameters"]["mrope_section"] == [8, 12, 12]
        and text["hidden_size"] // text["num_attention_heads"] == 64
    )
    assert text["head_dim"] == 64  # no field of the class, which computes hidden_size / heads: written as a release's
    ids = torch.tensor([[1, 5, 9, 13]])
    assert load_target(str(folder))(ids).logits.shape == (1, 4, 4096)


@pytest.mark.slow
def test_a_wrapper_without_a_causal_lm_class_is_written_loaded_and_sharded_as_its_language_model(tmp_path, capsys):
    """GLM-5-Next (`glm5_next`) is a vision-language wrapper that transformers 5.24 has no causal LM class for, nor
    for its language model (`glm5_next_text`, whose sparse layers attend without positions: the tiny config keeps the
    class's NoPE 0). The command writes the wrapper (a tiny vision tower beside it); the recipe check lets it through;
    the target loads as the wrapper's language model and lm_head, whose logits and taps are the wrapper's, whole and
    sharded, and whose config names the wrapper's architecture (what an engine serves from the folder). The language
    model's type alone is still refused in one line."""
    from transformers import AutoModelForImageTextToText

    from draftsmith.causal_lm import not_a_causal_lm
    from draftsmith.target import load_target, loaded_config, local_target_config, local_target_shape

    config = build_config("glm5_next", VOCAB, hidden_size=64, num_hidden_layers=2, head_dim=16)
    assert (config.qk_rope_head_dim, config.qk_nope_head_dim) == (0, 16)
    assert (config.linear_head_dim, config.linear_num_heads) == (16, 4)  # at the tiny shape, not the release's
    folder = tmp_path / "glm5_next"
    with pytest.raises(SystemExit) as done:
        random_target_command(["glm5_next", str(folder)])
    assert done.value.code == 0
    assert not_a_causal_lm(local_target_config(str(folder)), str(folder)) is None
    assert local_target_shape(str(folder)).model_type == "glm5_next_text"
    wrapper = AutoModelForImageTextToText.from_pretrained(folder).eval()
    ids = torch.tensor([random_prompt(20, 3)])
    expected = wrapper(input_ids=ids, output_hidden_states=True)
    request = FeatureRequest(layers=(0, 2))
    for shard in ("none", "fsdp"):
        target = load_target(str(folder), shard=shard)
        assert loaded_config(target)["architectures"] == ["Glm5NextForConditionalGeneration"]
        assert target.config.num_hidden_layers == 4 and layer_types(target.config)[-1] == "indexed_attention"
        out = run_target(target, ids, request=request)
        torch.testing.assert_close(out.logits, expected.logits)
        torch.testing.assert_close(out.layers[2], one_state(expected.hidden_states[3]))
    with pytest.raises(SystemExit) as done:
        random_target_command(["glm5_next_text", str(tmp_path / "x")])
    refused = subprocess.CompletedProcess([], done.value.code, "", capsys.readouterr().err)
    line = assert_one_line_error(refused, 2, "has no causal LM class (AutoModelForCausalLM, what draftsmith loads")
    assert line.endswith("for model_type 'glm5_next_text': a target of it cannot be built"), line
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.tmp").exists()


def test_a_wrapper_transformers_loads_as_a_causal_lm_is_the_target_in_its_release_layout(tmp_path):
    """Qwen4-Exp ships as a vision-language wrapper (`qwen4_exp`, `Qwen4ExpForConditionalGeneration`, its language
    model under `model.language_model.*`), which transformers maps to its causal LM class: the release's folder loads
    as that class, with the wrapper's own logits and its taps the mean of the streams laid side by side."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from draftsmith.target import load_target
    from draftsmith.tiny_wrapper import TINY_VISION

    text = build_config("qwen4_exp", VOCAB, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, hidden_size=64,
                        intermediate_size=128, num_hidden_layers=4, head_dim=16)  # fmt: skip
    vision = {**TINY_VISION, "out_hidden_size": text.hidden_size}
    config = AutoConfig.for_model("qwen4_exp", text_config=text.to_dict(), vision_config=vision)
    torch.manual_seed(0)
    release = AutoModelForImageTextToText.from_config(config)
    for parameter in release.parameters():  # random weights of draftsmith.random_target's spread: decisive logits
        if parameter.dim() >= 2:
            parameter.data.normal_(0.0, 0.2)
    release.save_pretrained(tmp_path / "release")
    wrapper = AutoModelForImageTextToText.from_pretrained(tmp_path / "release").eval()
    assert wrapper.config.architectures == ["Qwen4ExpForConditionalGeneration"]
    ids = torch.tensor([random_prompt(20, 3)])
    expected = wrapper(input_ids=ids, output_hidden_states=True)
    target = load_target(str(tmp_path / "release"))
    out = run_target(target, ids, request=FeatureRequest(layers=(0, 2)))
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.layers[2], one_state(expected.hidden_states[3], text.hidden_size))


def vllm_mixed_streams(block_output: torch.Tensor, residual: torch.Tensor, hc, config) -> torch.Tensor:
    """A block's output mixed into the residual streams [..., hc_mult, H], written from vLLM 0.32's own torch kernels
    (vllm/model_executor/kernels/mhc/torch.py: mhc_pre_torch's post and comb weights, then mhc_post_torch), with
    the weights of `hc`, a layer's hyper-connection."""
    n, eps = config.hc_mult, config.hc_eps
    flat = residual.flatten(-2).float()
    mixes = (flat @ hc.fn.t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + config.rms_norm_eps)
    post = torch.sigmoid(mixes[..., n : 2 * n] * hc.scale[1] + hc.base[n : 2 * n]) * 2.0  # vLLM's hc_post_alpha
    comb = mixes[..., 2 * n :].unflatten(-1, (n, n)) * hc.scale[2] + hc.base[2 * n :].view(n, n)
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(config.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    mixed = torch.einsum("...ij,...ih->...jh", comb, residual.float())
    return (mixed + post.unsqueeze(-1) * block_output.unsqueeze(-2).float()).to(residual.dtype)


def test_a_multi_stream_targets_taps_are_vllms_mean_of_each_layers_mixed_streams():
    """DeepSeek-V4's hyper-connections pass hc_mult residual streams between decoder layers. vLLM's EAGLE-3 and
    DFlash taps are a layer's streams after its last mixing, averaged over the streams
    (vllm/models/deepseek_v4/cpu/model.py: `aux_recon.mean(dim=1)`): draftsmith's tap of layer i is that, computed
    here from the streams and the expert block's output that transformers' layer i mixes; the embeddings' tap is
    the embeddings (every stream starts as them); the final state is the lm_head's input, as for any family."""
    model = tiny("deepseek_v4")
    seen, hooks = {}, []
    for i, layer in enumerate(model.model.layers):  # the streams its expert block's output is mixed into, and that
        hooks.append(layer.ffn_hc.register_forward_pre_hook(lambda _, args, i=i: seen.update({(i, "in"): args[0]})))
        hooks.append(layer.mlp.register_forward_hook(lambda _, args, out, i=i: seen.update({(i, "block"): out})))
    ids = torch.tensor([random_prompt(20, 0)])
    try:
        out = run_target(model, ids, request=FeatureRequest(layers=(-1, 0, 1)))
    finally:
        for hook in hooks:
            hook.remove()
    torch.testing.assert_close(out.layers[-1], model.model.embed_tokens(ids))
    for i in (0, 1):
        streams = vllm_mixed_streams(seen[i, "block"], seen[i, "in"], model.model.layers[i].ffn_hc, model.config)
        assert streams.shape == (1, 20, model.config.hc_mult, model.config.hidden_size)
        torch.testing.assert_close(out.layers[i], streams.mean(dim=-2))
    torch.testing.assert_close(out.logits, model(ids).logits)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["eagle3", "dflash"])
def test_drafters_that_tap_a_multi_stream_target_train_and_decode_losslessly(recipe, tmp_path, small_data, token_cache):
    """`train.py` on a tiny DeepSeek-V4 (its config.json: hc_mult streams): a drafter that taps its layers trains,
    and its eval decodes the target's own tokens (chains, prompts one at a time: compressed attention)."""
    from draftsmith.eval.target_checks import STATES_FED_AGAIN
    from draftsmith.random_target import write_random_target

    target = write_random_target("deepseek_v4", tmp_path / "target", hidden_size=64, intermediate_size=128)
    report = trains_and_decodes_its_target_losslessly(recipe, target, tmp_path, small_data, token_cache)
    # compressed attention's pooled entries: no per-position states
    assert report["target"]["rollback"] == STATES_FED_AGAIN


def test_a_linear_attention_target_refuses_an_eval_it_cannot_run_before_training(
    tmp_path, small_data, token_cache, capsys
):
    """Qwen3-Next trains and decodes chains; the eval stage's tree and batch settings are refused in one
    line when the run starts (the target's config read), not after the training."""
    from draftsmith.random_target import write_random_target

    write_random_target("qwen3_next", tmp_path / "target")
    refusals = {("eval.tree=16",): "set eval.tree=0", ("eval.tree=0", "eval.batch_size=4"): "set eval.batch_size=1"}
    for settings, fragment in refusals.items():
        key = settings[-1].split("=")[0]
        out = tmp_path / key
        args = train_args(out, small_data, token_cache, f"target.name_or_path={tmp_path / 'target'}")
        done = run_entry_in_process(["train.py", *args, "eval.enabled=true", *settings], capsys)
        assert assert_one_line_error(done, 2, fragment).startswith(f"error: {key}")
        assert not (out / "final").exists() and not list(out.glob("checkpoint-*"))


def test_no_target_family_is_named_in_product_code():
    """Adding a target family costs nothing: product code names a family (a transformers model type or
    its causal-LM class) only as a family draft layers are built from (draftsmith.families'
    DRAFT_LAYER_FAMILIES), in the table of targets vLLM cannot capture features from
    (formats/repo.py's VLLM_NO_STATE_CAPTURE), of the architectures whose vLLM module imports torchvision
    (formats/versions.py's VLLM_IMPORTS_TORCHVISION), of those whose vLLM language model has no `.model`
    (VLLM_BARE_LANGUAGE_MODEL), of those it builds with its Transformers backend and what it reads of them otherwise
    (formats/vllm_backend.py's VLLM_TRANSFORMERS_BACKEND, VLLM_BACKEND_EMBEDDING_ELSEWHERE, VLLM_BACKEND_REPEATED_KV) or
    in the tables of how vLLM serves each architecture's own
    MTP layer (heads/mtp_layouts.py's LAYOUTS and UNSERVED: the checkpoint layout no config field names, the family
    a layout's block is built from where vLLM builds another's, and SEPARATE_MODEL: an architecture whose MTP is a
    model of its own; formats/mtp_sglang.py's SGLANG_MODELS, SGLang's model of each, and formats/mtp_sglang_reads.py's
    NEMOTRON_H_KINDS, the layer kinds its Nemotron-H config accepts, and DOTS3_RELEASE_MODEL_TYPE, the one model type
    its Dots3 config reads), or as the targets whose cache Gemma-4's assistant reads and each
    one's assistant model type
    (heads/gemma4_assistant_config.py's ASSISTANTS) and the classes vLLM must run such a target as
    (formats/gemma4_assistant.py's NATIVE_CLASSES), or in the table of the fields a text-only release sets that no
    transformers field tells (draftsmith/text_release.py's RELEASE_CONSTANTS) and of the model types whose releases
    name another architecture (RELEASE_FORMS) or build weights transformers' default leaves out (RELEASE_WEIGHTS), or
    in the table of the model types
    vLLM serves one key more than their sliding window (draftsmith/vllm_window.py's VLLM_ONE_MORE_KEY), never in a
    branch of its own."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from draftsmith.families import DRAFT_LAYER_FAMILIES
    from draftsmith.formats.gemma4_assistant import NATIVE_CLASSES, SGLANG_TARGETS
    from draftsmith.formats.mtp_sglang import SGLANG_MODELS
    from draftsmith.formats.mtp_sglang_reads import DOTS3_RELEASE_MODEL_TYPE, NEMOTRON_H_KINDS
    from draftsmith.formats.repo import VLLM_NO_STATE_CAPTURE
    from draftsmith.formats.versions import VLLM_BARE_LANGUAGE_MODEL, VLLM_IMPORTS_TORCHVISION
    from draftsmith.formats.vllm_backend import (
        VLLM_BACKEND_EMBEDDING_ELSEWHERE,
        VLLM_BACKEND_REPEATED_KV,
        VLLM_TRANSFORMERS_BACKEND,
    )
    from draftsmith.heads.gemma4_assistant_config import ASSISTANTS, AssistantConfig
    from draftsmith.heads.mtp_layouts import LAYOUTS, SEPARATE_MODEL, UNSERVED
    from draftsmith.text_release import RELEASE_CONSTANTS, RELEASE_FORMS, RELEASE_WEIGHTS
    from draftsmith.vllm_window import VLLM_ONE_MORE_KEY

    tables = {
        "draftsmith/text_release.py": {*RELEASE_CONSTANTS, *RELEASE_FORMS, *RELEASE_WEIGHTS},
        "draftsmith/vllm_window.py": set(VLLM_ONE_MORE_KEY),
        "heads/gemma4_assistant.py": {AssistantConfig.type},  # the kind's name, the assistant's model type
        "heads/gemma4_assistant_config.py": {*ASSISTANTS, *ASSISTANTS.values()},
        "formats/repo.py": set(VLLM_NO_STATE_CAPTURE),
        "formats/mtp_sglang.py": set(SGLANG_MODELS),
        "formats/mtp_sglang_reads.py": {*NEMOTRON_H_KINDS, DOTS3_RELEASE_MODEL_TYPE},
        "formats/gemma4_assistant.py": {*NATIVE_CLASSES, *NATIVE_CLASSES.values(), *SGLANG_TARGETS},
        "formats/versions.py": {*VLLM_IMPORTS_TORCHVISION, *VLLM_BARE_LANGUAGE_MODEL},
        "formats/vllm_backend.py": {
            *VLLM_TRANSFORMERS_BACKEND,
            *VLLM_BACKEND_EMBEDDING_ELSEWHERE,
            *VLLM_BACKEND_REPEATED_KV,
        },
        "heads/mtp_layouts.py": {
            *LAYOUTS,
            *UNSERVED,
            *SEPARATE_MODEL,
            *(layout.block_family for layout in LAYOUTS.values()),
        },
    }

    families = set(CONFIG_MAPPING_NAMES) | set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    draft_layers = {*DRAFT_LAYER_FAMILIES, *(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[f] for f in DRAFT_LAYER_FAMILIES)}
    found = [
        f"{name}:{line}: {value!r}"
        for name, line, value in product_strings(families)
        if value not in draft_layers and value not in tables.get(name, ())
    ]
    assert not found, "target families named in product code: " + "; ".join(found)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "glm4_moe"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_draft_layers_of_a_partial_rotary_target_rotate_every_dimension_in_transformers_and_as_engines_read_them(
    model_type, family
):
    """A target whose RoPE rotates part of each head (Qwen3.5: a quarter, GLM-4.5: half) gives its draft
    layers no `partial_rotary_factor`: transformers' Llama and Qwen3 rotary embeddings ignore it and rotate
    every dimension, while vLLM's get_rope reads it from rope_parameters and would rotate a part (the draft
    trained on one position encoding, served with another); the export leaves it out of an older drafter's."""
    from draftsmith.families import layer_family
    from draftsmith.heads.eagle_base import import_qualified
    from draftsmith.tiny_config import build_config

    target = build_config(model_type, 512, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0})
    assert target.rope_parameters["partial_rotary_factor"] < 1
    layers = layer_family(family)
    values = layers.config(target, 1)
    rotary = import_qualified(layers.rotary)(import_qualified(layers.config_class).from_dict(values))
    head_dim = values["head_dim"]
    assert 2 * rotary.inv_freq.numel() == head_dim  # transformers: every dimension
    engine_factor = values["rope_parameters"].get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    assert engine_factor == 1.0  # vLLM: rotary_dim = head_dim x partial_rotary_factor
    # a drafter trained before the factor was left out still names it in its config: its export does not
    from types import SimpleNamespace

    from draftsmith.formats.repo import draft_layer_config

    named = {**values, "rope_parameters": {**values["rope_parameters"], "partial_rotary_factor": 0.25}}
    older = SimpleNamespace(config=SimpleNamespace(decoder={"config": named}))
    exported = draft_layer_config(older, ("llama", "qwen3"), "vLLM", "EAGLE-3")["rope_parameters"]
    assert exported == values["rope_parameters"]
