"""heads/vocab_loss.py: the fused, chunked soft cross-entropy against an unfused reference (materialised
logits, log_softmax, autograd)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.heads.vocab_loss import chunk_rows_for, soft_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS, HIDDEN, VOCAB = 13, 8, 37


def problem(seed=0, rows=ROWS):
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, HIDDEN, generator=generator)
    weight = torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5
    teacher_logits = 2 * torch.randn(rows, VOCAB, generator=generator)
    return features, weight, teacher_logits


def reference(features, weight, teacher_logits, row_weight):
    """(loss, token_loss, best) unfused; rows of weight 0 are dropped before their teacher is read."""
    log_q = (features @ weight.T).float().log_softmax(-1)
    scored = row_weight != 0
    p = torch.zeros_like(log_q)
    p[scored] = teacher_logits[scored].float().softmax(-1)
    token_loss = -(p * log_q).sum(-1)
    return (row_weight * token_loss).sum(), token_loss, log_q.argmax(-1)


def slices(teacher_logits, calls=None):
    def teacher(start, stop):
        if calls is not None:
            calls.append((start, stop))
        return teacher_logits[start:stop]

    return teacher


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, ROWS, 64])
def test_loss_gradients_and_argmax_equal_the_unfused_ones(chunk_rows):
    features, weight, teacher_logits = problem()
    row_weight = 0.8 ** torch.arange(ROWS).float()  # TTT-like decays: weights other than 0/1
    row_weight[3] = 0.0
    features.requires_grad_(), weight.requires_grad_()
    calls = []
    fused = soft_cross_entropy(features, weight, slices(teacher_logits, calls), row_weight, chunk_rows)
    loss, token_loss, best = reference(features, weight, teacher_logits, row_weight)
    assert fused.loss.dtype == torch.float32 and fused.loss.shape == ()
    torch.testing.assert_close(fused.loss, loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(fused.token_loss, token_loss.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(fused.best, best) and fused.token_loss[3] == 0
    assert not fused.token_loss.requires_grad and not fused.best.requires_grad
    for got, expected in zip(grads(fused.loss, features, weight), grads(loss, features, weight)):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    # one teacher call per chunk, each at most chunk_rows rows: no [N, V] is built
    assert calls == [(start, min(start + chunk_rows, ROWS)) for start in range(0, ROWS, chunk_rows)]


def test_unscored_rows_with_all_minus_inf_teacher_logits_leak_no_nan():
    features, weight, teacher_logits = problem(seed=1)
    row_weight = torch.ones(ROWS)
    row_weight[[0, 6, 7]] = 0.0
    teacher_logits[[0, 6, 7]] = float("-inf")
    features.requires_grad_(), weight.requires_grad_()
    fused = soft_cross_entropy(features, weight, slices(teacher_logits), row_weight, 4)
    grad_features, grad_weight = grads(fused.loss, features, weight)
    for tensor in (fused.loss, fused.token_loss, grad_features, grad_weight):
        assert torch.isfinite(tensor).all()
    assert (fused.token_loss[[0, 6, 7]] == 0).all() and (grad_features[[0, 6, 7]] == 0).all()
    # the unscored rows add nothing to the weight's gradient either
    kept = row_weight != 0
    _, expected = grads(reference(features[kept], weight, teacher_logits[kept], row_weight[kept])[0], features, weight)
    torch.testing.assert_close(grad_weight, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("requires", ["features", "weight"])
def test_only_the_gradients_asked_for(requires):
    features, weight, teacher_logits = problem(seed=2)
    wanted = {"features": features, "weight": weight}[requires].requires_grad_()
    row_weight = torch.ones(ROWS)
    fused = soft_cross_entropy(features, weight, slices(teacher_logits), row_weight, 5)
    assert fused.loss.grad_fn.saved_tensors[requires == "features"] is None  # the other one was not computed
    (got,) = grads(fused.loss, wanted)
    (expected,) = grads(reference(features, weight, teacher_logits, row_weight)[0], wanted)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_no_grad_and_no_rows():
    features, weight, teacher_logits = problem(seed=3)
    features.requires_grad_(), weight.requires_grad_()
    row_weight = torch.ones(ROWS)
    with torch.no_grad():
        fused = soft_cross_entropy(features, weight, slices(teacher_logits), row_weight, 4)
    assert fused.loss.grad_fn is None
    torch.testing.assert_close(fused.loss, reference(features, weight, teacher_logits, row_weight)[0].detach())
    empty = soft_cross_entropy(features[:0], weight, slices(teacher_logits[:0]), row_weight[:0], 4)
    assert empty.loss == 0 and empty.token_loss.shape == empty.best.shape == (0,)
    (grad_weight,) = grads(empty.loss, weight)
    assert (grad_weight == 0).all()


def test_under_a_bf16_autocast_the_lm_head_runs_in_bf16():
    features, weight, teacher_logits = problem(seed=4)
    features.requires_grad_(), weight.requires_grad_()
    row_weight = torch.ones(ROWS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = soft_cross_entropy(features, weight, slices(teacher_logits.bfloat16()), row_weight, 5)
        loss = reference(features, weight, teacher_logits.bfloat16(), row_weight)[0]
    assert fused.loss.dtype == torch.float32
    torch.testing.assert_close(fused.loss, loss, rtol=1e-5, atol=0)  # the same bf16 logits, then float32
    got, expected = grads(fused.loss, features, weight), grads(loss, features, weight)
    for got_grad, expected_grad, tensor in zip(got, expected, (features, weight)):
        assert got_grad.dtype == tensor.dtype
        torch.testing.assert_close(got_grad, expected_grad, rtol=1e-2, atol=1e-2)


def test_chunk_rows_for():
    assert chunk_rows_for(1 << 27, 32000) == 1048
    assert chunk_rows_for(16, 32000) == 1
