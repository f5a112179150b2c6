"""Packed batches: several conversations ("documents") share a row, and nothing may cross between them.

`data_prep.collate.PackingCollator` lays a micro-batch's conversations end to end in rows and adds
`position_ids` [R, L] (restarting at 0 for every document) and `document_ids` [R, L] (the
conversation's index in the micro-batch, -1 on padding); `domain` and `sample` then list documents,
not rows. An unpacked batch (`data_prep.collate.Collator`) is the special case of one document per row, and
every helper here answers for both, so each drafter has one code path:

- `documents(batch)` / `num_documents(batch)`: the document of every position, and how many there
  are. A drafter's per-sample statistics are per document (`per_sample_stats(values, documents,
  num_documents)`), so `batch["domain"][i]` names statistic row i whether the batch is packed or not;
- `positions(batch)`: RoPE positions, restarting per document;
- `same_document(docs, shift, width)`: whether t and t+shift lie in one document. Every label a
  drafter scores position t against, `shift` tokens ahead, must pass it (a Medusa head's, an EAGLE
  step's, a DFlash block position's). An input read across a boundary is allowed only where it
  cannot reach a scored output: at a position that is never scored and that no scored position
  of its document attends to (a document's last positions, as a row's last ones read padding);
- `causal_document_mask(docs)` / `draft_attention_mask(batch)`: the block-diagonal causal mask for a
  drafter's own attention layers (None when unpacked: plain causal attention is right), with a
  sliding window where the drafter's attention has one (`within_window`);
- `causal_lm_inputs(batch)`: the keyword arguments of a transformers causal-LM forward (the target,
  Medusa-2's adapted target, the draft model), and `require_packed_attention(model)`, the probe that
  such a model honours them;
- `conversation_rand(batch, tail)`: a drafter's random training draws, each conversation's own (below).
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import numpy
import torch

from draftsmith.errors import UserError
from draftsmith.families import within_window


def is_packed(batch: dict) -> bool:
    return "document_ids" in batch


def documents(batch: dict) -> torch.Tensor:
    """[B, T] long: the document of every position, -1 on padding. Unpacked: the row index."""
    if is_packed(batch):
        return batch["document_ids"]
    input_ids = batch["input_ids"]
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)[:, None].expand_as(input_ids)
    mask = batch.get("attention_mask")
    return rows if mask is None else rows.masked_fill(mask == 0, -1)


def num_documents(batch: dict) -> int:
    """How many documents the batch holds: the first dim of a drafter's per-sample statistics."""
    if "domain" in batch:
        return len(batch["domain"])
    return int(batch["document_ids"].max()) + 1 if is_packed(batch) else int(batch["input_ids"].shape[0])


def positions(batch: dict) -> torch.Tensor:
    """[B, T] long RoPE positions: `position_ids` when packed, else 0..T-1 in every row."""
    if is_packed(batch):
        return batch["position_ids"]
    input_ids = batch["input_ids"]
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def shifted(x: torch.Tensor, offset: int, length: int, fill=0) -> torch.Tensor:
    """x[:, offset : offset + length], padded with `fill` at the end to `length` columns."""
    part = x[:, offset : offset + length]
    missing = length - part.shape[1]
    if missing <= 0:
        return part
    return torch.cat([part, part.new_full((x.shape[0], missing), fill)], dim=1)


def same_document(docs: torch.Tensor, shift: int, width: Optional[int] = None) -> torch.Tensor:
    """[B, width] bool: position t and t+shift are in the same (real) document; False where t+shift
    is past the row. `width` defaults to T - shift (every t whose t+shift exists)."""
    length = docs.shape[1]
    width = length - shift if width is None else width
    ahead = docs[:, shift : shift + width]
    same = (docs[:, : ahead.shape[1]] == ahead) & (ahead >= 0)
    missing = width - same.shape[1]
    return torch.cat([same, same.new_zeros(docs.shape[0], missing)], dim=1) if missing > 0 else same


def causal_document_mask(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] bool (True = may attend): key j <= query i and both in one document. Padding
    (-1) attends to padding, so no query row is empty (an all-masked row is NaN in SDPA)."""
    length = docs.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=docs.device).tril()
    return (causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def draft_attention_mask(
    batch: dict, width: Optional[int] = None, window: Optional[int] = None
) -> Optional[torch.Tensor]:
    """The mask for a drafter's own causal attention over the first `width` positions: None (plain
    causal; right padding cannot reach a real token) unless the batch is packed or the attention
    has a sliding `window`: then a query at position p also sees only keys at positions > p - window
    (the engines' sliding window, `within_window`)."""
    if not is_packed(batch) and window is None:
        return None
    docs, places = documents(batch), positions(batch)
    if width is not None:
        docs, places = docs[:, :width], places[:, :width]
    mask = causal_document_mask(docs)
    if window is None:
        return mask
    return mask & within_window(places[:, :, None], places[:, None, :], window)[:, None]


def causal_lm_inputs(batch: dict) -> dict[str, Any]:
    """`attention_mask`/`position_ids` for a transformers causal LM's forward over the batch. Call
    it with use_cache=False.

    Packed, there is no 2-D attention mask and the positions restart per document: that is how
    transformers (masking_utils.find_packed_sequence_indices) recognises packed sequences; it then
    builds the block-diagonal causal mask for sdpa/eager and runs flash attention varlen. It looks
    only when there is no attention mask and no KV cache. Padding positions restart at 0 too, so
    padding is one more sequence of its own. `require_packed_attention` checks a model does this."""
    if is_packed(batch):
        return {"attention_mask": None, "position_ids": batch["position_ids"]}
    return {"attention_mask": batch.get("attention_mask")}


@torch.no_grad()
def require_packed_attention(model, what: str) -> None:
    """A one-line UserError unless `model` keeps packed documents apart: the second of two 4-token
    documents in one row must give the logits it gives alone, not those it gives after the first
    (model code that ignores packed position_ids would let the loss read across documents)."""
    embedding = model.get_input_embeddings().weight
    vocab, device = embedding.shape[0], embedding.device
    ids = (torch.tensor([[5, 17, 29, 41, 3, 11, 23, 37]], device=device) * 7 + 1) % vocab
    restart = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]], device=device)
    was_training = model.training
    model.eval()
    try:
        alone = model(input_ids=ids[:, 4:], use_cache=False).logits.float()
        packed = model(input_ids=ids, position_ids=restart, use_cache=False).logits[:, 4:].float()
        leaking = (
            model(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=restart, use_cache=False)
            .logits[:, 4:]
            .float()
        )
    finally:
        model.train(was_training)
    error, leak = float((packed - alone).abs().max()), float((leaking - alone).abs().max())
    if error > 0.1 * leak:  # rounding differs by far less than attending to another document changes
        raise UserError(
            f"data.pack=true: {what} ({type(model).__name__}) does not keep packed documents apart (its code ignores "
            f"packed position_ids: logits differ by {error:.3g}, a leak by {leak:.3g}); set data.pack=false"
        )


# -- random draws that follow the conversation ----------------------------------------------------------------
def conversation_seed(tokens, draw_seed: int) -> int:
    """A conversation's own seed for a drafter's random draws: a digest of its tokens and `draw_seed` (the run's
    train.seed: trainer/loop.py micro_batches), so the draws follow the conversation, not the row, micro-batch or
    rank it falls in."""
    data = numpy.asarray(tokens, dtype=numpy.int64).tobytes()
    digest = hashlib.blake2b(data, digest_size=8, salt=draw_seed.to_bytes(8, "little", signed=True))
    return int.from_bytes(digest.digest(), "little")


def conversation_rand(batch: dict, tail: tuple[int, ...], device: torch.device, step: Optional[int]) -> torch.Tensor:
    """Uniform [0, 1) draws [B, T, *tail], zeros on padding: each conversation's from a generator seeded by it
    (`conversation_seed`) and `step` (the optimizer step being trained, Drafter.optimizer_step: a conversation
    seen again draws anew; None in eval mode: every evaluation draws the same), laid where the conversation
    lies. A drafter's random training draws (EAGLE's feature noise, DFlash's anchors) are then the same however
    a step is split into rows, packed rows, micro-batches and ranks (each rank drawing the same stream for its
    own rows correlated their noise), and a resume on another split draws what the uninterrupted run drew. The
    collators list each conversation's (row, start, length, seed) in `draws`; a batch laid out by other code is
    read from a host copy of its tensors, with draw seed 0."""
    rows, width = batch["input_ids"].shape
    out = torch.zeros((rows, width, *tail), device=device)
    for row, start, length, seed in batch["draws"] if "draws" in batch else draws_of(batch):
        if step is not None:  # a multiplicative hash of the step: the seeds of consecutive steps far apart
            seed = (seed ^ ((step + 1) * 0x9E3779B97F4A7C15)) % 2**64
        generator = torch.Generator(device=device).manual_seed(seed)
        out[row, start : start + length] = torch.rand((length, *tail), generator=generator, device=device)
    return out


def draws_of(batch: dict) -> list[tuple[int, int, int, int]]:
    """(row, start, length, seed) of each conversation in a batch, read from its tensors."""
    docs, ids = documents(batch).cpu(), batch["input_ids"].cpu()
    found = []
    for row in range(ids.shape[0]):
        for doc in docs[row].unique().tolist():
            if doc < 0:
                continue
            span = (docs[row] == doc).nonzero().flatten()
            start, length = int(span[0]), len(span)
            found.append((row, start, length, conversation_seed(ids[row, start : start + length], 0)))
    return found
