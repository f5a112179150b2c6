"""heads/vocab_loss.py: the fused, chunked soft cross-entropy against an unfused reference (materialised
logits, log_softmax, autograd), its per-row losses' gradient too, its hard-label case against it on one-hot
teachers, its labels' top-5 hits against a stable sort (tied logits too), and the chunked loss over a model's
logits (`rows_loss`) against the same per-row loss on the whole tensor; the compiled chunk math
(`train.compile_vocab_loss`) against the eager one, at the function and through the real trainer."""

from __future__ import annotations

import pytest
import torch

from draftsmith.heads.distill import forward_kl, reverse_kl
from draftsmith.heads.vocab_loss import (
    TOP_K,
    _label_in_top,
    _label_rank,
    at_rows,
    chunk_rows_for,
    compiled_chunk_math,
    cross_entropy,
    rows_loss,
    soft_cross_entropy,
)

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, HIDDEN, VOCAB = 13, 8, 37


def problem(seed=0, rows=ROWS):
    """Features, an lm_head weight and the teacher's distributions."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    teacher_probs = (2 * torch.randn(rows, VOCAB, generator=generator)).softmax(-1)
    return features, weight, teacher_probs


def reference(features, weight, teacher_probs, row_weight):
    """(loss, token_loss, best) unfused; rows of weight 0 have loss 0 and best -1."""
    log_q = (features @ weight.T).float().log_softmax(-1)
    scored = row_weight != 0
    token_loss = torch.where(scored, -(teacher_probs * log_q).sum(-1), 0.0)
    return (row_weight * token_loss).sum(), token_loss, torch.where(scored, log_q.argmax(-1), -1)


def rows_of(teacher_probs, calls=None):
    def teacher(index):
        if calls is not None:
            calls.append(index.tolist())
        return teacher_probs[index]

    return teacher


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
@pytest.mark.parametrize("chunk_rows", [1, 4, 5, ROWS, 64])
def test_loss_gradients_and_argmax_equal_the_unfused_ones(chunk_rows, every_row):
    """Every row at a fixed shape (an accelerator's way) or the scored rows only (a CPU's): the same results."""
    features, weight, teacher_probs = problem()
    row_weight = 0.8 ** torch.arange(ROWS).float()  # TTT-like decays: weights other than 0/1
    row_weight[3] = 0.0
    features.requires_grad_(), weight.requires_grad_()
    calls = []
    fused = soft_cross_entropy(features, weight, rows_of(teacher_probs, calls), row_weight, chunk_rows, every_row)
    loss, token_loss, best = reference(features, weight, teacher_probs, row_weight)
    assert fused.loss.dtype == torch.float32 and fused.loss.shape == ()
    torch.testing.assert_close(fused.loss, loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(fused.token_loss, token_loss.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(fused.best, best) and fused.token_loss[3] == 0 and fused.best[3] == -1
    assert fused.token_loss.requires_grad and not fused.best.requires_grad  # token_loss: see the test below
    for got, expected in zip(grads(fused.loss, features, weight), grads(loss, features, weight)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # one teacher call per chunk, each at most chunk_rows rows: no [N, V] is built
    run = list(range(ROWS)) if every_row else [row for row in range(ROWS) if row != 3]
    assert calls == [run[start : start + chunk_rows] for start in range(0, len(run), chunk_rows)]


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
@pytest.mark.parametrize("hard", [False, True], ids=["soft", "hard-label"])
def test_the_per_row_losses_have_the_unfused_gradient(hard, every_row):
    """token_loss is differentiable w.r.t. the features (DFlash's D-PACE weighs it by weights made from it): a
    weighted sum of it, alone or beside `loss`, has the unfused gradient, and an unscored row gets none."""
    features, weight, teacher_probs = problem(seed=9)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(9))
    if hard:
        teacher_probs = torch.eye(VOCAB)[labels]
    row_weight = 0.8 ** torch.arange(ROWS).float()
    row_weight[[2, 9]] = 0.0
    per_row = torch.rand(ROWS, generator=torch.Generator().manual_seed(10))
    features.requires_grad_()
    if hard:
        fused = cross_entropy(features, weight, labels, row_weight, 4, every_row)
    else:
        fused = soft_cross_entropy(features, weight, rows_of(teacher_probs), row_weight, 4, every_row)
    loss, token_loss, _ = reference(features, weight, teacher_probs, row_weight)
    for got, expected in [
        ((per_row * fused.token_loss).sum(), (per_row * token_loss).sum()),
        (3 * fused.loss - (per_row * fused.token_loss).sum(), 3 * loss - (per_row * token_loss).sum()),
    ]:
        (got_grad,) = torch.autograd.grad(got, features, retain_graph=True)
        (expected_grad,) = torch.autograd.grad(expected, features, retain_graph=True)
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-4, atol=1e-6)
        assert (got_grad[[2, 9]] == 0).all()


def test_a_gradient_through_the_per_row_losses_to_the_weight_is_refused():
    """The lm_head weight's gradient is summed in the forward for `loss` alone: a trainable weight trains through
    `loss`, a statistic of token_loss beside it changes nothing, and a backward through token_loss to it is a
    programming error, refused rather than wrong."""
    features, weight, teacher_probs = problem(seed=11)
    weight.requires_grad_()
    fused = soft_cross_entropy(features, weight, rows_of(teacher_probs), torch.ones(ROWS), 4)
    statistic = fused.token_loss.mean()  # as Medusa's per-document losses, never backpropagated
    (got,) = torch.autograd.grad(fused.loss, weight, retain_graph=True)
    (expected,) = grads(reference(features, weight, teacher_probs, torch.ones(ROWS))[0], weight)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    with pytest.raises(RuntimeError, match="a gradient through `token_loss` cannot reach the weight"):
        statistic.backward()


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
def test_unscored_rows_add_nothing_whatever_their_teacher_holds(every_row):
    """A row of weight 0 may hold any finite distribution (EAGLE-3 gives zeros where the target's argmax
    is not a draft token): no loss, no gradient, no argmax; the scored rows' results are unchanged."""
    features, weight, teacher_probs = problem(seed=1)
    row_weight = torch.ones(ROWS)
    row_weight[[0, 6, 7]] = 0.0
    teacher_probs[[0, 6]] = 0.0
    teacher_probs[7] = 5.0
    features.requires_grad_(), weight.requires_grad_()
    fused = soft_cross_entropy(features, weight, rows_of(teacher_probs), row_weight, 4, every_row)
    grad_features, grad_weight = grads(fused.loss, features, weight)
    assert (fused.token_loss[[0, 6, 7]] == 0).all() and (grad_features[[0, 6, 7]] == 0).all()
    assert (fused.best[[0, 6, 7]] == -1).all()
    kept = row_weight != 0
    _, expected = grads(reference(features[kept], weight, teacher_probs[kept], row_weight[kept])[0], features, weight)
    torch.testing.assert_close(grad_weight, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("requires", ["features", "weight"])
def test_only_the_gradients_asked_for(requires):
    features, weight, teacher_probs = problem(seed=2)
    wanted = {"features": features, "weight": weight}[requires].requires_grad_()
    row_weight = torch.ones(ROWS)
    fused = soft_cross_entropy(features, weight, rows_of(teacher_probs), row_weight, 5)
    assert fused.loss.grad_fn.saved_tensors[requires == "features"] is None  # the other one was not computed
    (got,) = grads(fused.loss, wanted)
    (expected,) = grads(reference(features, weight, teacher_probs, row_weight)[0], wanted)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_no_grad_and_no_rows():
    features, weight, teacher_probs = problem(seed=3)
    features.requires_grad_(), weight.requires_grad_()
    row_weight = torch.ones(ROWS)
    with torch.no_grad():
        fused = soft_cross_entropy(features, weight, rows_of(teacher_probs), row_weight, 4)
    assert fused.loss.grad_fn is None
    torch.testing.assert_close(fused.loss, reference(features, weight, teacher_probs, row_weight)[0].detach())
    empty = soft_cross_entropy(features[:0], weight, rows_of(teacher_probs[:0]), row_weight[:0], 4)
    assert empty.loss == 0 and empty.token_loss.shape == empty.best.shape == (0,)
    (grad_weight,) = grads(empty.loss, weight)
    assert (grad_weight == 0).all()


def test_under_a_bf16_autocast_the_lm_head_runs_in_bf16():
    features, weight, teacher_probs = problem(seed=4)
    features.requires_grad_(), weight.requires_grad_()
    row_weight = torch.ones(ROWS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = soft_cross_entropy(features, weight, rows_of(teacher_probs), row_weight, 5)
        loss = reference(features, weight, teacher_probs, row_weight)[0]
    assert fused.loss.dtype == torch.float32
    torch.testing.assert_close(fused.loss, loss, rtol=1e-5, atol=0)  # the same bf16 logits, then float32
    got, expected = grads(fused.loss, features, weight), grads(loss, features, weight)
    for got_grad, expected_grad, tensor in zip(got, expected, (features, weight)):
        assert got_grad.dtype == tensor.dtype
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-2, atol=1e-2)


def test_bf16_weights_without_autocast_train_in_bf16():
    """DeepSpeed's bf16 keeps the drafter's weights in bf16 and runs no autocast: the lm_head's weight gradient
    is a bf16 GEMM of the logits' gradient and the row-weighted features (a float32 row weight does not make
    it a float32 one: the GPU tier's ZeRO-2/3 runs failed on that), equal to the float32 one to bf16 rounding."""
    features, weight, teacher_probs = problem(seed=5)
    row_weight = torch.rand(ROWS)
    low = [tensor.bfloat16().requires_grad_() for tensor in (features, weight)]
    fused = soft_cross_entropy(low[0], low[1], rows_of(teacher_probs), row_weight, 5)
    loss = reference(features.requires_grad_(), weight.requires_grad_(), teacher_probs, row_weight)[0]
    torch.testing.assert_close(fused.loss, loss, rtol=2e-2, atol=2e-2)
    for got, expected in zip(grads(fused.loss, *low), grads(loss, features, weight)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected, rtol=5e-2, atol=5e-2)


def test_chunk_rows_for():
    assert chunk_rows_for(1 << 27, 32000) == 1048
    assert chunk_rows_for(16, 32000) == 1


def stable_ranks(logits, labels):
    """Each label's place in its row's stable descending sort: ties go to the lower index, as argmax's."""
    order = logits.sort(dim=-1, descending=True, stable=True).indices
    return (order == labels[:, None]).int().argmax(-1)


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
@pytest.mark.parametrize("chunk_rows", [1, 4, ROWS])
@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
def test_the_hard_label_loss_is_the_one_hot_soft_one_value_for_value(chunk_rows, every_row, autocast):
    """`cross_entropy` (a gather, no teacher's rows) gives soft_cross_entropy's results on one-hot teachers: the
    same loss, per-row losses, argmax and gradients, bit for bit; unscored rows hold any valid token."""
    features, weight, _ = problem(seed=7)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(7))
    row_weight = 0.8 ** torch.arange(ROWS).float()
    row_weight[[3, 8]] = 0.0
    results = []
    for hard in (True, False):
        inputs = [features.clone().requires_grad_(), weight.clone().requires_grad_()]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if hard:
                fused = cross_entropy(*inputs, labels, row_weight, chunk_rows, every_row)
            else:
                one_hot = rows_of(torch.eye(VOCAB)[labels])
                fused = soft_cross_entropy(*inputs, one_hot, row_weight, chunk_rows, every_row)
        results.append((fused.loss.detach(), fused.token_loss, fused.best, *grads(fused.loss, *inputs)))
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
def test_the_top5_hits_are_a_stable_sorts_first_five_without_a_second_product(every_row):
    """top_k: the label among the row's 5 highest logits, ties going to the lower index (a right argmax is a
    hit); False unscored and where not asked for."""
    assert TOP_K == 5
    features, weight, _ = problem(seed=6)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=torch.Generator().manual_seed(6))
    logits = features @ weight.T
    labels[5] = logits[5].argmax()  # a top-1 hit
    labels[6] = logits[6].topk(5).indices[-1]  # the 5th highest: a hit
    labels[7] = logits[7].topk(6).indices[-1]  # the 6th: a miss
    row_weight = torch.ones(ROWS)
    row_weight[2] = 0.0
    fused = cross_entropy(features, weight, labels, row_weight, 4, every_row, top_k=True)
    expected = stable_ranks(logits, labels) < 5
    expected[2] = False
    assert torch.equal(fused.top_k, expected) and fused.top_k[[5, 6]].all() and not fused.top_k[7]
    assert not cross_entropy(features, weight, labels, row_weight, 4, every_row).top_k.any()

    tied = torch.zeros(2, VOCAB)  # every logit equal: the first five indices are the top 5
    hits = cross_entropy(tied, torch.eye(VOCAB), torch.tensor([4, 5]), torch.ones(2), 2, every_row, top_k=True)
    assert hits.top_k.tolist() == [True, False]


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_top5_shortcut_is_the_full_rank_on_tied_logits(every_row, dtype):
    """The k+1 highest values decide (`_label_in_top`, scored rows: a CPU's way) what the full rank (`_label_rank`
    < k, every row's way) does, ties at the k-th place included: logits drawn from a few values tie everywhere,
    labels at every place."""
    generator = torch.Generator().manual_seed(8)
    for values, vocab in [(3, 40), (8, 40), (50, 200), (4, 6), (2, 5), (2, 3)]:
        logits = torch.randint(0, values, (400, vocab), generator=generator).to(dtype)
        labels = torch.randint(0, vocab, (400,), generator=generator)
        for k in (1, 5):
            expected = stable_ranks(logits, labels) < k
            assert torch.equal(_label_rank(logits, labels) < k, expected)
            assert torch.equal(_label_in_top(logits, labels, k, every_row), expected), (values, vocab, k)


def divergence_problem(seed=0):
    """Logits [B, T, V] as a model gives them (a non-contiguous view of a longer tensor), a teacher's, and
    which positions are scored; the teacher is top-k-like (-inf) at two unscored positions."""
    generator = torch.Generator().manual_seed(seed)
    longer = torch.randn(2, 9, VOCAB, generator=generator)
    teacher = 2 * torch.randn(2, 7, VOCAB, generator=generator)
    scored = torch.rand(2, 7, generator=generator) < 0.6
    scored[0, 1] = scored[1, 4] = False
    teacher[0, 1, 3:] = teacher[1, 4, :-1] = float("-inf")  # rkl is infinite there
    return longer, teacher, scored


def rkl_rows(teacher, calls=None):
    def per_row(rows, index, stats):
        if calls is not None:
            calls.append(len(index))
        rows, theirs = rows.float(), at_rows(teacher, index).float()
        loss = reverse_kl(rows, theirs) + forward_kl(rows, theirs, 2.0)
        return loss, {"rkl": reverse_kl(rows, theirs), "top1": rows.argmax(-1) == theirs.argmax(-1)} if stats else {}

    return per_row


@pytest.mark.parametrize("every_row", [True, False], ids=["every-row", "scored-rows"])
@pytest.mark.parametrize("chunk_rows", [1, 3, 14])
def test_rows_loss_equals_the_loss_on_every_position_at_once(chunk_rows, every_row):
    """The chunked loss, its statistics and its gradient equal the per-row loss on the whole tensor (what the
    draft model and Medusa-2 computed before): unscored positions count nothing and get a zero gradient, even
    where their loss is infinite; no call sees more than `chunk_rows` rows, and the backward recomputes."""
    longer, teacher, scored = divergence_problem()
    longer.requires_grad_()
    logits = longer[:, 1:8]
    calls = []
    loss, values = rows_loss(logits, scored, rkl_rows(teacher, calls), chunk_rows, every_row)
    (grad,) = grads(loss, longer)
    rows = scored.numel() if every_row else int(scored.sum())
    assert max(calls) <= chunk_rows and sum(calls) == 2 * rows  # forward and backward, chunk by chunk

    whole, theirs = logits.float(), teacher.float()
    expected_loss = torch.where(scored, reverse_kl(whole, theirs) + forward_kl(whole, theirs, 2.0), 0.0).sum()
    (expected_grad,) = grads(expected_loss, longer)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=0)
    assert torch.isfinite(grad).all() and (grad[0, 2] == 0).all() and (grad[1, 5] == 0).all()
    kept = scored[:, :, None].expand_as(logits)
    torch.testing.assert_close(grad[:, 1:8][kept], expected_grad[:, 1:8][kept], rtol=1e-5, atol=1e-7)
    assert (grad[:, 1:8][~kept] == 0).all() and (grad[:, [0, 8]] == 0).all()
    assert values.keys() == {"rkl", "top1"} and all(value.shape == scored.shape for value in values.values())
    torch.testing.assert_close(values["rkl"], torch.where(scored, reverse_kl(whole, theirs), 0.0).detach())
    assert torch.equal(values["top1"], (scored & (whole.argmax(-1) == theirs.argmax(-1))).float())


def test_rows_loss_under_no_grad_and_in_bf16():
    longer, teacher, scored = divergence_problem(seed=1)
    with torch.no_grad():
        loss, _ = rows_loss(longer[:, 1:8], scored, rkl_rows(teacher), 4)
    assert loss.grad_fn is None
    low = longer.bfloat16().requires_grad_()
    loss, _ = rows_loss(low[:, 1:8], scored, rkl_rows(teacher), 4)
    (grad,) = grads(loss, low)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16  # float32 math, the logits' own dtype back


def fused_results(hard: bool, chunk_rows: int, every_row: bool, autocast: bool):
    """The fused loss's outputs on one problem with some unscored rows, and its gradients."""
    features, weight, teacher_probs = problem(seed=11, rows=29)
    labels = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(11))
    row_weight = 0.8 ** torch.arange(29).float()
    row_weight[[0, 7, 8]] = 0.0
    inputs = [features.requires_grad_(), weight.requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if hard:
            fused = cross_entropy(*inputs, labels, row_weight, chunk_rows, every_row)
        else:
            fused = soft_cross_entropy(*inputs, rows_of(teacher_probs), row_weight, chunk_rows, every_row)
    return fused.loss.detach(), fused.token_loss.detach(), fused.best, *grads(fused.loss, *inputs)


@pytest.mark.slow  # compiles two graphs per variant, 1-2 s each
def test_the_compiled_chunk_math_gives_the_eager_results_with_two_graphs_per_variant_at_most():
    """Soft and hard labels, float32 and a bf16 autocast, every row or the scored ones, chunks of any size (the last
    one shorter, of one row too): the compiled math's losses, argmax and gradients are the eager ones to float32
    rounding, and it compiles at most two graphs per variant (chunks of one row, which torch specializes, and the
    rest) whatever the chunk sizes."""
    from torch._dynamo.utils import counters

    variants = [(hard, autocast) for hard in (False, True) for autocast in (False, True)]
    before = counters["stats"]["unique_graphs"]
    for hard, autocast in variants:
        for chunk_rows, every_row in ((4, True), (5, False), (29, True), (64, False)):
            eager = fused_results(hard, chunk_rows, every_row, autocast)
            with compiled_chunk_math():
                compiled = fused_results(hard, chunk_rows, every_row, autocast)
            assert torch.equal(compiled[2], eager[2])  # the argmax
            for got, expected in zip(compiled[:2] + compiled[3:], eager[:2] + eager[3:]):
                tolerance = 2e-2 if autocast and got.dtype == torch.bfloat16 else 1e-5
                torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert counters["stats"]["unique_graphs"] - before <= 2 * len(variants)


@pytest.mark.slow  # two short trainings, one compiling its loss's graph
def test_the_trainer_with_the_compiled_loss_logs_the_eager_losses(tmp_path, small_data, token_cache, monkeypatch):
    """`train.py recipe=eagle3 train.compile_vocab_loss=true` runs its loss's chunks through the compiled math and
    trains as the eager math does: the same losses at every step to float32 rounding."""
    from draftsmith.heads import vocab_loss
    from tests.helpers import read_log, train_args, train_in_process

    chunks, compiled_math = [], vocab_loss.compiled_math
    monkeypatch.setattr(vocab_loss, "compiled_math", lambda *args: chunks.append(1) or compiled_math(*args))
    losses, counted = [], []
    for compiled in ("false", "true"):
        run = tmp_path / compiled
        args = train_args(run, small_data, token_cache, "train.max_steps=3", f"train.compile_vocab_loss={compiled}")
        train_in_process(["recipe=eagle3", *args[1:], "drafter.ttt_steps=2"])
        losses.append([read_log(run)[step]["train/loss"] for step in (1, 2, 3)])
        counted.append(len(chunks))
    assert counted[0] == 0 and counted[1] >= 3  # every step's loss ran compiled, and only where asked
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
