"""One batch of conversations answered turn by turn by the target (data_prep/regenerate.py runs the job around
it: the data, the output parts, resuming), and why a conversation ended early, as the final line counts it."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Optional

import torch

from draftsmith.data_prep.answer_engines import Answer
from draftsmith.data_prep.records import answered_turns
from draftsmith.data_prep.template import render_prompt
from draftsmith.data_prep.turns import CUT_KEY, REASONING_KEYS, TOOL_CALLS_KEY, TOOL_KEYS
from draftsmith.errors import UserError


@torch.no_grad()
def regenerate_batch(
    engine,
    tokenizer,
    batch: list[list[dict]],
    section,
    max_length: int,
    seeds: Optional[list[int]] = None,
    known: Optional[dict[str, Answer]] = None,
    names: Optional[list[str]] = None,
) -> tuple[list[Optional[list[dict]]], list[Optional[str]], int]:
    """Every assistant turn of each conversation replaced by the target's answer to the turns before it (its own
    earlier answers included); round k answers the k-th assistant turn of every conversation that has one, in one
    call of `engine` (TransformersAnswers or VllmAnswers), except the turns whose prompt `known` answers already
    (prompt_key). A turn whose prompt holds `max_length` tokens or more, or whose answer is empty (the target ended
    its turn at once: sampled, that happens; there is nothing to train on, and the data loader refuses an empty
    turn), ends its conversation at the assistant turn before it (None: left out, when fewer than
    `section.min_turns` are answered by then). With `section.max_turns` a conversation ends after its max_turns-th
    assistant turn, and at the answer to a turn that had called tools (its `tool_calls` dropped: the turns after it
    answered those calls). Returns the conversations, for each why it ended early ("max_length", "empty answer",
    "tool calls") or None, and how many answers `known` gave. An answer cut at max_new_tokens is kept, its turn
    marked `"cut": true`. An opening assistant turn is kept as it is (`answered_turns`), and a last user turn is
    answered (`with_the_last_question_answered`). `names` (a file and record each) name a conversation the chat
    template rejects."""
    known = known or {}
    conversations = [with_the_last_question_answered([dict(message) for message in messages]) for messages in batch]
    turns = [answered_turns(messages)[: section.max_turns] for messages in conversations]
    if section.max_turns is not None:
        conversations = [messages[: kept[-1] + 1] for messages, kept in zip(conversations, turns)]
    ended: list[Optional[str]] = [None] * len(conversations)
    taken = 0

    def end_after(row: int, answered: int, reason: str) -> None:
        """Conversation `row` ends at its `answered`-th assistant turn, or is left out (fewer than min_turns)."""
        ended[row] = reason
        kept = answered >= section.min_turns
        conversations[row] = conversations[row][: turns[row][answered - 1] + 1] if kept else None

    for round_ in range(max(map(len, turns))):
        active, prompts = [], []
        for row in range(len(conversations)):
            if round_ >= len(turns[row]) or ended[row]:
                continue
            try:
                prompt = render_prompt(tokenizer, conversations[row][: turns[row][round_] + 1], max_length)[0]
            except UserError as err:
                raise UserError(f"{names[row]}: {err}" if names else str(err)) from None
            if len(prompt) >= max_length:
                end_after(row, round_, "max_length")
                continue
            active.append((row, turns[row][round_]))
            prompts.append(prompt)
        answers = [known.get(prompt_key(conversations[row][:turn])) for row, turn in active]
        asked = [i for i, answer in enumerate(answers) if answer is None]
        taken += len(answers) - len(asked)
        if asked:
            fresh = engine.answers(
                [prompts[i] for i in asked], [seeds[active[i][0]] for i in asked] if seeds is not None else None
            )
            for i, answer in zip(asked, fresh):
                answers[i] = answer
        for (row, turn), answer in zip(active, answers):
            if not answer.text:
                end_after(row, round_, "empty answer")
                continue
            # the target's answer replaces the turn, and the reasoning that led to the old one goes with it
            message = conversations[row][turn]
            message["content"] = answer.text
            for key in REASONING_KEYS:
                message.pop(key, None)
            if answer.cut:
                message[CUT_KEY] = True
            else:
                message.pop(CUT_KEY, None)
            if message.pop(TOOL_CALLS_KEY, None) and turn + 1 < len(conversations[row]):
                end_after(row, round_ + 1, "tool calls")
    return conversations, ended, taken


def with_the_last_question_answered(messages: list[dict]) -> list[dict]:
    """A conversation that ends on a user turn after answered ones gets an empty assistant turn after it, which the
    target writes like every other: it was written ending on that question, which trains nothing. (A prompt, with
    no answered turn, has its turn from data_prep/regenerate.py's `with_a_turn_to_answer` already; this one is
    added here, not there, so that the content digest a regeneration records of its input stays as it was and
    the finished regenerations resume.)"""
    if messages[-1]["role"] != "user":
        return messages
    return [*messages, {**dict.fromkeys(messages[-1]), "role": "assistant", "content": ""}]  # no user's name


def prompt_key(messages: list[dict]) -> str:
    """The conversation before an answer by what the chat template renders of each turn: a turn that only calls
    a tool has an empty content, its calls tell it apart."""
    keys = ("role", "content", TOOL_CALLS_KEY, *TOOL_KEYS)
    return json.dumps([without_nulls({key: m.get(key) for key in keys}) for m in messages], ensure_ascii=False)


def without_nulls(value: Any) -> Any:
    """`value` without the keys its dicts hold None under, at any depth (one Arrow schema for all rows: a turn
    without reasoning has `thinking` None, a call without an id `id`); the loader reads an absent key as None."""
    if isinstance(value, dict):
        return {key: without_nulls(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_nulls(item) for item in value]
    return value


def left_out_line(left_out: Counter, max_length: int, min_turns: int) -> str:
    """`N left out`, and where N > 0 why, each reason with its count: a user told only how many were left out
    cannot tell whether to raise data.max_length or lower min_turns."""
    total = sum(left_out.values())
    if not total:
        return "0 left out"
    reasons = {
        "max_length": f"at a prompt of data.max_length={max_length} tokens or more",
        "empty answer": "at an empty answer",
        "tool calls": "at the answer to a turn that called tools",
    }
    counted = ", ".join(f"{left_out[why]} {said}" for why, said in reasons.items() if left_out[why])
    return f"{total} left out, ended before min_turns={min_turns} answers: {counted}"
