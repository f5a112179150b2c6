"""Held-apart data that data.train holds too: the figures measured on it are of text the drafter trained on.

Two figures are measured on data kept apart from training. The eval split's accuracy (eval_accuracy.json) reads
data.eval's conversations, compared turn for turn with data.train's by their digests (`eval_in_train`). The eval
report's acceptance reads its prompts (eval.data, else data.eval), compared with the prompts data.train's
assistant turns answer (`prompts_in_train`): a drafter trained on an answer to a prompt (the target's own, where
data.train was regenerated) accepts more of the target's answer to it than of a new prompt's, so τ on such
prompts says little about traffic the drafter has not seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import datasets

from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.records import answered_turns
from draftsmith.data_prep.template import prompt_end
from draftsmith.errors import HubUnavailable, UserError

logger = logging.getLogger("draftsmith.data")

Messages = Sequence[dict[str, Any]]


@dataclass(frozen=True)
class PromptCount:
    """What `prompts_in_train` went through data.train for, for a later count of the same data and prompts: a
    training run counts at its start (trainer/setup.py) and its report again at its end (eval/report.py), and the
    start's count passed to the report's spares it a second pass over every conversation."""

    data: str  # data.train's conversations by their fingerprint, which follows the files' bytes
    looked_for: frozenset[str]  # the prompt digests
    found: frozenset[str]  # those an assistant turn of data.train answers


def eval_in_train(train: datasets.Dataset, eval_split: datasets.Dataset, cfg, warn: bool = True) -> dict[str, int]:
    """How many of data.eval's tokenized conversations data.train's hold too, turn for turn (by their digests:
    the rows of a conversation rendered one row per turn share one), of how many distinct ones: a warning names
    the count and both keys' files where any is (`warn`: the run's start says it; the accuracy table after
    training counts again and shows it in its own line), since the eval split's figures on conversations trained
    on are higher than on new ones."""
    trained, measured = set(train["digest"]), set(eval_split["digest"])
    shared = len(measured & trained)
    if shared and warn:
        logger.warning(
            "%d of the %d data.eval conversations (%s) are in data.train (%s) too, turn for turn: the eval split's "
            "accuracy on them is of conversations trained on, higher than on new ones; take them out of one of the "
            "two",
            shared,
            len(measured),
            ", ".join(map(str, cfg.data.eval)),
            ", ".join(map(str, cfg.data.train)),
        )
    return {"conversations": shared, "of": len(measured)}


def prompts_in_train(
    chosen: dict[str, list[Messages]],
    cfg,
    earlier: Optional[PromptCount] = None,
    digests: Optional[dict[str, str]] = None,
) -> tuple[dict[str, Any], Optional[PromptCount]]:
    """How many of the eval report's prompts (`chosen`: per domain, as eval/prompts.py's prompt_conversations
    gives them) are prompts one of data.train's assistant turns answers, turn for turn: ({"prompts": n, "of": all,
    "per_domain": {domain: n}}, the count for a later one). data.train is read as training reads it (under
    data.max_conversations), train.heldout's conversations included; where `earlier` counted the same data for the
    same prompts (the run's start, passed to its report) no conversation is gone through again; `digests`: the
    start's files' sha256 (load_conversations). Where nothing is
    counted (no data.train in the recipe, or files this machine cannot read: an eval away from the training data),
    ({"prompts": None, "of": all, "not_counted": why}, None)."""
    total = sum(len(prompts) for prompts in chosen.values())
    if not cfg.data.train:
        return {"prompts": None, "of": total, "not_counted": "the recipe names no data.train"}, None
    wanted = {domain: [prompt_digest(messages) for messages in prompts] for domain, prompts in chosen.items()}
    looked_for = frozenset(digest for digests in wanted.values() for digest in digests)
    try:
        conversations = load_conversations(
            list(cfg.data.train),
            cfg.data.max_conversations,
            skip_invalid_utf8=cfg.data.skip_invalid_utf8,
            digests=digests,
        ).select_columns(["messages"])
    except (UserError, HubUnavailable) as err:  # an eval away from the training data: the report says so
        return {"prompts": None, "of": total, "not_counted": f"data.train could not be read: {err}"}, None
    count = earlier
    if count is None or (count.data, count.looked_for) != (conversations._fingerprint, looked_for):
        found = set()
        for batch in conversations.iter(batch_size=1000):
            for messages in batch["messages"]:
                found.update(digest for digest in answered_prompt_digests(messages) if digest in looked_for)
        count = PromptCount(conversations._fingerprint, looked_for, frozenset(found))
    per_domain = {domain: sum(digest in count.found for digest in digests) for domain, digests in wanted.items()}
    return {"prompts": sum(per_domain.values()), "of": total, "per_domain": per_domain}, count


def warn_of_prompts_in_train(counted: dict[str, Any], sources: Sequence[str], cfg) -> None:
    """The warning a run's start gives where the eval report's prompts (from `sources`) are prompts data.train
    answers (`prompts_in_train`'s count), before the training they would be measured after."""
    if counted.get("prompts"):
        logger.warning(
            "%d of the %d prompts of the eval report (%s) are prompts data.train (%s) answers, turn for turn: the "
            "drafter trains on an answer to each, and the report's τ on them will be higher than on prompts it has "
            "not seen; take them out of one of the two",
            counted["prompts"],
            counted["of"],
            ", ".join(map(str, sources)),
            ", ".join(map(str, cfg.data.train)),
        )


def prompt_digest(messages: Messages) -> str:
    """The digest of a conversation's prompt (its turns up to `prompt_end`), as `answered_prompt_digests` gives
    the prompt of each answered turn of a training conversation."""
    return turns_digest(list(messages)[: prompt_end(messages)])


def answered_prompt_digests(messages: Messages) -> Iterator[str]:
    """The digest of the prompt each answered assistant turn of a conversation answers (the turns before it)."""
    answered = set(answered_turns(list(messages)))
    digest = hashlib.sha256()
    for index, turn in enumerate(messages):
        if index in answered:
            yield digest.copy().hexdigest()[:16]
        digest.update(_turn_bytes(turn))


def turns_digest(turns: Messages) -> str:
    """Turns by content: two lists of the same turns (every turn holds the same keys, data_prep/turns.py) have one
    digest, wherever they came from and whatever their domain; extended turn by turn as answered_prompt_digests
    does."""
    digest = hashlib.sha256()
    for turn in turns:
        digest.update(_turn_bytes(turn))
    return digest.hexdigest()[:16]


def _turn_bytes(turn: dict[str, Any]) -> bytes:
    # canonical JSON escapes newlines, so a newline ends each turn unambiguously and a prompt's digest can be
    # extended turn by turn
    return json.dumps(turn, sort_keys=True, ensure_ascii=False).encode() + b"\n"
