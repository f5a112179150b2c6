"""Batched speculative decoding (eval.batch_size > 1): every row of a batch, whatever its prompt
length, acceptance or stopping point, produces exactly what it produces decoded alone: greedy for
every drafter kind (chain and tree), sampled row by row with the same seeds, and the sampled output
still follows the target's distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.eval.loop import generate, generate_batch, prefill, propose, verify_step
from draftsmith.eval.ngram import NGramDrafter
from draftsmith.eval.sampling import Sampling
from draftsmith.heads import drafter_class
from tests.helpers import (
    DFLASH_TINY,
    NEW,
    SAMPLES,
    TREE,
    VOCAB,
    WIDE_TREE,
    NearTargetDrafter,
    OracleDrafter,
    exact_conditionals,
    exact_joint,
    exactness_pvalues,
    fast_tier,
    fitted_eagle,
    perturbed_draft,
    perturbed_medusa,
    tiny_llama,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW_TOKENS = 40
KINDS = ["medusa", "medusa2", "eagle", "eagle3", "draft_model", "dflash", "ngram"]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 96, (length,), generator=generator).tolist() for length in (5, 13, 8, 21, 3)]


def build(kind: str, model):
    """A drafter of `kind` for the tiny target, fitted or initialised so that it is right sometimes:
    (factory of fresh proposers, tree request or None, the model that verifies)."""
    if kind == "medusa":
        drafter = perturbed_medusa(model)
    elif kind == "medusa2":
        verifier_base = tiny_llama(seed=7)  # Medusa-2 puts adapters into its target: a copy of its own
        cls = drafter_class("medusa2")
        drafter = cls.from_target(cls.Config(num_heads=3), verifier_base, "tiny").eval()
    elif kind in ("eagle", "eagle3", "dflash"):
        # one TTT step: the rows' decoding is under test, not the fit (a sixth of the time of the default 7)
        eagle3 = {"aux_layers": [0, 1], "draft_vocab_size": 48, "ttt_steps": 1}
        config = {"eagle": {}, "eagle3": eagle3, "dflash": DFLASH_TINY}[kind]
        drafter = fitted_eagle(model, steps=40, drafter_type=kind, **config).eval()
    elif kind == "draft_model":
        cls = drafter_class("draft_model")
        drafter = cls.from_target(cls.Config(num_layers=1), model, "tiny").eval()
    else:
        return (lambda: NGramDrafter(3)), None, model
    first = drafter.proposer()
    tree = None if kind == "draft_model" else first.default_tree(10)  # the draft model drafts chains only
    return drafter.proposer, tree, first.verifier or model


FAST_KINDS = ("medusa", "eagle3", "ngram")  # parallel heads, a feature chain, no model: the others in the slow tier


@pytest.mark.parametrize("kind", fast_tier(KINDS, lambda kind: kind in FAST_KINDS))
def test_greedy_rows_equal_each_prompt_decoded_alone(model, prompts, kind):
    new_proposer, tree, verifier = build(kind, model)
    alone = [generate(verifier, prompt, NEW_TOKENS).tokens for prompt in prompts]
    for shape in ("chain", "tree") if tree is not None else ("chain",):
        request = tree if shape == "tree" else None
        rows = generate_batch(verifier, prompts, NEW_TOKENS, [new_proposer() for _ in prompts], gamma=3, tree=request)
        for number, (row, expected) in enumerate(zip(rows, alone)):
            assert row.tokens == expected, f"{kind} {shape}: row {number} differs from its prompt decoded alone"
        accepted = [row.counts.accepted for row in rows]
        drafted = sum(row.counts.drafted for row in rows)
        assert 0 < sum(accepted) < drafted, f"{kind} {shape}: no acceptance or no rejection ({accepted} of {drafted})"
        if kind != "ngram":
            assert len(set(accepted)) > 1, f"{kind} {shape}: every row accepted the same, the rows never drifted apart"


@pytest.mark.parametrize("tree", [None, WIDE_TREE], ids=["chain", "tree"])
def test_rows_stop_at_their_own_eos_and_budget(model, prompts, tree):
    """Rows leave the batch at different cycles (EOS, budget); the others go on unchanged."""
    plain = [generate(model, prompt, NEW_TOKENS).tokens for prompt in prompts]
    eos = plain[1][6]  # one row stops early at this token; others stop where it appears, or at the budget
    alone = [generate(model, prompt, NEW_TOKENS, eos_ids=frozenset({eos})).tokens for prompt in prompts]
    assert len({len(tokens) for tokens in alone}) > 1
    oracles = [
        OracleDrafter(tokens, len(prompt), 96, hit_rate=rate, seed=i)
        for i, (tokens, prompt, rate) in enumerate(zip(plain, prompts, (0.9, 0.5, 0.2, 0.7, 1.0)))
    ]
    rows = generate_batch(model, prompts, NEW_TOKENS, oracles, gamma=3, tree=tree, eos_ids=frozenset({eos}))
    assert [row.tokens for row in rows] == alone


def test_batch_cache_after_many_cycles_equals_each_row_prefilled_alone(model, prompts):
    """The right-aligned cache entries of every row (keys carry their rotary positions) and its last
    hidden state equal a fresh prefill of that row's committed tokens alone."""
    plain = [generate(model, prompt, 60).tokens for prompt in prompts]
    oracles = [
        OracleDrafter(tokens, len(prompt), 96, hit_rate=rate, seed=i)
        for i, (tokens, prompt, rate) in enumerate(zip(plain, prompts, (0.9, 0.5, 0.2, 0.7, 1.0)))
    ]
    state = prefill(model, prompts)
    generators = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    for _ in range(12):
        drafts = [propose(oracle, row, 3, WIDE_TREE, max_depth=3) for oracle, row in zip(oracles, state.rows)]
        verify_step(model, state, drafts, Sampling(), generators)
    assert len({row.cached for row in state.rows}) > 1 and state.width == max(row.cached for row in state.rows)
    for b, row in enumerate(state.rows):
        alone = prefill(model, [row.tokens])
        for mine, theirs in zip(state.cache.layers, alone.cache.layers):
            torch.testing.assert_close(mine.keys[b : b + 1, :, -row.cached :], theirs.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(mine.values[b : b + 1, :, -row.cached :], theirs.values, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(row.final, alone.rows[0].final, atol=1e-5, rtol=1e-4)


def test_plain_batch_charges_the_batch_wall_time_once(model, prompts):
    rows = generate_batch(model, prompts, 6)
    assert all(row.counts.target_forwards == row.counts.new_tokens == 6 for row in rows)
    assert len({row.counts.wall_s for row in rows}) == 1 and rows[0].counts.wall_s > 0
    with pytest.raises(ValueError, match="one proposer of its own"):
        shared = NGramDrafter(3)
        generate_batch(model, prompts[:2], 6, [shared, shared], gamma=3)


def test_a_drafter_that_samples_draws_the_same_for_a_prompt_in_any_batch(model, prompts):
    """The draft model samples its drafts from its own q (DFlash alike): each row's draws are seeded from
    the row's seed (`Proposer.start`), so a prompt samples the same tokens alone and in a batch, with
    proposers reused across batches as the eval reuses them."""
    drafter = perturbed_draft(model, noise=0.3)
    sampling, seeds = Sampling(1.0), [40 + i for i in range(len(prompts))]
    reused = drafter.proposer(1.0)
    alone = [
        generate(model, prompt, 12, reused, gamma=3, sampling=sampling, seed=seed).tokens
        for prompt, seed in zip(prompts, seeds)
    ]
    proposers = [drafter.proposer(1.0) for _ in range(3)]
    rows = [
        *generate_batch(model, prompts[:3], 12, proposers, gamma=3, sampling=sampling, seeds=seeds[:3]),
        *generate_batch(model, prompts[3:], 12, proposers[:2], gamma=3, sampling=sampling, seeds=seeds[3:]),
    ]
    assert [row.tokens for row in rows] == alone
    assert 0 < sum(row.counts.accepted for row in rows) < sum(row.counts.drafted for row in rows)


@pytest.fixture(scope="module")
def small_model():
    return tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=5, logit_scale=8.0)


@pytest.mark.slow  # 3 s a case: test_eval.py's sampling test decodes its draws as a batch's rows in the fast tier
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
def test_sampled_rows_equal_alone_and_follow_the_target(small_model, tree):
    """Rows of two prompts of different lengths, each with its own seed: every row samples exactly the
    tokens it samples alone with that seed, and each prompt's rows follow its exact distribution."""
    sampling = Sampling(1.0) if tree is None else Sampling(0.8, top_k=6)
    prompt_pair = ([1, 5, 2, 7], [3, 1, 4, 1, 5, 6])
    conditionals = [exact_conditionals(small_model, prompt, sampling) for prompt in prompt_pair]
    batch, counts = 16, [torch.zeros(VOCAB, VOCAB, VOCAB) for _ in prompt_pair]
    for first_seed in range(0, SAMPLES, batch // 2):
        seeds = [first_seed + i // 2 for i in range(batch)]
        which = [i % 2 for i in range(batch)]
        proposers = [
            NearTargetDrafter(conditionals[k], len(prompt_pair[k]), stochastic=tree is None, seed=seed)
            for k, seed in zip(which, seeds)
        ]
        rows = generate_batch(
            small_model,
            [prompt_pair[k] for k in which],
            NEW,
            proposers,
            gamma=2,
            tree=tree,
            sampling=sampling,
            seeds=seeds,
        )
        for k, row in zip(which, rows):
            counts[k][tuple(row.tokens)] += 1
        if first_seed == 0:  # row by row, the same tokens as alone
            for k, seed, row in zip(which, seeds, rows):
                alone = NearTargetDrafter(conditionals[k], len(prompt_pair[k]), stochastic=tree is None, seed=seed)
                expected = generate(
                    small_model, prompt_pair[k], NEW, alone, gamma=2, tree=tree, sampling=sampling, seed=seed
                )
                assert row.tokens == expected.tokens
    for k in range(2):
        pvalues = exactness_pvalues(counts[k], exact_joint(conditionals[k]))
        assert min(pvalues.values()) > 1e-3, f"prompt {k}: {pvalues}"
