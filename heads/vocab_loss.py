"""A fused, chunked soft cross-entropy over a (draft) vocabulary: `soft_cross_entropy`, and its hard-label case
`cross_entropy`.

For rows i of output features f_i [H] and an lm_head weight W [V, H] it scores the draft's
distribution q_i = softmax(f_i @ W.T) against a teacher's distribution p_i:
CE_i = -(p_i * log q_i).sum(), loss = sum_i row_weight[i] * CE_i, and gives each row's argmax.

What makes it exact: for a scored row p_i sums to 1, so d CE_i / d logits_i = softmax(logits_i) - p_i
(the log-softmax's normaliser contributes softmax * sum(p) = softmax). The forward therefore has
everything the backward needs: walking the rows `chunk_rows` at a time, it computes the chunk's logits,
their log-softmax, the losses and the argmax, the gradient w.r.t. the logits g = softmax - p (in the
logits' buffer), and from g the chunk's gradient w.r.t. the features (row_weight * (g @ W)) and its
contribution to the gradient w.r.t. W (g.T @ (row_weight * f)); the row weights scale [rows, H]
tensors, never [rows, V] ones. The backward only scales the stored gradients by the incoming ones: nothing
is recomputed, unlike activation checkpointing, which runs the lm_head forward twice. The features' gradient
is stored per row unweighted (g @ W), so the per-row losses are differentiable too: the backward scales row i
by grad_loss * row_weight[i] + grad_token_loss[i] (D-PACE weighs each row by a weight made from this very
pass's losses). The weight's gradient is summed over the rows in the forward, so it follows `loss` alone: a
gradient reaching it through `token_loss` is refused.
Against a token (`cross_entropy`, p one-hot) no teacher's rows are built: CE_i is the log-softmax at the
label, a gather, and g the softmax less 1 at the label, the same values as the one-hot teacher's.

Which rows run (`row_chunks`, for every loss here): on a CPU, where reading a count costs nothing, only the
scored rows (row_weight != 0) go through the GEMMs; on an accelerator every row does, at a fixed shape, so
nothing waits for the host.

Memory held: while a chunk runs, two [chunk_rows, V] float32 buffers (the logits, turned into their
log-softmax and then into g; the teacher's rows, none against a token); between forward and backward, the
gradients w.r.t. the features ([N, H], in the features' dtype) and the weight ([V, H], float32), only those
whose inputs require grad.

This is the CPU path and the numerical reference for a fused GPU kernel (the logits chunk staying in
on-chip memory); see docs/performance.md "The vocabulary loss". Within `compiled_chunk_math()` (the trainer's
`train.compile_vocab_loss`) each chunk's math past the lm_head GEMM (argmax, log-softmax, the losses, softmax - p)
runs as one torch.compile graph for every chunk size (inductor's kernels: Triton on a GPU, C++ on a CPU), which
reads and writes the [chunk_rows, V] rows about three times where the eager ops take about ten passes; the GEMMs,
the teacher's rows and the top-k hits stay as they are.

`rows_loss` chunks a loss over logits a model already produced (a draft model's, Medusa-2's adapted target's):
per-row values such as the divergences of heads/distill.py run `chunk_rows` rows at a time, so no [rows, V]
float32 temporary covers every position; their gradient is recomputed chunk by chunk in the backward, which
holds nothing between forward and backward but the logits themselves. While a chunk runs: its per-row
function's few [chunk_rows, V] float32 temporaries (the divergences' softmaxes); in the backward, also the
gradient w.r.t. the logits, in their dtype, which any backward through them allocates.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from draftsmith.heads.base import per_sample_stats
from draftsmith.heads.packing import documents, num_documents, same_document, shifted


class VocabLoss(NamedTuple):
    loss: torch.Tensor  # scalar float32: sum_i row_weight[i] * CE_i, differentiable w.r.t. features and weight
    # [N] float32: CE_i, 0 where row_weight[i] == 0; differentiable w.r.t. the features only (module docstring)
    token_loss: torch.Tensor
    best: torch.Tensor  # [N] long, detached: the first argmax of features_i @ weight.T, -1 where row_weight[i] == 0
    # [N] bool, detached: whether labels[i] is among row i's TOP_K highest logits, ties going to the lower index (as
    # argmax's first maximum: a right `best` is a hit); False where row_weight[i] == 0 or not asked for
    # (`cross_entropy(..., top_k=True)`)
    top_k: torch.Tensor


TOP_K = 5  # `VocabLoss.top_k`'s k: Medusa's top-5 statistic


def chunk_rows_for(budget_bytes: int, vocab: int) -> int:
    """Rows whose float32 [rows, vocab] logits fit in `budget_bytes` (at least 1)."""
    return max(1, budget_bytes // (4 * vocab))


def row_chunks(row_weight: torch.Tensor, chunk_rows: int, every_row: Optional[bool] = None) -> tuple[torch.Tensor, ...]:
    """The row indices a chunked loss runs, `chunk_rows` at a time: every row (fixed shapes) or only the scored
    ones (row_weight != 0); None: every row on an accelerator, the scored ones on a CPU, where counting them
    waits for nothing."""
    if runs_every_row(row_weight, every_row):
        return torch.arange(len(row_weight), device=row_weight.device).split(chunk_rows)
    return row_weight.nonzero().squeeze(1).split(chunk_rows)


def runs_every_row(row_weight: torch.Tensor, every_row: Optional[bool]) -> bool:
    """`every_row` (`row_chunks`), None resolved by the rows' device: every row on an accelerator."""
    return row_weight.device.type != "cpu" if every_row is None else every_row


def soft_cross_entropy(
    features: torch.Tensor,
    weight: torch.Tensor,
    teacher: Callable[[torch.Tensor], torch.Tensor],
    row_weight: torch.Tensor,
    chunk_rows: int,
    every_row: Optional[bool] = None,
) -> VocabLoss:
    """Soft cross-entropy of softmax(features @ weight.T) ([N, H] @ [H, V]) against the teacher's
    distribution, `chunk_rows` rows at a time (module docstring).

    `teacher(rows)` gives the teacher's probabilities at the rows `rows` (a long tensor of row indices,
    at most `chunk_rows` of them), [len(rows), V] float32: summing to 1 on a scored row, finite
    everywhere. It is called once per chunk, under no_grad. `row_weight` [N] weighs each row in `loss`;
    a row of weight 0 is not scored: its token_loss and gradients are exactly 0 and its best -1. The
    lm_head GEMMs run as F.linear would (in bf16 under a bf16 autocast); everything past them runs in
    float32. `every_row`: see `row_chunks`."""
    return _fused_loss(features, weight, teacher, None, row_weight, chunk_rows, every_row, False)


def cross_entropy(
    features: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    row_weight: torch.Tensor,
    chunk_rows: int,
    every_row: Optional[bool] = None,
    top_k: bool = False,
) -> VocabLoss:
    """Cross-entropy of softmax(features @ weight.T) to each row's token `labels` [N] long (valid token ids on
    every row, scored or not): `soft_cross_entropy` to one-hot teachers, the same values, without building them
    (module docstring). `top_k`: also whether each label is among its row's TOP_K highest logits
    (`VocabLoss.top_k`), read off the logits the loss computes anyway: no second lm_head product."""
    return _fused_loss(features, weight, None, labels, row_weight, chunk_rows, every_row, top_k)


def _fused_loss(features, weight, teacher, labels, row_weight, chunk_rows, every_row, top_k) -> VocabLoss:
    """`soft_cross_entropy` (`teacher`, labels None) or `cross_entropy` (teacher None, `labels`)."""
    grad_enabled = torch.is_grad_enabled()
    every_row = runs_every_row(row_weight, every_row)
    return VocabLoss(
        *_FusedCrossEntropy.apply(
            features,
            weight,
            teacher,
            labels,
            row_weight,
            row_chunks(row_weight, chunk_rows, every_row),
            every_row,
            top_k,
            grad_enabled and features.requires_grad,
            grad_enabled and weight.requires_grad,
        )
    )


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, -1) for [n, V] float32 rows without an [n, V] temporary, in float32 whatever autocast says."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.bmm(a[:, None, :], b[:, :, None]).view(-1)


def _label_rank(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[n] int32: how many of each row's logits rank above its label's, ties going to the lower index (as
    argmax's first maximum does), so rank 0 is the argmax; in a function, so its [n, V] masks are freed at once."""
    at = logits.gather(1, labels[:, None])
    vocab = torch.arange(logits.shape[1], device=logits.device)
    return ((logits > at) | ((logits == at) & (vocab < labels[:, None]))).sum(-1, dtype=torch.int32)


def _label_in_top(logits: torch.Tensor, labels: torch.Tensor, k: int, every_row: bool) -> torch.Tensor:
    """[n] bool: `_label_rank(logits, labels) < k`. With `every_row` (an accelerator's way, `row_chunks`) the rank
    itself, at a fixed shape. Otherwise (a CPU's) from each row's k+1 highest values, one pass over the logits
    where the rank takes five: fewer than k logits exceed the label's iff it is at least the k-th highest, and
    then it ranks within k unless the (k+1)-th highest equals it too, where the indices of the tied logits
    decide: only those rows, counted (a host sync, free on a CPU), are ranked in full."""
    if every_row:
        return _label_rank(logits, labels) < k
    if logits.shape[1] <= k:
        return torch.ones(len(labels), dtype=torch.bool, device=labels.device)
    at = logits.gather(1, labels[:, None])[:, 0]
    highest = logits.topk(k + 1, -1).values  # sorted: highest[:, k - 1] is the k-th highest
    hit = at >= highest[:, k - 1]
    tied = hit & (at == highest[:, k])
    rows = tied.nonzero().squeeze(1)
    return hit.index_put_((rows,), _label_rank(logits.index_select(0, rows), labels.index_select(0, rows)) < k)


# Whether the chunk math runs compiled: a context, as autocast is, so that it holds for the trainer's forward
# and nothing else in the process (tests train many runs in one).
_COMPILED = contextvars.ContextVar("compiled_chunk_math", default=False)
# The graphs one process may compile for the chunk math: shapes are dynamic, so only the variants (a teacher or
# labels, with or without the gradient, the logits' dtype) make new ones, two each at most (torch specializes a
# chunk of one row, which a last chunk can be); past it torch would run the math eagerly unannounced, which
# `compiled_math` turns into an error.
CHUNK_MATH_RECOMPILE_LIMIT = 32


@contextlib.contextmanager
def compiled_chunk_math(enabled: bool = True) -> Iterator[None]:
    """Within it (`enabled`), the fused loss's chunk math runs compiled (module docstring)."""
    token = _COMPILED.set(enabled)
    try:
        yield
    finally:
        _COMPILED.reset(token)


def _chunk_math(logits, p, labels, gradient: bool, fused: bool):
    """One chunk's math past the GEMM: each row's argmax (the first maximum), its loss against the teacher's
    probabilities `p` (or the token `labels`, p None) and, with `gradient`, d loss / d logits = softmax - p in the
    logits' dtype (else None). `fused`: written for a compiler, whose kernels need no [n, V] temporary for the
    dot product; eager, a bmm avoids it and the softmax overwrites the log-softmax in place."""
    best = logits.max(-1).indices  # argmax's first maximum, about twice as fast on CPU
    log_q = logits.float().log_softmax(-1)
    if p is None:  # a one-hot teacher's dot product with log_q: log_q at the label
        loss = -log_q.gather(1, labels[:, None])[:, 0]
    else:
        loss = -(p * log_q).sum(-1) if fused else -_row_dot(p, log_q)
    if not gradient:
        return loss, best, None
    g = log_q.exp() if fused else log_q.exp_()
    if p is None:  # the one-hot p: 1 at the label
        g = g.scatter_add(1, labels[:, None], torch.full_like(loss[:, None], -1.0))
    else:
        g = g - p if fused else g.sub_(p)
    return loss, best, g.to(logits.dtype)


def compiled_math(logits, p, labels, gradient: bool):
    """`_chunk_math` compiled, at most CHUNK_MATH_RECOMPILE_LIMIT graphs: past them torch would run it eagerly
    without a word; here it raises."""
    with torch._dynamo.config.patch(recompile_limit=CHUNK_MATH_RECOMPILE_LIMIT, fail_on_recompile_limit_hit=True):
        return _compiled_chunk_math()(logits, p, labels, gradient)


@functools.cache
def _compiled_chunk_math():
    return torch.compile(functools.partial(_chunk_math, fused=True), dynamic=True)


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, features, weight, teacher, labels, row_weight, chunks: tuple[torch.Tensor, ...], every_row, top_k, *wanted
    ):
        """`every_row`: whether `chunks` holds every row (`row_chunks`), which decides how the top-k hits are
        found (`_label_in_top`); `top_k`: whether they are wanted; `wanted`: whether the features' and the
        weight's gradients are."""
        features_grad, weight_grad = wanted
        row_weight = row_weight.float()
        token_loss = torch.zeros(len(features), dtype=torch.float32, device=features.device)
        best = torch.full((len(features),), -1, dtype=torch.long, device=features.device)
        in_top_k = torch.zeros(len(features), dtype=torch.bool, device=features.device)
        grad_features = torch.zeros_like(features) if features_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight_grad else None
        math = compiled_math if _COMPILED.get() else functools.partial(_chunk_math, fused=False)
        for index in chunks:
            chunk = features.index_select(0, index)
            scale = row_weight.index_select(0, index)[:, None]
            logits = F.linear(chunk, weight)  # bf16 under a bf16 autocast
            scored = scale[:, 0] != 0
            chunk_labels = None if labels is None else labels.index_select(0, index)
            if top_k:
                in_top_k.index_copy_(0, index, scored & _label_in_top(logits, chunk_labels, TOP_K, every_row))
            p = None if teacher is None else teacher(index)
            gradient = features_grad or weight_grad
            chunk_loss, chunk_best, g = math(logits, p, chunk_labels, gradient)
            token_loss.index_copy_(0, index, torch.where(scored, chunk_loss, 0.0))
            best.index_copy_(0, index, torch.where(scored, chunk_best, -1))
            if not gradient:
                continue
            if features_grad:  # per row, unweighted: the backward weighs it (module docstring)
                chunk_grad = torch.where(scored[:, None], torch.mm(g, weight), 0.0)  # nothing from an unscored row
                grad_features.index_copy_(0, index, chunk_grad.to(features.dtype))
            if weight_grad:
                weighted = (chunk * scale).to(g.dtype)  # bf16 weights without autocast (DeepSpeed): a bf16 GEMM
                if g.dtype == grad_weight.dtype:
                    grad_weight.addmm_(g.T, weighted)
                else:  # a low-precision GEMM, accumulated in float32
                    grad_weight += torch.mm(g.T, weighted)
        ctx.save_for_backward(grad_features, grad_weight, row_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(best, in_top_k)
        ctx.set_materialize_grads(False)  # None for an output the backward does not reach: `loss` or `token_loss`
        return (row_weight * token_loss).sum(), token_loss, best, in_top_k

    @staticmethod
    def backward(ctx, grad_loss, grad_token_loss, grad_best, grad_in_top_k):
        grad_features, grad_weight, row_weight = ctx.saved_tensors
        if grad_token_loss is not None and ctx.needs_input_grad[1]:
            raise RuntimeError(
                "the fused vocabulary loss sums the lm_head weight's gradient in its forward, for `loss` alone: "
                "a gradient through `token_loss` cannot reach the weight (backpropagate `loss`, or freeze the weight)"
            )
        if grad_features is not None:
            per_row = torch.zeros_like(row_weight) if grad_loss is None else grad_loss * row_weight
            if grad_token_loss is not None:
                per_row = per_row + grad_token_loss
            grad_features = grad_features * per_row[:, None].to(grad_features.dtype)
        if grad_weight is not None:
            grad_weight = None if grad_loss is None else (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_features, grad_weight, None, None, None, None, None, None, None, None


# per_row(rows, index, stats) -> (loss [n] float32, {name: [n] values} when `stats`, else {})
PerRow = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def at_rows(positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (flat: b * T + t) of a [B, T, ...] tensor, any view, as [len(index), ...]."""
    return positions[index // positions.shape[1], index % positions.shape[1]]


def rows_loss(
    logits: torch.Tensor, scored: torch.Tensor, per_row: PerRow, chunk_rows: int, every_row: Optional[bool] = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """sum over the scored positions of a per-row loss of logits [B, T, V] that a model produced (any view,
    any dtype), `chunk_rows` rows at a time (module docstring), and the per-row statistics.

    `per_row(rows, index, stats)` gets the logits at the flat positions `index` (b * T + t), [len(index), V]
    in their own dtype, and gives each row's loss (float32, differentiable w.r.t. `rows`) and, when `stats`,
    named per-row values. It runs under no_grad in the forward (with stats) and again with grad in the
    backward (without). `scored` [B, T] bool picks the positions counted; `every_row`: see `row_chunks`.
    Returns (the loss, differentiable w.r.t. `logits`; {name: [B, T] float32, 0 where not scored})."""
    values: dict[str, torch.Tensor] = {}  # filled by the forward: an autograd Function returns tensors only
    loss = _RowsLoss.apply(logits, scored, per_row, chunk_rows, every_row, values)
    return loss, {name: value.view(scored.shape) for name, value in values.items()}


class _RowsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, scored, per_row: PerRow, chunk_rows, every_row, values):
        scored = scored.flatten()
        token_loss = torch.zeros(len(scored), dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            for index in row_chunks(scored, chunk_rows, every_row):
                kept = scored.index_select(0, index)
                loss, named = per_row(at_rows(logits, index), index, True)
                token_loss.index_copy_(0, index, torch.where(kept, loss, 0.0))
                for name, value in named.items():
                    if name not in values:
                        values[name] = torch.zeros(len(scored), dtype=torch.float32, device=logits.device)
                    values[name].index_copy_(0, index, torch.where(kept, value.float(), 0.0))
        ctx.save_for_backward(logits, scored)
        ctx.per_row, ctx.chunk_rows, ctx.every_row = per_row, chunk_rows, every_row
        return token_loss.sum()

    @staticmethod
    def backward(ctx, grad_loss):
        logits, scored = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        for index in row_chunks(scored, ctx.chunk_rows, ctx.every_row):
            kept = scored.index_select(0, index)
            rows = at_rows(logits, index).detach().requires_grad_()
            with torch.enable_grad():
                loss = torch.where(kept, ctx.per_row(rows, index, False)[0], 0.0).sum()
            (grad_rows,) = torch.autograd.grad(loss, rows, grad_loss)
            # an unscored row's gradient is 0, also where its loss is not finite (0 x inf would be nan)
            grad_rows = grad_rows.masked_fill(~kept[:, None], 0)
            grad.index_put_((index // logits.shape[1], index % logits.shape[1]), grad_rows)
        return grad, None, None, None, None, None


def steps_ahead_loss(
    outputs: list[torch.Tensor], batch: dict, target_out, weight: torch.Tensor, decay: float, chunk_rows: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of a training-time test whose draft step k (0 first) outputs, at every position t < T - 1 of
    the batch, the feature `outputs[k][:, t]` ([B, T - 1, H]) that guesses x_{t+k+2} through the lm_head
    `weight`: its soft label is the target's distribution there (its logits at t+k+1). A position counts
    where x_{t+k+2} is supervised and in t's document; the loss is summed over positions and steps, step k
    weighing decay**k. Returns (loss_sum, per-document `step{k+1}/top1` and `step{k+1}/token_loss`)."""
    loss_mask = batch["loss_mask"].bool()
    rows, length = loss_mask.shape
    width, device = length - 1, loss_mask.device
    docs = documents(batch)
    row_starts = torch.arange(rows, device=device)[:, None] * length
    scored, weights, teacher_rows = [], [], []
    for step in range(len(outputs)):
        counted = same_document(docs, step + 2, width) & shifted(loss_mask, step + 2, width, fill=False)
        scored.append(counted)
        weights.append(counted.flatten() * decay**step)
        ahead = (torch.arange(width, device=device) + step + 1).clamp(max=length - 1)
        teacher_rows.append((row_starts + ahead).flatten())
    at = torch.cat(teacher_rows)
    target_best = torch.full_like(at, -1)  # the target's argmax at the scored rows, filled by `teacher`

    def teacher(chunk: torch.Tensor) -> torch.Tensor:
        logits = target_out.logits_at(at[chunk]).float()
        target_best[chunk] = logits.argmax(-1)
        return logits.softmax(-1)

    features = torch.cat([output.flatten(0, 1) for output in outputs]).to(weight.dtype)
    result = soft_cross_entropy(features, weight, teacher, torch.cat(weights).float(), chunk_rows)
    hits = (result.best == target_best).float().view(len(outputs), rows, width)
    token_loss = result.token_loss.view(len(outputs), rows, width)
    stats: dict[str, torch.Tensor] = {}
    owner = docs[:, :width].clamp(min=0)  # padding is never counted
    for step, counted in enumerate(scored):
        values = {f"step{step + 1}/top1": hits[step], f"step{step + 1}/token_loss": token_loss[step]}
        stats |= per_sample_stats(values, owner, num_documents(batch), where=counted)
    return result.loss, stats
