"""EAGLE-3: the training-time test computes exactly what decoding computes (same positions, tokens,
attention and features at every draft depth), the loss scores each step against the right target
distribution, the draft vocabulary (d2t/t2d) is picked from the data and survives the checkpoint,
speculative decoding stays lossless with its own cache, and the real trainer (online and from
captured shards) lowers the loss while the target stays frozen."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, prefill
from draftsmith.heads import drafter_class
from draftsmith.heads.base import TargetShape, load_drafter, per_sample_stats
from draftsmith.heads.eagle3 import Eagle3Config
from draftsmith.heads.packing import (
    causal_lm_inputs,
    documents,
    draft_attention_mask,
    num_documents,
    positions,
    same_document,
    shifted,
)
from draftsmith.heads.proposer import DynamicTree
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetOutput, run_target
from tests.helpers import (
    TINY_VOCAB,
    assert_cache_rollback,
    assert_greedy_equals_plain,
    assert_one_line_error,
    fast_tier,
    fitted_eagle,
    run_entry_in_process,
    tiny_llama,
    train_args,
    train_in_process,
)

Eagle3 = drafter_class("eagle3")
DRAFT_VOCAB = 24  # of TINY_VOCAB = 32: pruned, so d2t/t2d are in play everywhere below
TINY = {"drafter_type": "eagle3", "aux_layers": [-1, 0, 1], "draft_vocab_size": DRAFT_VOCAB, "ttt_steps": 4}
# 30 steps accept about 30% of greedy drafts, chain and tree, for every variant below, as 60 did, at half the cost:
# drafts both accepted and rejected, as the lossless and rollback checks need (at 15, P-EAGLE's third prompt accepted
# 3 of 105 and the windowed rollback saw one accepted length)
FIT_STEPS = 30

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=TINY_VOCAB, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafter(model):
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    fitted = fitted_eagle(model, steps=FIT_STEPS, **TINY)
    # The target is frozen: no gradient reached it and its weights are unchanged.
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    return fitted


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, TINY_VOCAB, (length,), generator=generator).tolist() for length in (5, 11, 17)]


def chain_logits(drafter, state, depth: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A greedy chain and the draft logits decoding computed for each of its tokens."""
    recorded = []
    original = drafter.draft_logits

    def record(outputs):
        recorded.append(original(outputs))
        return recorded[-1]

    drafter.draft_logits = record
    try:
        chain = drafter.proposer().propose(state, depth)
    finally:
        del drafter.draft_logits
    return chain.tokens, recorded


# -- alignment: training computes what decoding computes --------------------------------------------
@pytest.mark.parametrize("n", [2, 7, 12])
def test_training_time_test_equals_decoding(model, drafter, n):
    """Commit x_0..x_{n-1}, let decoding draft a greedy chain d_1..d_k, and continue the text with
    exactly that chain: then TTT step i at position n-2 (teacher-forced on the data) must give the
    logits decoding gave at depth i+1, for every step. An off-by-one in tokens, features, positions
    or the attention mask of either side breaks the equality."""
    generator = torch.Generator().manual_seed(n)
    prefix = torch.randint(3, TINY_VOCAB, (n,), generator=generator)
    steps = drafter.config.ttt_steps
    tokens, decoded = chain_logits(
        drafter, prefill(model, [prefix.tolist()], drafter.request).rows[0].draft_state(), steps
    )
    assert set(tokens.tolist()) <= set(drafter.draft_ids().tolist())  # proposals are target ids of draft tokens
    text = torch.cat([prefix, tokens, torch.randint(3, TINY_VOCAB, (3,), generator=generator)])[None]
    with torch.no_grad():
        outputs = drafter.unroll(text, run_target(model, text, request=drafter.request).layers)
        for step in range(steps):
            trained = drafter.draft_logits(outputs[step][0, n - 2])
            torch.testing.assert_close(trained, decoded[step], rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_loss_scores_step_i_against_the_target_distribution_of_its_token(model, drafter):
    """With one supervised token x_j, step i scores its output at t = j-2-i against the target's
    distribution after x_0..x_{j-1} (its logits at j-1), renormalised over the draft vocabulary."""
    generator = torch.Generator().manual_seed(9)
    text = torch.randint(3, TINY_VOCAB, (1, 16), generator=generator)
    target_out = run_target(model, text, request=drafter.request)
    # Make sure x_j's target argmax is in the draft vocabulary, so every step scores it.
    j = next(j for j in range(10, 16) if drafter.t2d[target_out.logits[0, j - 1].argmax()])
    loss_mask = torch.zeros_like(text)
    loss_mask[0, j] = 1
    with torch.no_grad():
        loss, count, stats = drafter({"input_ids": text, "loss_mask": loss_mask}, target_out)
        outputs = drafter.unroll(text, target_out.layers)
    expected_total = 0.0
    p = target_out.logits[0, j - 1, drafter.draft_ids()].softmax(-1)
    for step in range(drafter.config.ttt_steps):
        log_q = drafter.draft_logits(outputs[step][0, j - 2 - step]).log_softmax(-1)
        expected = -(p * log_q).sum().item()
        assert stats[f"step{step + 1}/loss"][0].tolist() == pytest.approx([expected, 1.0], rel=1e-4)
        hit = float(drafter.draft_ids()[log_q.argmax()] == target_out.logits[0, j - 1].argmax())
        assert stats[f"step{step + 1}/top1"][0].tolist() == [hit, 1.0]
        expected_total += drafter.config.ttt_decay**step * expected
    assert loss.item() == pytest.approx(expected_total, rel=1e-4) and int(count) == 1  # a sum over one token


def test_target_argmax_outside_the_draft_vocabulary_is_a_miss_and_not_in_the_loss(model, drafter):
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(3, TINY_VOCAB, (4, 24), generator=generator)
    target_out = run_target(model, text, request=drafter.request)
    _, _, stats = drafter({"input_ids": text, "loss_mask": torch.ones_like(text)}, target_out)
    in_vocab = drafter.t2d[target_out.logits[:, 1:-1].argmax(-1)].float()  # step 1 scores logits 1..T-2
    assert 0 < in_vocab.mean() < 1  # both kinds occur
    assert stats["vocab_coverage"].sum(0).tolist() == pytest.approx([in_vocab.sum().item(), in_vocab.numel()])
    assert stats["step1/loss"][:, 1].sum() == in_vocab.sum()  # the loss sees in-vocabulary positions only
    assert stats["step1/top1"][:, 0].sum() <= in_vocab.sum()  # a hit needs an in-vocabulary argmax


def reference_unroll(drafter, input_ids: torch.Tensor, layers: dict, batch: dict) -> list[torch.Tensor]:
    """The training-time test the straightforward way: every step at every position, the keys of all
    steps so far in one KV cache, and the decode-time tree mask over them as one [W, (i+1)W] mask:
    step 0's keys causally (within the document, within the window at the query's position t + i),
    each later step's key at the position itself; P-EAGLE's later steps read the mask inputs."""
    width, window = input_ids.shape[1] - 2, drafter.config.sliding_window
    features = drafter.fuse(layers)[:, :width]
    start = positions(batch)[:, :width]
    first = draft_attention_mask(batch, width)
    first = (
        torch.ones(width, width, dtype=torch.bool, device=input_ids.device).tril().expand(len(input_ids), 1, -1, -1)
        if first is None
        else first
    )
    itself = torch.eye(width, dtype=torch.bool, device=input_ids.device).expand_as(first)
    cache = DynamicCache(config=drafter.layer_config)
    outputs = []
    for step in range(drafter.config.ttt_steps):
        seen = first if window is None else first & (start[:, None, None, :] > start[:, None, :, None] + step - window)
        mask = torch.cat([seen, *[itself] * step], dim=-1)
        tokens = shifted(input_ids, 1 + step, width)
        if step and drafter.config.parallel_drafting:
            tokens, features = drafter.mask_inputs(tokens.numel(), tokens.device)
            tokens, features = tokens.view(len(input_ids), width), features.reshape(len(input_ids), width, -1)
        features = drafter.draft(tokens, features, start + step, mask, cache)
        outputs.append(features)
    return outputs


def reference_loss(drafter, batch: dict, target_out: TargetOutput):
    """EAGLE-3's loss computed the straightforward way, as the loss was first written: the target's
    distribution over the draft vocabulary at every position of the batch from its full logits, then
    per step the supervised positions' rows of it, every supervised position through the lm_head;
    the draft's outputs from `reference_unroll`."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
    length = input_ids.shape[1]
    docs, num_docs = documents(batch), num_documents(batch)
    outputs = reference_unroll(drafter, input_ids, target_out.layers, batch)
    draft_ids = drafter.draft_ids()
    with torch.no_grad():
        logits = target_out.logits
        target_best = logits.argmax(-1)
        in_vocab = drafter.t2d[target_best] if drafter.pruned else torch.ones_like(target_best, dtype=torch.bool)
        p_all = (logits[..., draft_ids] if drafter.pruned else logits).float().softmax(-1)
        p_all = p_all.masked_fill(~in_vocab[..., None], 0.0).flatten(0, 1)
        target_best, in_vocab = target_best.flatten(), in_vocab.flatten()
    total = torch.zeros((), device=input_ids.device)
    stats = {}
    for step, output in enumerate(outputs):
        supervised = shifted(loss_mask, 2 + step, length - 2, fill=False) & same_document(docs, 2 + step, length - 2)
        rows, cols = supervised.nonzero(as_tuple=True)
        samples = docs[rows, cols]
        scored = rows * length + cols + 1 + step
        log_q = drafter.draft_logits(output[rows, cols]).log_softmax(-1)
        token_loss = -(p_all.index_select(0, scored) * log_q).sum(-1)
        counted = in_vocab[scored]
        total = total + drafter.config.ttt_decay**step * token_loss[counted].sum()
        with torch.no_grad():
            top1 = (draft_ids[log_q.argmax(-1)] == target_best[scored]).float()
            stats |= per_sample_stats({f"step{step + 1}/top1": top1}, samples, num_docs)
            stats |= per_sample_stats(
                {f"step{step + 1}/loss": token_loss[counted].detach()}, samples[counted], num_docs
            )
            if step == 0 and drafter.pruned:
                stats |= per_sample_stats({"vocab_coverage": counted.float()}, samples, num_docs)
    return total, loss_mask.sum(), stats


def loss_rows(lengths=(24, 17, 9, 30, 6), seed: int = 4) -> list[dict]:
    """Conversations with a prompt that bears no loss (or none), some ending with loss-free tokens."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for i, length in enumerate(lengths):
        prompt, end = (length // 3, 0, 2)[i % 3], length - (i % 2)
        mask = [0] * prompt + [1] * (end - prompt) + [0] * (length - end)
        rows.append(
            {
                "input_ids": torch.randint(3, TINY_VOCAB, (length,), generator=generator).tolist(),
                "loss_mask": mask,
                "domain": "d",
                "sample": str(i),
            }
        )
    return rows


EQUIVALENCE_CASES = ["padded", "packed", "captured-topk", "full-vocabulary", "more-steps-than-positions"]
# the fast tier runs EAGLE-3.1 on packed rows (the harder layout); the other variants and padded rows in the slow tier
VARIANT_CASES = [
    (variant, case) for variant in ("drafter31", "windowed", "parallel_drafter") for case in ("padded", "packed")
]


@pytest.mark.parametrize(
    "variant, case",
    [("drafter", case) for case in EQUIVALENCE_CASES]
    + fast_tier(VARIANT_CASES, lambda variant: variant == ("drafter31", "packed")),
    ids=[f"eagle3-{case}" for case in EQUIVALENCE_CASES] + [f"{v}-{c}" for v, c in VARIANT_CASES],
)
def test_loss_and_stats_equal_a_straightforward_reference(model, variant, case, request, monkeypatch):
    """Every TTT step runs at every position with the fused vocabulary loss (heads/vocab_loss.py) in
    chunks, the target's full-vocabulary argmax read in chunks too; the loss, every statistic and the
    gradients are those of the straightforward computation (one KV cache and one mask over all steps,
    materialised logits), up to float rounding, for EAGLE-3, EAGLE-3.1, the sliding-window layer and
    P-EAGLE, padded and packed."""
    drafter = request.getfixturevalue(variant)
    rows = loss_rows()
    if case == "full-vocabulary":
        torch.manual_seed(0)
        drafter = Eagle3.from_target(Eagle3.Config(aux_layers=[-1, 0, 1], ttt_steps=4), model, "tiny")
        assert not drafter.pruned
    if case == "more-steps-than-positions":
        torch.manual_seed(0)
        drafter = Eagle3.from_target(
            Eagle3.Config(aux_layers=[-1, 0, 1], draft_vocab_size=DRAFT_VOCAB, ttt_steps=9), model, "tiny"
        )
        drafter.prepare(rows)
        rows = loss_rows(lengths=(9, 6, 4, 11))
    monkeypatch.setattr(drafter, "loss_chunk_bytes", 4 * TINY_VOCAB * 7)  # 7 rows a chunk: several chunks
    batch = (PackingCollator(0, 40) if case == "packed" else Collator(0))(rows)
    with torch.no_grad():
        target_out = run_target(model, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
    if case == "captured-topk":  # as a capture with logits=topk gives it: top-5 log-probabilities, -inf elsewhere
        logprobs, ids = target_out.logits.float().log_softmax(-1).topk(5, dim=-1)
        sparse = torch.full_like(target_out.logits, float("-inf")).scatter_(-1, ids, logprobs)
        target_out = TargetOutput(logits=sparse, layers=target_out.layers)
    results = []
    for compute in (lambda: drafter(batch, target_out), lambda: reference_loss(drafter, batch, target_out)):
        drafter.zero_grad()
        loss, count, stats = compute()
        (loss / count).backward()
        results.append(
            (
                torch.stack([loss.detach(), count.float()]),
                stats,
                {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None},
            )
        )
    (loss, stats, grads), (expected_loss, expected_stats, expected_grads) = results
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert list(stats) == list(expected_stats)
    for name, values in expected_stats.items():
        assert torch.equal(stats[name][:, 1], values[:, 1]), name  # the same positions counted
        torch.testing.assert_close(stats[name], values, rtol=1e-5, atol=1e-5, msg=name)
    assert grads.keys() == expected_grads.keys() and grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    if drafter.pruned:  # both kinds of positions occur: the in-vocabulary filter is exercised
        coverage = expected_stats["vocab_coverage"].sum(0)
        assert 0 < coverage[0] < coverage[1]
    if case == "more-steps-than-positions":
        assert expected_stats["step9/top1"][:, 1].sum() == 0 and expected_stats["step1/top1"][:, 1].sum() > 0


# Every RoPE kind a draft layer is built with (families.PORTABLE_ROPE), at a scale that reaches the positions used
ROPE_KINDS = {
    "default": {},
    "linear": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
}


def test_every_steps_statistics_from_one_call_are_a_call_per_step():
    """The loss's statistics of every TTT step at once (`per_sample_stats` over a leading step dimension, the masks
    as windows of one padded copy, `step_windows`) are exactly those of a call per step (`shifted`)."""
    from draftsmith.heads.eagle3_training import step_windows

    torch.manual_seed(0)
    samples = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 2, 2]])
    values, where = torch.randn(3, 2, 5), torch.rand(3, 2, 5) > 0.3
    for mask in (where, None):
        stacked = per_sample_stats({"v": values}, samples, 3, where=mask)["v"]
        assert stacked.shape == (3, 3, 2)
        for step in range(3):
            alone = per_sample_stats({"v": values[step]}, samples, 3, where=None if mask is None else mask[step])
            assert torch.equal(stacked[step], alone["v"])
    x = torch.arange(14).view(2, 7)
    windows = step_windows(x, 2, 4, 5, fill=-1)
    assert torch.equal(windows, torch.stack([shifted(x, 2 + step, 5, fill=-1) for step in range(4)]))


@pytest.mark.parametrize("kind", ROPE_KINDS)
def test_every_steps_rope_from_one_call_is_a_call_per_step(model, drafter, kind, monkeypatch):
    """The unroll computes the RoPE of all its steps in one call (`step_ropes`): for every RoPE kind a draft
    layer may have, each step's (cos, sin) are exactly those of a call at that step's positions, on packed rows
    whose positions restart per document."""
    from draftsmith.families import PORTABLE_ROPE

    assert set(ROPE_KINDS) == set(PORTABLE_ROPE)
    config = drafter.layer_config.__class__.from_dict(drafter.layer_config.to_dict())
    config.rope_parameters = {"rope_type": kind, "rope_theta": 10000.0, **ROPE_KINDS[kind]}
    rotary = type(drafter.rotary_emb)(config=config)
    # a submodule lives in `_modules`, not the instance's __dict__: pytest >= 9.2 would delete it on undo after setattr
    monkeypatch.setitem(drafter._modules, "rotary_emb", rotary)
    start = positions(PackingCollator(0, 40)(loss_rows()))
    features = torch.zeros(*start.shape, 1)
    for step, (cos, sin) in enumerate(drafter.step_ropes(features, start)):
        expected_cos, expected_sin = rotary(features, start + step)
        assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin), step


@pytest.mark.parametrize("variant", ["drafter", "windowed"])
def test_the_unroll_builds_rope_and_masks_once_per_micro_batch(model, variant, request, monkeypatch):
    """What does not change between TTT steps is built once per micro-batch: one RoPE call for all steps, and
    without a sliding window one attention bias for all later steps (with one, the window moves with the
    step: one bias each)."""
    import draftsmith.heads.ttt_attention as ttt_attention

    drafter = request.getfixturevalue(variant)
    built = {"rope": 0, "bias": 0}
    rotary, additive = drafter.rotary_emb.forward, ttt_attention.additive

    def counted(name, function):
        def call(*args, **kwargs):
            built[name] += 1
            return function(*args, **kwargs)

        return call

    monkeypatch.setattr(drafter.rotary_emb, "forward", counted("rope", rotary))
    monkeypatch.setattr(ttt_attention, "additive", counted("bias", additive))
    batch = PackingCollator(0, 40)(loss_rows())
    with torch.no_grad():
        target_out = run_target(model, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
        drafter.unroll(batch["input_ids"], target_out.layers, batch)
    steps = drafter.config.ttt_steps
    assert built == {"rope": 1, "bias": 1 if drafter.config.sliding_window is None else steps - 1}


@pytest.mark.parametrize("kind", ["drafter", "parallel_drafter"])
def test_chunked_loss_equals_the_unchunked_one(model, kind, request, monkeypatch):
    """The loss walks the positions `loss_chunk_bytes` of logits at a time (the draft lm_head, softmax and
    gradients per chunk, nothing recomputed): the loss, the statistics and the gradients are the
    unchunked ones to float rounding."""
    drafter = request.getfixturevalue(kind)
    batch = Collator(0)(loss_rows())
    with torch.no_grad():
        target_out = run_target(model, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
    results = []
    for tile_rows in (None, 5):  # untiled, then tiles of 5 positions (several per TTT step)
        if tile_rows is not None:
            monkeypatch.setattr(drafter, "loss_chunk_bytes", 4 * DRAFT_VOCAB * tile_rows)
        drafter.zero_grad()
        loss, count, stats = drafter(batch, target_out)
        (loss / count).backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        results.append((loss.detach(), stats, grads))
    drafter.zero_grad()
    (loss, stats, grads), (tiled_loss, tiled_stats, tiled_grads) = results
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    assert list(tiled_stats) == list(stats)
    for name, values in stats.items():
        torch.testing.assert_close(tiled_stats[name], values, rtol=1e-6, atol=1e-6, msg=name)
    assert tiled_grads.keys() == grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(tiled_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


# -- draft vocabulary and checkpoint --------------------------------------------------------------
def test_prepare_keeps_the_most_frequent_loss_tokens_ties_by_id(model):
    drafter = Eagle3.from_target(Eagle3.Config(aux_layers=[0, 1], draft_vocab_size=4), model, "tiny")
    rows = [
        {
            "input_ids": [9, 9, 9, 5, 5, 7, 7, 3, 3, 3, 3],
            "loss_mask": [1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
        },  # 3 bears no loss
        {"input_ids": [8, 8, 6, 6, 4, 4], "loss_mask": [1, 1, 1, 1, 1, 1]},
    ]
    drafter.prepare(rows)
    # 9 (x3), then 4, 5, 6, 7, 8 (x2 each): ties go to the lower ids; kept in id order.
    assert drafter.draft_ids().tolist() == [4, 5, 6, 9]
    assert drafter.d2t.tolist() == [4, 4, 4, 6]  # target id = draft id + d2t[draft id]
    assert drafter.t2d.nonzero().flatten().tolist() == [4, 5, 6, 9]
    assert torch.equal(drafter.lm_head.weight, model.lm_head.weight[[4, 5, 6, 9]])
    assert drafter.learned["draft_vocab_coverage"] == pytest.approx(9 / 13)

    class Store:  # a FeatureStore hands over tokens without features
        def token_rows(self):
            return iter([(torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"])) for row in rows])

        def __getitem__(self, index):
            raise AssertionError("prepare must not read features")

    drafter.prepare(Store())
    assert drafter.draft_ids().tolist() == [4, 5, 6, 9]


def test_data_draft_vocab_picks_the_vocabulary_and_coverage_is_counted_on_the_training_data(model, caplog):
    drafter = Eagle3.from_target(Eagle3.Config(aux_layers=[0, 1], draft_vocab_size=2), model, "tiny")
    train = [{"input_ids": [4, 4, 5, 6, 7, 3], "loss_mask": [1, 1, 1, 1, 1, 0]}]  # 5 loss tokens
    vocab = [{"input_ids": [5, 5, 9, 9, 4], "loss_mask": [1, 1, 1, 1, 1]}]
    with caplog.at_level("INFO", logger="draftsmith.eagle3"):
        drafter.prepare(train, vocab_from=vocab)
    assert drafter.draft_ids().tolist() == [5, 9]  # data.draft_vocab's most frequent
    # 1 of the training data's 5 loss tokens (a 5), not 1.0 as counted on data.draft_vocab
    assert drafter.learned["draft_vocab_coverage"] == pytest.approx(1 / 5)
    assert "picked on data.draft_vocab's 5 loss tokens, covering 0.2000 of the training data's 5" in caplog.text


def test_checkpoint_round_trips_the_draft_vocabulary(model, drafter, tmp_path):
    drafter.save_pretrained(tmp_path / "eagle3")
    saved = load_file(str(tmp_path / "eagle3" / "model.safetensors"))
    # The speculators/vLLM Eagle3 layout; the embedding is the target's and not saved.
    assert {
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        "layers.0.hidden_norm.weight",
        "layers.0.input_layernorm.weight",
    } <= set(saved)
    assert not [name for name in saved if "embed" in name]
    hidden = model.config.hidden_size
    assert (
        saved["fc.weight"].shape == (hidden, 3 * hidden)
        and saved["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * hidden
    )
    assert saved["lm_head.weight"].shape == (DRAFT_VOCAB, hidden)
    assert (
        saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool and saved["t2d"].shape == (TINY_VOCAB,)
    )
    assert torch.equal(saved["t2d"].nonzero().flatten(), torch.arange(DRAFT_VOCAB) + saved["d2t"])
    config = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert config["drafter"]["aux_layers"] == [-1, 0, 1] and config["drafter"]["norm_before_residual"] is False

    loaded = load_drafter(tmp_path / "eagle3", TargetShape.of(model, "tiny"), model).eval()
    assert torch.equal(loaded.d2t, drafter.d2t) and torch.equal(loaded.t2d, drafter.t2d)
    assert loaded.learned == drafter.learned
    state = prefill(model, [[5, 9, 2, 7, 11]], drafter.request).rows[0].draft_state()
    for tree in (None, DynamicTree(nodes=10, depth=4, topk=3)):
        mine, theirs = drafter.proposer().propose(state, 4, tree), loaded.proposer().propose(state, 4, tree)
        assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.parents, theirs.parents)


def test_full_vocabulary_has_no_d2t_t2d(model, tmp_path):
    drafter = Eagle3.from_target(Eagle3.Config(aux_layers=[0, 1]), model, "tiny")  # 32000 clipped to 32
    assert drafter.config.draft_vocab_size == TINY_VOCAB and not drafter.pruned
    drafter.prepare([{"input_ids": [1, 2], "loss_mask": [1, 1]}])  # nothing to pick
    assert torch.equal(drafter.lm_head.weight, model.lm_head.weight)
    drafter.save_pretrained(tmp_path / "full")
    assert not {"d2t", "t2d"} & set(load_file(str(tmp_path / "full" / "model.safetensors")))
    loaded = load_drafter(tmp_path / "full", TargetShape.of(model, "tiny"), model)
    assert torch.equal(loaded.draft_ids(), torch.arange(TINY_VOCAB))


# -- decoding -------------------------------------------------------------------------------------
@pytest.mark.parametrize("tree", [None, DynamicTree(nodes=10, depth=4, topk=3)], ids=["chain", "dynamic-tree"])
def test_greedy_speculative_equals_plain(model, drafter, prompts, tree):
    assert_greedy_equals_plain(model, drafter, prompts, tree)


def test_cache_rollback_matches_a_drafter_rebuilt_from_scratch(model, drafter, prompts, tmp_path):
    assert_cache_rollback(model, drafter, prompts[2], tmp_path)


# -- EAGLE-3.1: fc_norm and norm_output ----------------------------------------------------------
@pytest.fixture(scope="module")
def drafter31(model):
    return fitted_eagle(model, steps=FIT_STEPS, **TINY, fc_norm=True, norm_output=True)


def test_eagle31_norms_each_aux_state_and_passes_the_normed_output_on(model, drafter31):
    """fc reads each aux layer's state through its own norm, and a draft step's output is norm(layer
    output): the lm_head reads it as it is (no second norm), the next step reads the same."""
    text = torch.randint(3, TINY_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        layers = run_target(model, text, request=drafter31.request).layers
        states = [norm(layers[layer]) for norm, layer in zip(drafter31.fc_norm, drafter31.config.aux_layers)]
        torch.testing.assert_close(drafter31.fuse(layers), drafter31.fc(torch.cat(states, dim=-1)))
        assert not torch.equal(
            drafter31.fuse(layers), drafter31.fc(torch.cat([layers[i] for i in drafter31.config.aux_layers], dim=-1))
        )
        args = (text[:, 1:], drafter31.fuse(layers)[:, :-1], torch.arange(8)[None])
        out = drafter31.draft(*args)
        drafter31.config.norm_output = False
        try:
            layer_output = drafter31.draft(*args)
        finally:
            drafter31.config.norm_output = True
        torch.testing.assert_close(out, drafter31.norm(layer_output))  # the normed output is passed on ...
        torch.testing.assert_close(drafter31.draft_logits(out), drafter31.lm_head(out).float())  # ... and read as it is


def test_norm_before_fc_scales_the_concatenated_taps_by_one_rms(model):
    """speculators' norm_before_fc (vLLM's input_norm): one RMSNorm over the taps side by side before
    fc, in place of fc_norm's one per tap; asking for both is one line."""
    drafter = fitted_eagle(model, steps=0, **TINY, norm_before_fc=True)
    with torch.no_grad():
        drafter.input_norm.weight.uniform_(0.5, 1.5)  # a weight left at 1 would not show it is applied
        text = torch.randint(3, TINY_VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
        layers = run_target(model, text, request=drafter.request).layers
        taps = torch.cat([layers[i] for i in drafter.config.aux_layers], dim=-1)
        rms = taps.pow(2).mean(-1, keepdim=True).add(drafter.layer_config.rms_norm_eps).rsqrt()
        torch.testing.assert_close(drafter.fuse(layers), drafter.fc(taps * rms * drafter.input_norm.weight))
    assert drafter.input_norm.weight.shape == (len(drafter.config.aux_layers) * model.config.hidden_size,)
    with pytest.raises(UserError, match="fc_norm and drafter.norm_before_fc both") as info:
        Eagle3Config(fc_norm=True, norm_before_fc=True).check()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("n", [2, 7])
def test_eagle31_training_time_test_equals_decoding(model, drafter31, n):
    test_training_time_test_equals_decoding(model, drafter31, n)


def test_eagle31_greedy_is_lossless_and_round_trips_the_checkpoint(model, drafter31, prompts, tmp_path):
    assert_greedy_equals_plain(model, drafter31, prompts, DynamicTree(nodes=10, depth=4, topk=3))
    drafter31.save_pretrained(tmp_path / "eagle31")
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(load_file(str(tmp_path / "eagle31" / "model.safetensors")))
    loaded = load_drafter(tmp_path / "eagle31", TargetShape.of(model, "tiny"), model).eval()
    assert loaded.config.fc_norm and loaded.config.norm_output
    state = prefill(model, [[5, 9, 2, 7, 11]], drafter31.request).rows[0].draft_state()
    assert torch.equal(drafter31.proposer().propose(state, 4).tokens, loaded.proposer().propose(state, 4).tokens)


# -- a sliding-window draft layer (speculators' default) ------------------------------------------
WINDOW = 4  # of the prompts' 5-17 committed positions, and the chain's 4 steps: the window engages at every depth


@pytest.fixture(scope="module")
def windowed(model):
    return fitted_eagle(model, steps=FIT_STEPS, **TINY, sliding_window=WINDOW)


@pytest.mark.parametrize("n", [7, 12])
def test_windowed_training_time_test_equals_decoding(model, windowed, n):
    test_training_time_test_equals_decoding(model, windowed, n)


def test_a_windowed_draft_reads_only_the_last_window_positions(model, windowed):
    """Step 0 at position t equals the draft over positions t-WINDOW+1..t alone (at their own
    positions), and differs from full attention over the same weights: the window is applied, by the
    engines' count (a key at p - WINDOW is out)."""
    text = torch.randint(3, TINY_VOCAB, (1, 14), generator=torch.Generator().manual_seed(5))
    t = 9
    with torch.no_grad():
        layers = run_target(model, text, request=windowed.request).layers
        windowed_out = windowed.unroll(text, layers)[0][0, t]
        first = t - WINDOW + 1
        features = windowed.fuse(layers)[:, first : t + 1]
        alone = windowed.draft(text[:, first + 1 : t + 2], features, torch.arange(first, t + 1)[None])[0, -1]
        torch.testing.assert_close(windowed_out, alone, rtol=1e-5, atol=1e-5)
        windowed.config.sliding_window = None
        try:
            full = windowed.unroll(text, layers)[0][0, t]
        finally:
            windowed.config.sliding_window = WINDOW
    assert not torch.allclose(full, windowed_out, atol=1e-3)


@pytest.mark.parametrize("tree", [None, DynamicTree(nodes=10, depth=4, topk=3)], ids=["chain", "dynamic-tree"])
def test_windowed_greedy_speculative_equals_plain(model, windowed, prompts, tree):
    assert_greedy_equals_plain(model, windowed, prompts, tree)


def test_windowed_cache_rollback_and_checkpoint(model, windowed, prompts, tmp_path):
    assert_cache_rollback(model, windowed, prompts[2], tmp_path)
    windowed.save_pretrained(tmp_path / "windowed")
    assert load_drafter(tmp_path / "windowed", TargetShape.of(model, "tiny"), model).config.sliding_window == WINDOW
    with pytest.raises(UserError, match="drafter.sliding_window=0 must be >= 1") as info:
        Eagle3Config(sliding_window=0).check()
    assert "\n" not in str(info.value)


# -- P-EAGLE: parallel drafting ------------------------------------------------------------------
@pytest.fixture(scope="module")
def parallel_drafter(model):
    return fitted_eagle(model, steps=FIT_STEPS, **TINY, fc_norm=True, parallel_drafting=True, mask_token_id=2)


@pytest.mark.parametrize("n", [2, 7, 12])
def test_parallel_training_time_test_equals_the_one_forward_of_decoding(model, parallel_drafter, n):
    """Decoding drafts the whole chain in one forward (the root's query, then mask queries); TTT step i
    at position n-2 must give that forward's i-th logits. Later steps read the mask, never the text
    after the committed prefix: any continuation gives the same logits."""
    generator = torch.Generator().manual_seed(n)
    prefix = torch.randint(3, TINY_VOCAB, (n,), generator=generator)
    steps = parallel_drafter.config.ttt_steps
    state = prefill(model, [prefix.tolist()], parallel_drafter.request).rows[0].draft_state()
    proposer = parallel_drafter.proposer()
    tokens, decoded = chain_logits(parallel_drafter, state, steps)
    assert len(decoded) == 1 and decoded[0].shape[0] == steps  # one lm_head call over the whole chain
    assert torch.equal(proposer.propose(state, steps).tokens, tokens) and proposer.draft_forwards == 1
    for continuation in (tokens, torch.randint(3, TINY_VOCAB, (steps,), generator=generator)):
        text = torch.cat([prefix, continuation, torch.randint(3, TINY_VOCAB, (3,), generator=generator)])[None]
        with torch.no_grad():
            outputs = parallel_drafter.unroll(text, run_target(model, text, request=parallel_drafter.request).layers)
            for step in range(steps):
                trained = parallel_drafter.draft_logits(outputs[step][0, n - 2])
                torch.testing.assert_close(trained, decoded[0][step], rtol=1e-4, atol=1e-4, msg=f"step {step}")


def test_parallel_greedy_is_lossless_at_one_draft_forward_per_cycle(model, parallel_drafter, prompts, tmp_path):
    assert_greedy_equals_plain(model, parallel_drafter, prompts, None)
    out = generate(model, prompts[2], 40, parallel_drafter.proposer(), gamma=3)
    assert out.counts.draft_forwards == out.counts.target_forwards > 0  # one draft forward per verify cycle
    assert_cache_rollback(model, parallel_drafter, prompts[2], tmp_path, trees=False)
    with pytest.raises(UserError, match="chains only"):
        parallel_drafter.proposer().default_tree(6)
    with pytest.raises(UserError, match="chains only"):
        generate(model, prompts[0], 8, parallel_drafter.proposer(), gamma=3, tree=DynamicTree(nodes=6, depth=3, topk=2))
    with pytest.raises(UserError, match="eval.tree=16 but this eagle3 drafter, as configured, proposes chains only"):
        load_recipe(["recipe=eagle3", "drafter.parallel_drafting=true", "drafter.mask_token_id=2", "eval.tree=16"])
    with pytest.raises(UserError, match="parallel_drafting=true needs drafter.mask_token_id"):
        load_recipe(["recipe=eagle3", "drafter.parallel_drafting=true", "eval.tree=0"])


def test_parallel_drafter_round_trips_mask_hidden(model, parallel_drafter, prompts, tmp_path):
    parallel_drafter.save_pretrained(tmp_path / "peagle")
    saved = load_file(str(tmp_path / "peagle" / "model.safetensors"))
    assert saved["mask_hidden"].shape == (3 * model.config.hidden_size,)
    loaded = load_drafter(tmp_path / "peagle", TargetShape.of(model, "tiny"), model).eval()
    assert loaded.config.parallel_drafting and loaded.config.mask_token_id == 2
    state = prefill(model, [prompts[1]], parallel_drafter.request).rows[0].draft_state()
    assert torch.equal(parallel_drafter.proposer().propose(state, 4).tokens, loaded.proposer().propose(state, 4).tokens)


# -- configuration --------------------------------------------------------------------------------
def test_aux_layers_default_and_bad_values():
    deep = tiny_llama(vocab=16, hidden=16, layers=12)
    drafter = Eagle3.from_target(Eagle3.Config(), deep, "deep")
    assert drafter.config.aux_layers == [1, 5, 8]  # vLLM's [2, L//2, L-3] = ours + 1
    assert drafter.request.layers == (1, 5, 8) and not drafter.request.final and drafter.request.logits
    shallow = tiny_llama(vocab=16, hidden=16, layers=4)
    with pytest.raises(UserError, match=r"default aux layers .* \[1, 1, 0\].*set drafter.aux_layers"):
        Eagle3.from_target(Eagle3.Config(), shallow, "shallow")
    with pytest.raises(
        UserError, match=r"drafter.aux_layers=\[0, 4\]: layer id\(s\) \[4\] out of range .*valid: -1..3"
    ):
        Eagle3.from_target(Eagle3.Config(aux_layers=[0, 4]), shallow, "shallow")
    with pytest.raises(UserError, match="distinct and increasing"):
        Eagle3.from_target(Eagle3.Config(aux_layers=[2, 1]), shallow, "shallow")


# -- the real trainer -----------------------------------------------------------------------------
@pytest.mark.slow
def test_real_trainer_lowers_the_loss_and_saves_the_draft_vocabulary(tmp_path, small_data, token_cache, caplog):

    output_dir = tmp_path / "run"
    args = train_args(output_dir, small_data, token_cache, "train.max_steps=16", "train.lr=3e-3", "data.max_length=96")
    train_in_process(["recipe=eagle3", *args[1:], "drafter.draft_vocab_size=1024", "drafter.ttt_steps=3"])

    log = {
        row["step"]: row
        for row in map(json.loads, (output_dir / "log.jsonl").read_text().splitlines())
        if "train/loss" in row
    }
    assert sum(log[step]["train/loss"] for step in range(13, 17)) / 4 < 0.8 * log[1]["train/loss"]
    table = json.loads((output_dir / "eval_accuracy.json").read_text())
    trained, untrained = table["trained"]["all"], table["untrained"]["all"]
    assert trained["step1/top1"] > untrained["step1/top1"] + 0.05 and trained["step1/loss"] < untrained["step1/loss"]
    assert {"step1/top1", "step3/top1", "vocab_coverage"} <= set(trained)

    final = output_dir / "final"
    weights = load_file(str(final / "model.safetensors"))
    assert weights["lm_head.weight"].shape[0] == 1024 and int(weights["t2d"].sum()) == 1024
    config = json.loads((final / "config.json").read_text())
    assert config["drafter"]["aux_layers"] == [0, 1, 2] and 0.5 < config["learned"]["draft_vocab_coverage"] <= 1

    # a warm start keeps its start's vocabulary: it was fitted to the new run's data first (a pass over it, and a log
    # line naming a vocabulary the run never trained), then overwritten by the start's
    warm = ["recipe=eagle3", *train_args(tmp_path / "warm", small_data, token_cache, "train.max_steps=2")[1:],
            "drafter.draft_vocab_size=1024", f"train.init_from={final}", "data.max_conversations=4",
            "train.save_every=1"]  # fmt: skip
    caplog.clear()
    with caplog.at_level("INFO"):
        train_in_process(warm)
    assert "draft vocabulary:" not in caplog.text and f"warm start from {final}" in caplog.text
    started = load_file(str(tmp_path / "warm" / "final" / "model.safetensors"))
    assert torch.equal(started["t2d"], weights["t2d"]) and torch.equal(started["d2t"], weights["d2t"])
    # resumed, it keeps the start's too: it fitted a vocabulary to the data again, and recorded that one's coverage
    # (the card's "covers 98.1% of the training data"), though it trained the start's (a newcomer's journey, 2026-12-07)
    learned = json.loads((tmp_path / "warm" / "final" / "config.json").read_text())["learned"]
    shutil.rmtree(tmp_path / "warm" / "final")
    shutil.rmtree(tmp_path / "warm" / "checkpoints" / "step_0000002")
    caplog.clear()
    with caplog.at_level("INFO"):
        train_in_process([*warm, "train.resume=true"])
    assert "draft vocabulary:" not in caplog.text
    assert json.loads((tmp_path / "warm" / "final" / "config.json").read_text())["learned"] == learned
    assert learned == config["learned"]  # the start's, as the run without a stop records
    resumed = load_file(str(tmp_path / "warm" / "final" / "model.safetensors"))
    assert torch.equal(resumed["t2d"], weights["t2d"]) and torch.equal(resumed["d2t"], weights["d2t"])


@pytest.mark.slow
def test_training_from_captured_shards(tmp_path, small_data, token_cache, capsys):
    """Capture stores exactly the aux layers and the top-k distribution; training reads them; a
    capture of other layers is refused in one line (exit 2)."""
    from draftsmith.data_prep.capture import capture

    features = tmp_path / "features"
    quick = ["data.max_conversations=8", "data.max_length=96", "drafter.ttt_steps=2", "drafter.draft_vocab_size=512"]
    args = ["recipe=eagle3", *train_args(tmp_path / "run", small_data, token_cache, *quick)[1:]]
    capture(load_recipe([*args, f"data.capture.output={features}"]))
    manifest = json.loads((features / "manifest.json").read_text())
    assert manifest["layers"] == [0, 1, 2] and not manifest["final"] and manifest["logits"] == "topk"

    train_in_process([*args, "train.max_steps=2", f"data.features={features}", "data.eval=[]"])  # no eval read
    assert '"train/step2/top1"' in (tmp_path / "run" / "log.jsonl").read_text()
    assert int(load_file(str(tmp_path / "run" / "final" / "model.safetensors"))["t2d"].sum()) == 512

    # data.draft_vocab: the vocabulary is ranked on that text, not on the shards' training tokens.
    answer = "the same few words again and again"
    vocab_file = tmp_path / "vocab.jsonl"
    vocab_file.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]}) + "\n"
    )
    train_in_process(
        [
            *args,
            "train.max_steps=1",
            f"data.features={features}",
            f"data.draft_vocab=[{vocab_file}]",
            f"output_dir={tmp_path / 'vocab'}",
        ]
    )
    config = json.loads((tmp_path / "vocab" / "final" / "config.json").read_text())
    ranked_on_shards_coverage = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["learned"]
    # counted on the shards' training tokens either way (not 1.0, as on the one answer that picked it)
    assert config["learned"]["draft_vocab_coverage"] < ranked_on_shards_coverage["draft_vocab_coverage"]
    ranked_on_answer = load_file(str(tmp_path / "vocab" / "final" / "model.safetensors"))["t2d"]
    ranked_on_shards = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))["t2d"]
    # A dozen distinct answer tokens; the rest of the 512 are unseen, tied, so the lowest ids.
    assert int(ranked_on_answer[512:].sum()) < 16 and not torch.equal(ranked_on_answer, ranked_on_shards)
    accuracy = json.loads(
        (tmp_path / "vocab" / "eval_accuracy.json").read_text()
    )  # the untrained baseline ranks on the same text
    assert accuracy["trained"]["all"]["vocab_coverage"] == accuracy["untrained"]["all"]["vocab_coverage"]

    other = run_entry_in_process(
        [
            "train.py",
            *args,
            "drafter.aux_layers=[0,3]",
            f"data.features={features}",
            f"output_dir={tmp_path / 'other'}",
        ],
        capsys,
    )
    assert_one_line_error(other, 2, "hold layers [0, 1, 2] but the drafter needs [0, 3]", prefix="error:")
