"""The collators that lay a tokenized data set's rows (data_prep/dataset.py) into batches: padded, or packed
into rows of data.pack_length tokens (`data.pack`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from draftsmith.data_prep.bin_packing import pack_rows
from draftsmith.data_prep.records import DEFAULT_DOMAIN
from draftsmith.errors import UserError
from draftsmith.heads.packing import conversation_seed


@dataclass
class Collator:
    """Pad rows of a tokenized data set into a batch: right padding with `pad_token_id`, and
    attention_mask/loss_mask zero on padding. `domain` stays a list of strings for per-domain metrics,
    `sample` one of where each row came from (for error messages), `draws` each row's (row, start, length,
    seed) for a drafter's random draws (heads/packing.py conversation_rand). Any other per-token tensor of a
    row (captured features, data_prep.features) is padded with zeros to the same width."""

    pad_token_id: int
    draw_seed: int = 0  # mixed into each conversation's seed: trainer/loop.py micro_batches sets train.seed

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        width = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
        extra = _per_token_extras(rows, (len(rows), width))
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[b, :n] = 1
            loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
            for name, tensor in extra.items():
                tensor[b, :n] = row[name]
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "domain": [row.get("domain", DEFAULT_DOMAIN) for row in rows],
            "sample": [row.get("sample", "") for row in rows],
            "draws": [
                (b, 0, len(row["input_ids"]), conversation_seed(row["input_ids"], self.draw_seed))
                for b, row in enumerate(rows)
            ],  # fmt: skip
            **extra,
        }


# Fields of a tokenized row that are not per-token tensors to lay out in rows.
_NOT_PER_TOKEN = ("input_ids", "loss_mask", "domain", "sample", "length", "digest")


def _per_token_extras(rows: Sequence[Mapping[str, Any]], shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Zeros of `shape` (plus each field's own trailing dimensions) for every per-token tensor of a
    row beyond its tokens and loss mask, for a collator to lay the rows' values into."""
    tokens = len(rows[0]["input_ids"])
    return {
        name: torch.zeros((*shape, *value.shape[1:]), dtype=value.dtype)
        for name, value in rows[0].items()
        if name not in _NOT_PER_TOKEN and torch.is_tensor(value) and value.shape[:1] == (tokens,)
    }


@dataclass
class PackingCollator:
    """Pack a micro-batch's conversations into rows of at most `pack_length` tokens (`data.pack`).

    A micro-batch is still `train.micro_batch_size` conversations, drawn exactly as unpacked (so the
    data order, the data position and an exact resume are unchanged); they are laid first-fit
    decreasing into as few rows as hold them, each conversation whole in one row (a conversation cut
    in two would lose its context), a row's conversations in micro-batch order. Rows are padded to
    the fullest row (at most `pack_length`). The batch is `Collator`'s plus

    - `position_ids` [R, L]: 0, 1, ... restarting at every conversation (and for the padding);
    - `document_ids` [R, L]: the conversation's index in the micro-batch, -1 on padding;

    and `domain`/`sample`/`draws` list the conversations in micro-batch order, so a drafter's per-sample
    statistics have one row per conversation, as unpacked (heads/packing.py). `loss_mask` is each
    conversation's own. Any other per-token tensor of a row (captured features, data_prep.features)
    is laid out the same way, zeros on padding."""

    pad_token_id: int
    pack_length: int
    draw_seed: int = 0  # as Collator's

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        lengths = [len(row["input_ids"]) for row in rows]
        for row, length in zip(rows, lengths):
            if length > self.pack_length:
                raise UserError(
                    f"{row.get('sample') or 'a conversation'} has {length} tokens, more than "
                    f"data.pack_length={self.pack_length} (a conversation is never split); raise data.pack_length"
                )
        packed = pack_rows(lengths, self.pack_length)
        width = max(sum(lengths[i] for i in members) for members in packed)
        shape = (len(packed), width)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        loss_mask = torch.zeros(shape, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        document_ids = torch.full(shape, -1, dtype=torch.long)
        extra = _per_token_extras(rows, shape)
        draws = [None] * len(rows)
        for r, members in enumerate(packed):
            start = 0
            for i in members:
                draws[i] = (r, start, lengths[i], conversation_seed(rows[i]["input_ids"], self.draw_seed))
                span = slice(start, start + lengths[i])
                input_ids[r, span] = torch.as_tensor(rows[i]["input_ids"], dtype=torch.long)
                loss_mask[r, span] = torch.as_tensor(rows[i]["loss_mask"], dtype=torch.long)
                attention_mask[r, span] = 1
                position_ids[r, span] = torch.arange(lengths[i])
                document_ids[r, span] = i
                for name, tensor in extra.items():
                    tensor[r, span] = rows[i][name]
                start += lengths[i]
            position_ids[r, start:] = torch.arange(width - start)  # padding: a sequence of its own (heads/packing.py)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "position_ids": position_ids,
            "document_ids": document_ids,
            "domain": [row.get("domain", DEFAULT_DOMAIN) for row in rows],
            "sample": [row.get("sample", "") for row in rows],
            "draws": draws,
            **extra,
        }
