"""One conversation record validated and normalized into the schema every later stage reads (data_prep/conversations.py
reads the files and Hub data sets they come from; data_prep/turns.py normalizes each turn).

A record becomes `{"messages": [{"role", "content", ...}, ...], "domain", "source", "record"}` (a turn also holds its
reasoning, cut mark and tool calls, None where it has none): `source` is the file path (or Hub id) it came from and
`record` its 1-based position there, so that any later stage (tokenization, the eval) can point the user at the
offending record.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
from pathlib import Path
from typing import Any, Optional

import datasets

from draftsmith.data_prep.turns import TURN_FEATURES, normalize_turn
from draftsmith.errors import UserError

logger = logging.getLogger("draftsmith.data")

DEFAULT_DOMAIN = "default"
RECORD_FEATURES = datasets.Features(
    {
        "messages": datasets.List(TURN_FEATURES),
        "domain": datasets.Value("string"),
        "source": datasets.Value("string"),
        "record": datasets.Value("int64"),
    }
)


def code_digest(*paths: str | os.PathLike) -> str:
    """sha256 of source files' bytes, in order: the part of a cache's key that follows the code that wrote it."""
    return hashlib.sha256(b"".join(Path(path).read_bytes() for path in paths)).hexdigest()


# datasets fingerprints a module-level map function by reference, not by its code, so an edit to
# the normalization below (or a turn's, data_prep/turns.py) would otherwise reuse stale map caches (and stale
# tokenized caches, whose key builds on this fingerprint). Hashing both files' bytes ties the fingerprint to the code.
_CODE_HASH = code_digest(__file__, inspect.getfile(normalize_turn))


def normalize_records(
    dataset: datasets.Dataset, source: str, prompts_only: bool, numbers: Optional[list[int]] = None
) -> datasets.Dataset:
    """Every row validated and normalized; `numbers`: each row's record number in its file, where
    rows were left out (default: the row's position)."""
    fingerprint = hashlib.sha256(f"{dataset._fingerprint}|{source}|{prompts_only}|{_CODE_HASH}".encode()).hexdigest()[
        :16
    ]
    return dataset.map(
        _normalize_row,
        with_indices=True,
        fn_kwargs={"source": source, "prompts_only": prompts_only, "numbers": numbers},
        remove_columns=dataset.column_names,
        features=RECORD_FEATURES,
        new_fingerprint=fingerprint,
        desc=f"checking {source}",
    )


def _normalize_row(
    row: dict[str, Any], index: int, source: str, prompts_only: bool, numbers: Optional[list[int]] = None
) -> dict[str, Any]:
    number = index + 1 if numbers is None else numbers[index]
    return normalize_record(row, source=source, number=number, prompts_only=prompts_only)


def normalize_record(record: dict[str, Any], source: str, number: int, prompts_only: bool = False) -> dict[str, Any]:
    """Validate one raw record (messages or ShareGPT shape) and return it normalized; with
    `prompts_only`, a conversation may end with a user turn instead of holding an answer.

    Arrow gives every row all columns of its file, with None for absent ones, so "missing" and
    "None" are treated alike throughout.
    """
    where = f"{source} record {number}"
    turns = record.get("messages")
    if turns is None:
        turns = record.get("conversations")
    if turns is None:
        raise UserError(f"{where}: no 'messages' field (nor a ShareGPT 'conversations' field)")
    if not isinstance(turns, list) or not turns:
        raise UserError(f"{where}: 'messages' must be a non-empty list of turns")
    messages = [normalize_turn(turn, f"{where}: turn {turn_number}") for turn_number, turn in enumerate(turns, 1)]
    if not answered_turns(messages) and not (prompts_only and messages[-1]["role"] == "user"):
        opening = messages[0]["role"] == "assistant"
        raise UserError(
            f"{where}: no assistant turn"
            + (" after the opening one (which nothing before it asks for: kept as context only)" if opening else "")
            + (", and it does not end with a user turn to answer" if prompts_only else ", so nothing to train on")
        )
    domain = record.get("domain")
    if domain is not None and (isinstance(domain, bool) or not isinstance(domain, (str, int))):
        raise UserError(f"{where}: 'domain' must be a name (a string), not {type(domain).__name__} {domain!r}"[:300])
    return {
        "messages": messages,
        "domain": DEFAULT_DOMAIN if domain is None or domain == "" else str(domain),
        "source": source,
        "record": number,
    }


def answered_turns(messages: list[dict[str, Any]]) -> list[int]:
    """The positions of the assistant turns that answer the turns before them: what training masks in and
    regeneration rewrites. An opening assistant turn (a chat log's greeting) answers nothing, and no chat
    template renders an empty conversation to show what the model was asked: it stays, as context."""
    return [index for index, message in enumerate(messages) if message["role"] == "assistant" and index > 0]


def warn_of_turn_order_oddities(dataset: datasets.Dataset, source: str) -> None:
    """Warn, with a count and the first record numbers, about conversations kept as they are though often a
    file joined or cut wrongly: a user turn that follows a user turn (the chat template renders both as the
    user's, and only assistant turns are trained on), and an opening assistant turn (context only, see
    `answered_turns`). Read from the Arrow columns, not row by row."""
    import numpy as np
    import pyarrow.compute as pc

    messages = dataset.data.column("messages").combine_chunks()
    roles = pc.list_flatten(messages).field("role").to_numpy(zero_copy_only=False)
    owners = pc.list_parent_indices(messages).to_numpy()
    repeated = (roles[1:] == "user") & (roles[:-1] == "user") & (owners[1:] == owners[:-1])
    first = np.flatnonzero(np.diff(owners, prepend=-1) != 0)  # every conversation's first turn
    opening = owners[first][roles[first] == "assistant"]
    kept = {
        "have two user turns in a row (records {}): kept, both rendered as the user's; check how the file was joined": (
            np.unique(owners[1:][repeated])
        ),
        "open with an assistant turn (records {}): kept as context, neither trained on nor regenerated, since no "
        "turn before it asks for it": opening,
    }
    for what, rows in kept.items():
        if len(rows):
            records = ", ".join(map(str, dataset.select(rows[:10].tolist())["record"]))
            logger.warning(
                "%s: %d conversation(s) %s",
                source,
                len(rows),
                what.format(records + (", ..." if len(rows) > 10 else "")),
            )
