"""Tokenized training data: conversations -> (input_ids, loss_mask, domain, length), cached on disk,
and the collator that pads them into batches."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import datasets
import torch

from draftsmith.data_prep.conversations import DEFAULT_DOMAIN
from draftsmith.data_prep.template import render_with_masks, require_chat_template
from draftsmith.errors import UserError

logger = logging.getLogger("draftsmith.data")

# Bump when the layout of a cached data set changes. Code edits are covered by _CODE_HASH.
CACHE_VERSION = 2
OVERLONG = ("truncate", "drop", "error")
DEFAULT_CACHE_ROOT = Path("~/.cache/draftsmith")
FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "domain": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "sample": datasets.Value("string"),  # where the conversation came from: `source:record`
    }
)
# A fix to the masking must not be hidden behind a cache written by the old code.
_CODE_HASH = hashlib.sha256(b"".join((Path(__file__).parent / name).read_bytes() for name in ("template.py", "dataset.py"))).hexdigest()


def load_tokenized(cfg, sources: Sequence[str], tokenizer, key: str) -> datasets.Dataset:
    """The recipe's conversations from `sources` (the value of recipe key `key`, for errors), read,
    validated and tokenized exactly as every stage needs them (training, capture, the eval split):
    one definition, so a capture lines up with the online data row by row."""
    from draftsmith.data_prep.conversations import load_conversations

    if not sources:
        raise UserError(f"{key} is empty: give at least one conversation file or Hub data set id")
    conversations = load_conversations(list(sources), cfg.data.max_conversations)
    return tokenize_conversations(conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.cache_dir)


def tokenize_conversations(
    conversations: datasets.Dataset,
    tokenizer,
    max_length: int,
    overlong: str = "truncate",
    cache_dir: Optional[str] = None,
) -> datasets.Dataset:
    """Render, tokenize and mask every conversation, handling those over `max_length` tokens as
    `overlong` says (truncate: keep the first max_length tokens; drop; error). Conversations left
    with no masked token are dropped. The result is cached under
    `<cache_dir or ~/.cache/draftsmith>/tokenized/<key>` and reused while the conversations, the
    tokenizer, the settings and this code are unchanged."""
    if overlong not in OVERLONG:
        raise UserError(f"data.overlong={overlong!r} is not one of {', '.join(OVERLONG)}")
    if max_length < 1:
        raise UserError(f"data.max_length={max_length} must be at least 1")
    require_chat_template(tokenizer)  # fail before any cache lookup or work
    key = cache_key(conversations, tokenizer, max_length, overlong)
    root = Path(cache_dir or DEFAULT_CACHE_ROOT).expanduser() / "tokenized"
    final = root / key
    if final.is_dir():
        dataset = datasets.load_from_disk(str(final))
        logger.info("loaded %d tokenized conversations from the cache %s", len(dataset), final)
        return dataset

    root.mkdir(parents=True, exist_ok=True)
    # Everything is written inside a temporary directory next to the final one and moved into
    # place in one rename, so a killed job never leaves a half-written cache that looks complete.
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{key}.tmp-") as scratch:
        stats: Counter[str] = Counter()
        tokenized = conversations.map(
            _tokenize_batch,
            batched=True,  # a batch may shrink: dropped conversations produce no row
            with_indices=True,
            fn_kwargs={"tokenizer": tokenizer, "max_length": max_length, "overlong": overlong, "stats": stats},
            remove_columns=conversations.column_names,
            features=FEATURES,
            cache_file_name=os.path.join(scratch, "map.arrow"),
            load_from_cache_file=False,
            new_fingerprint=key[:16],  # our key already identifies the result; skips hashing the tokenizer
            desc="tokenizing conversations",
        )
        _log_stats(stats, len(conversations), max_length)
        if len(tokenized) == 0:
            raise UserError(f"no conversation is left after tokenization with data.max_length={max_length} and data.overlong={overlong}")
        staged = os.path.join(scratch, "dataset")
        tokenized.save_to_disk(staged)
        try:
            os.replace(staged, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same key first; its copy is identical, keep it.
    dataset = datasets.load_from_disk(str(final))
    logger.info("tokenized %d conversations into %d tokens, cached at %s", len(dataset), sum(dataset["length"]), final)
    return dataset


def _tokenize_batch(batch: dict[str, list], indices: list[int], tokenizer, max_length: int, overlong: str, stats: Counter) -> dict[str, list]:
    # stats is mutated in place: this runs in the calling process (map's default num_proc=1).
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "domain": [], "length": [], "sample": []}
    count = len(batch["messages"])
    domains = batch.get("domain") or [DEFAULT_DOMAIN] * count
    for row in range(count):
        where = _where(batch, row, indices[row])
        try:
            ids, mask = render_with_masks(tokenizer, batch["messages"][row])
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
        if len(ids) > max_length:
            if overlong == "error":
                raise UserError(f"{where}: {len(ids)} tokens is more than data.max_length={max_length} (raise it, or set data.overlong=truncate or drop)")
            if overlong == "drop":
                stats["dropped_overlong"] += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            stats["truncated"] += 1
        if not any(mask):
            stats["dropped_no_assistant_token"] += 1
            continue
        out["input_ids"].append(ids)
        out["loss_mask"].append(mask)
        out["domain"].append(domains[row])
        out["length"].append(len(ids))
        out["sample"].append(f"{batch['source'][row]}:{batch['record'][row]}" if "source" in batch else f"conversation {indices[row] + 1}")
    return out


def _where(batch: dict[str, list], row: int, index: int) -> str:
    """Name a conversation for an error: its file and record when it came from load_conversations."""
    if "source" in batch and "record" in batch:
        return f"{batch['source'][row]} record {batch['record'][row]}"
    return f"conversation {index + 1}"


def _log_stats(stats: Counter, total: int, max_length: int) -> None:
    if stats["truncated"]:
        logger.info("truncated %d of %d conversations to data.max_length=%d tokens", stats["truncated"], total, max_length)
    if stats["dropped_overlong"]:
        logger.info("dropped %d of %d conversations longer than data.max_length=%d tokens", stats["dropped_overlong"], total, max_length)
    if stats["dropped_no_assistant_token"]:
        logger.info(
            "dropped %d of %d conversations with no assistant token within data.max_length=%d",
            stats["dropped_no_assistant_token"],
            total,
            max_length,
        )


def cache_key(conversations: datasets.Dataset, tokenizer, max_length: int, overlong: str) -> str:
    """sha256 over everything the tokenized data depends on."""
    parts = {
        "conversations": conversations._fingerprint,
        "tokenizer": tokenizer_identity(tokenizer),
        "max_length": max_length,
        "overlong": overlong,
        "cache_version": CACHE_VERSION,
        "code": _CODE_HASH,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def tokenizer_identity(tokenizer) -> dict[str, Any]:
    """What decides how a tokenizer renders and splits text: its name alone is not enough (a local
    path can be overwritten, a template or added tokens can be changed in memory)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return {
        "name_or_path": tokenizer.name_or_path,
        "chat_template": _sha256(json.dumps(tokenizer.chat_template, sort_keys=True)),
        "vocab_size": len(tokenizer),
        "backend": _sha256(backend.to_str()) if backend is not None else None,
        "bos_token": tokenizer.bos_token,  # decides whether BOS is added (see template._encode)
        "eos_token": tokenizer.eos_token,  # decides where an assistant span ends
    }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def domain_names(dataset: datasets.Dataset) -> list[str]:
    """The sorted distinct domains of a (tokenized or conversations) data set."""
    return sorted(dataset.unique("domain"))


@dataclass
class Collator:
    """Pad rows of a tokenized data set into a batch: right padding with `pad_token_id`, and
    attention_mask/loss_mask zero on padding. `domain` stays a list of strings for per-domain metrics,
    `sample` one of where each row came from (for error messages)."""

    pad_token_id: int

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if not rows:
            raise ValueError("cannot collate an empty batch")
        width = max(len(row["input_ids"]) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, row in enumerate(rows):
            n = len(row["input_ids"])
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[b, :n] = 1
            loss_mask[b, :n] = torch.as_tensor(row["loss_mask"], dtype=torch.long)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "domain": [row.get("domain", DEFAULT_DOMAIN) for row in rows],
            "sample": [row.get("sample", "") for row in rows],
        }
