"""DSpark: every block position predicts the token after it, its logits biased by the Markov head from the token
before it (the data's in training, the drafted one in decoding), so a teacher-forced block equals a decoding block
drafted along the data; the loss is the Markov-corrected block cross-entropy plus the confidence head's binary
cross-entropy to the acceptance chance, recomputed by hand; the Markov projection trains under both weightings;
speculative decoding is lossless and samples exactly at one draft forward per cycle; the real trainer trains,
resumes and evaluates through train.py."""

from __future__ import annotations

import itertools
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from draftsmith.errors import UserError
from draftsmith.eval.loop import generate, prefill
from draftsmith.eval.sampling import Sampling
from draftsmith.heads import drafter_class
from draftsmith.heads.base import TargetShape
from draftsmith.heads.dflash import ROW_BLOCKS
from draftsmith.heads.packing import conversation_rand
from draftsmith.heads.proposer import DynamicTree
from draftsmith.target import run_target
from tests.helpers import DFLASH_TINY as TINY
from tests.helpers import (
    SAMPLES,
    TINY_VOCAB,
    VOCAB,
    assert_greedy_equals_plain,
    assert_one_line_error,
    exact_conditionals,
    exact_joint,
    exactness_pvalues,
    first_records,
    fitted_eagle,
    greedy_text,
    read_log,
    reweighted,
    run_entry_in_process,
    speculative_samples,
    tiny_llama,
    train_args,
)

DSpark = drafter_class("dspark")

pytestmark = pytest.mark.usefixtures("one_thread")


def fitted_dspark(model, steps: int, **config):
    return fitted_eagle(model, steps, drafter_type="dspark", **{**TINY, "markov_rank": 8, **config})


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=TINY_VOCAB, logit_scale=4.0)


@pytest.fixture(scope="module")
def drafter(model):
    return fitted_dspark(model, steps=40)


@pytest.fixture(scope="module")
def prompts():
    rows = torch.randint(3, TINY_VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    return [row[:length].tolist() for row, length in zip(rows, (5, 11, 17))]


# -- training computes what decoding computes -------------------------------------------------------
@torch.no_grad()
def test_a_training_block_is_the_decoding_block_drafted_along_the_data(model, drafter):
    """Block position k of a teacher-forced block, biased by the Markov head from x_{a+k}, has the logits decoding
    gives the k-th token of a block of block_size queries after committing x_0..x_a, when the tokens drafted before
    it are the data's; and the Markov head moved them (its bias is not zero once trained)."""
    ids = greedy_text(model, rows=2, length=24, seed=3)
    anchors = torch.tensor([[1, 4, 9], [2, 3, 15]])
    out = run_target(model, ids, request=drafter.request)
    outputs = drafter.blocks(ids, out.layers, anchors)
    size = drafter.config.block_size
    for row, column in itertools.product(range(2), range(3)):
        a = int(anchors[row, column])
        previous = ids[row, a : a + size]
        trained = drafter.block_logits(outputs[row, column], previous)
        state = prefill(model, [ids[row, : a + 1].tolist()], drafter.request).rows[0].draft_state()
        decoded = drafter.block_logits(drafter.proposer().block_outputs(state, size), previous)
        torch.testing.assert_close(trained, decoded, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(trained, drafter.logits(outputs[row, column]), atol=1e-3)


def test_the_loss_is_the_markov_corrected_block_cross_entropy_and_the_confidence_loss(model, drafter):
    """Recomputed by hand (loss_weighting=decay): block position k scored against x_{a+k+1} with the Markov bias of
    x_{a+k}, weight exp(-k/loss_decay), plus confidence_weight times the BCE of the confidence logit to q(x_{a+k+1})
    with weight exp(-k/confidence_decay); each block's weights normalised over a whole block; blocks counted. The
    Markov projection's gradient, which reaches it through the fused vocabulary loss's weight, is autograd's."""
    drafter = reweighted(drafter, model, loss_weighting="decay", confidence_weight=0.5).train()
    ids = greedy_text(model, rows=2, length=30, seed=4)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    loss_mask[0, 10:] = True
    loss_mask[1, 26:] = True  # blocks running past the end
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    batch |= drafter.host_fields(batch)
    out = run_target(model, ids, request=drafter.request)
    loss, count, stats = drafter(batch, out)
    loss.backward()
    fused = drafter.markov_head.markov_w2.weight.grad.clone()
    drafter.zero_grad()
    draws = conversation_rand(batch, (), ids.device, drafter.optimizer_step)
    anchors, real = drafter.sample_anchors(loss_mask, draws, batch[ROW_BLOCKS])
    size, config = drafter.config.block_size, drafter.config
    outputs = drafter.blocks(ids, out.layers, anchors)
    decay = [math.exp(-j / config.loss_decay) for j in range(size)]
    confidence_decay = [math.exp(-j / config.confidence_decay) for j in range(size)]
    expected = torch.zeros(())
    for row, column, k in itertools.product(range(2), range(anchors.shape[1]), range(size)):
        a = int(anchors[row, column])
        if not (real[row, column] and a + k + 1 < ids.shape[1] and loss_mask[row, a + k + 1]):
            continue
        previous = ids[row, a + k]
        ce = -drafter.block_logits(outputs[row, column, k], previous).log_softmax(-1)[ids[row, a + k + 1]]
        logit = drafter.confidence_head(outputs[row, column, k], drafter.markov_head.markov_w1(previous))
        bce = F.binary_cross_entropy_with_logits(logit, torch.exp(-ce.detach()))
        expected = expected + decay[k] / sum(decay) * ce + 0.5 * confidence_decay[k] / sum(confidence_decay) * bce
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)
    assert int(count) == int(real.sum()) == int(drafter.loss_tokens(batch))
    assert {"block1/top1", f"block{size}/top1", "confidence_error", "accepted"} <= set(stats)
    expected.backward()
    torch.testing.assert_close(fused, drafter.markov_head.markov_w2.weight.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("weighting", ["decay", "dpace"])
def test_every_part_trains_under_both_weightings(model, drafter, weighting):
    """The Markov projection and embedding, the confidence head and the backbone all get gradients (D-PACE weighs
    a second pass by the first's detached losses, so the projection's gradient follows it), the same whatever the
    vocabulary loss's chunking."""
    drafter = reweighted(drafter, model, loss_weighting=weighting).train()
    ids = greedy_text(model, rows=2, length=20, seed=6)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)}
    batch |= drafter.host_fields(batch)
    out = run_target(model, ids, request=drafter.request)
    drafter(batch, out)[0].backward()
    grads = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    parts = ("markov_head.markov_w1", "markov_head.markov_w2", "confidence_head.proj", "fc.", "layers.0.")
    assert all(any(name.startswith(part) and grad.abs().sum() > 0 for name, grad in grads.items()) for part in parts)
    drafter.zero_grad()
    drafter.loss_chunk_bytes = 1  # one row at a time
    drafter(batch, out)[0].backward()
    for name, p in drafter.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-4, atol=1e-6)


# -- decoding ---------------------------------------------------------------------------------------
def test_greedy_speculative_equals_plain_with_one_draft_forward_per_cycle(model, drafter, prompts):
    assert_greedy_equals_plain(model, drafter, prompts, None)
    out = generate(model, prompts[0], 30, drafter.proposer(), gamma=4)
    assert out.counts.target_forwards - 1 <= out.counts.draft_forwards <= out.counts.target_forwards


@torch.no_grad()
def test_a_chain_of_gamma_is_a_block_of_gamma_queries_sampled_left_to_right(model, drafter, prompts):
    """As vLLM runs DSpark with num_speculative_tokens γ: γ queries (the root and γ-1 masks), position i's argmax
    after the Markov bias of the token drafted before it (the root first); up to block_size tokens; no trees."""
    state = prefill(model, [prompts[2]], drafter.request).rows[0].draft_state()
    for gamma in (1, 3, drafter.config.block_size):
        chain = drafter.proposer().propose(state, gamma).tokens.tolist()
        outputs = drafter.proposer().block_outputs(state, gamma)
        previous, expected = state.tokens[-1], []
        for position in range(gamma):
            previous = drafter.block_logits(outputs[position], previous).argmax(-1)
            expected.append(int(previous))
        assert chain == expected
    assert DSpark.max_chain(drafter.config) == drafter.config.block_size and not DSpark.proposes_trees(drafter.config)
    with pytest.raises(UserError, match="proposes chains only"):
        drafter.proposer().propose(state, 2, DynamicTree(nodes=4, depth=2, topk=2))


# slow tier: the rejection rule is proven in the fast tier by tests/test_eval.py; here DSpark's own sequential q
@pytest.mark.slow
def test_sampling_matches_target_distribution():
    """Each position is sampled from its Markov-corrected q given the tokens drafted before it, and that q goes to
    the exact rule: chi-square against the target's exact distribution."""
    small_model = tiny_llama(vocab=VOCAB, hidden=16, layers=1, seed=5, logit_scale=8.0)
    sampling = Sampling(1.0)
    prompt = [1, 5, 2, 7]
    drafter = fitted_dspark(small_model, steps=30, target_layers=[-1, 0], block_size=3, markov_rank=4)
    with torch.no_grad():  # a Markov head that biases strongly: q_2 depends on the first drafted token
        drafter.markov_head.markov_w2.weight.normal_(std=20.0)
    conditionals = exact_conditionals(small_model, prompt, sampling)
    counts, accepted = speculative_samples(
        small_model, prompt, lambda: drafter.proposer(temperature=1.0), gamma=2, sampling=sampling
    )
    assert 0.1 * SAMPLES < accepted < 1.9 * SAMPLES
    pvalues = exactness_pvalues(counts, exact_joint(conditionals))
    assert min(pvalues.values()) > 1e-3, pvalues


# -- configuration ----------------------------------------------------------------------------------
def test_bad_settings_are_refused_in_one_line(model):
    for bad, fragment in [
        ({"markov_rank": 0}, "markov_rank must be >= 1"),
        ({"confidence_weight": -1.0}, "confidence_weight must be >= 0"),
        ({"tree_topk": 3}, "proposes chains only"),
        ({"block_size": 1}, "block_size must be >= 2"),
    ]:
        with pytest.raises(UserError, match=fragment):
            DSpark.Config(**{**TINY, **bad}).check(TargetShape.of(model, "tiny"))
    without = fitted_dspark(model, steps=1, confidence_head=False)
    assert not [name for name in without.state_dict() if name.startswith("confidence_head")]


def test_a_chain_longer_than_the_block_or_a_tree_is_refused_before_loading(tmp_path, capsys):
    for override, said in [("eval.num_speculative_tokens=8", "7"), ("eval.tree=16", "proposes chains only")]:
        args = ["train.py", "recipe=dspark", override, f"output_dir={tmp_path / 'run'}"]
        assert said in assert_one_line_error(run_entry_in_process(args, capsys), 2, prefix="error:")
        assert not (tmp_path / "run").exists()


# -- the real trainer -------------------------------------------------------------------------------
@pytest.mark.slow
def test_train_py_trains_resumes_and_evaluates_losslessly(tmp_path, small_data, token_cache, capsys):
    """`train.py recipe=dspark` lowers the loss with the target frozen, resumes from a checkpoint, and ends with an
    eval report whose chain is lossless at one draft forward per cycle."""
    run = tmp_path / "run"
    quick = ["data.max_length=96", "drafter.anchors=16", "drafter.markov_rank=16", "train.save_every=9"]
    args = ["recipe=dspark", *train_args(run, small_data, token_cache, "train.max_steps=12", *quick)[1:]]
    # two prompts (two domains) and no prompt-lookup baseline: the report's "all" chain row is read
    two = first_records(small_data["eval"], tmp_path / "eval.jsonl", 2)
    evaluated = [*args, f"data.eval=[{two}]", "eval.enabled=true", "eval.max_new_tokens=24"]
    evaluated.append("eval.ngram_baseline=false")
    assert run_entry_in_process(["train.py", *evaluated], capsys).returncode == 0
    log = read_log(run)
    assert sum(log[step]["train/loss"] for step in range(10, 13)) / 3 < 0.8 * log[1]["train/loss"]
    report = json.loads((run / "eval" / "report.json").read_text())
    rows = report["domains"]["all"]
    assert set(rows) == {"chain"} and rows["chain"]["lossless"]
    row = rows["chain"]
    draft_forwards = round(row["draft_forwards_per_cycle"] * row["target_forwards"])
    assert row["target_forwards"] - row["prompts"] <= draft_forwards <= row["target_forwards"]
    config = json.loads((run / "final" / "config.json").read_text())
    assert config["drafter_type"] == "dspark" and config["drafter"]["markov_rank"] == 16

    shutil.rmtree(run / "checkpoints" / "step_0000012")  # as if stopped after step 9: the resume trains 10..12
    shutil.rmtree(run / "final")
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true", "data.eval=[]"], capsys)  # no eval read
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr and "step_0000009" in resumed.stderr
    assert (run / "final").is_dir() and read_log(run)[12]["train/loss"] == pytest.approx(log[12]["train/loss"], 1e-3)
