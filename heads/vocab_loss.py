"""A fused, chunked soft cross-entropy over a (draft) vocabulary: `soft_cross_entropy`.

For rows i of output features f_i [H] and an lm_head weight W [V, H] it scores the draft's
distribution q_i = softmax(f_i @ W.T) against a teacher's p_i = softmax(float32(teacher logits i)):
CE_i = -(p_i * log q_i).sum(), loss = sum_i row_weight[i] * CE_i, and gives each row's argmax.

What makes it exact: for a scored row p_i sums to 1, so d CE_i / d logits_i = softmax(logits_i) - p_i
(the log-softmax's normaliser contributes softmax * sum(p) = softmax). The forward therefore has
everything the backward needs: walking the rows `chunk_rows` at a time, it computes the chunk's logits,
its losses and argmax, the gradient of the weighted loss w.r.t. the logits
g = row_weight[:, None] * (softmax - p), and from g the chunk's gradient w.r.t. the features (g @ W)
and its contribution to the gradient w.r.t. W (g.T @ f). The backward only scales the stored
gradients by the loss's incoming gradient: nothing is recomputed, unlike activation checkpointing,
which runs the lm_head forward twice.

Memory held: while a chunk runs, a few [chunk_rows, V] float32 temporaries (logits, then their
log-softmax, softmax and g in the same buffer; the teacher's p; the product p * log q; the teacher's
logits as the teacher returns them; under autocast, the bf16 logits and g); between forward and backward, the gradients w.r.t. the features ([N, H], in the
features' dtype) and the weight ([V, H], float32), only those whose inputs require grad.

This is the CPU path and the numerical reference for a later fused GPU kernel (the logits chunk
staying in on-chip memory); see docs/performance.md "The vocabulary loss".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F


class VocabLoss(NamedTuple):
    loss: torch.Tensor  # scalar float32: sum_i row_weight[i] * CE_i, differentiable w.r.t. features and weight
    token_loss: torch.Tensor  # [N] float32, detached: CE_i, 0 where row_weight[i] == 0
    best: torch.Tensor  # [N] long, detached: the first argmax of features_i @ weight.T


def chunk_rows_for(budget_bytes: int, vocab: int) -> int:
    """Rows whose float32 [rows, vocab] logits fit in `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // (4 * vocab))


def soft_cross_entropy(
    features: torch.Tensor,
    weight: torch.Tensor,
    teacher: Callable[[int, int], torch.Tensor],
    row_weight: torch.Tensor,
    chunk_rows: int,
) -> VocabLoss:
    """Soft cross-entropy of softmax(features @ weight.T) ([N, H] @ [H, V]) against the teacher's
    softmax, `chunk_rows` rows at a time (module docstring).

    `teacher(start, stop)` gives the teacher's logits over the same V for rows start:stop ([stop - start,
    V], any dtype); it is called once per chunk, under no_grad. `row_weight` [N] weighs each row in
    `loss`; a row of weight 0 is not scored, and its teacher logits may be anything (all -inf
    included): its token_loss and gradients are exactly 0. The lm_head GEMMs run as F.linear would
    (in bf16 under a bf16 autocast); everything past them runs in float32."""
    grad_enabled = torch.is_grad_enabled()
    return VocabLoss(
        *_SoftCrossEntropy.apply(
            features,
            weight,
            teacher,
            row_weight,
            chunk_rows,
            grad_enabled and features.requires_grad,
            grad_enabled and weight.requires_grad,
        )
    )


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, weight, teacher, row_weight, chunk_rows, features_grad, weight_grad):
        row_weight = row_weight.float()
        scored = row_weight != 0
        token_loss = torch.empty(len(features), dtype=torch.float32, device=features.device)
        best = torch.empty(len(features), dtype=torch.long, device=features.device)
        grad_features = torch.empty_like(features) if features_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
        for start in range(0, len(features), chunk_rows):
            stop = min(start + chunk_rows, len(features))
            chunk = features[start:stop]
            logits = F.linear(chunk, weight)
            gemm_dtype = logits.dtype  # bf16 under a bf16 autocast
            logits = logits.float()
            # max(-1).indices: argmax's (the first maximum), about twice as fast on CPU
            best[start:stop] = logits.max(-1).indices
            log_q = logits.sub_(logits.logsumexp(-1, keepdim=True))
            # where, not a product: an unscored row's teacher softmax may be NaN (all -inf logits)
            p = teacher(start, stop).float().softmax(-1).masked_fill_(~scored[start:stop, None], 0.0)
            token_loss[start:stop] = -(p * log_q).sum(-1)  # a product: vecdot and bmm would autocast to bf16
            if not (features_grad or weight_grad):
                continue
            g = log_q.exp_().sub_(p).mul_(row_weight[start:stop, None]).to(gemm_dtype)
            if features_grad:
                grad_features[start:stop] = torch.mm(g, weight)
            if weight_grad:
                if g.dtype == grad_weight.dtype:
                    grad_weight.addmm_(g.T, chunk)
                else:  # a low-precision GEMM, accumulated in float32
                    grad_weight += torch.mm(g.T, chunk)
        ctx.save_for_backward(grad_features, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(token_loss, best)
        return (row_weight * token_loss).sum(), token_loss, best

    @staticmethod
    def backward(ctx, grad_loss, grad_token_loss, grad_best):
        grad_features, grad_weight = ctx.saved_tensors
        if grad_features is not None:
            grad_features = grad_features * grad_loss
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_features, grad_weight, None, None, None, None, None
