"""One turn of a conversation: the roles chat templates know (and the other names data gives them), what a
turn holds beside its content (reasoning, a cut mark, tool calls), how a raw turn is checked, and the Arrow
schema every turn is stored under (conversations.py reads the files around them)."""

from __future__ import annotations

import json
from typing import Any, Optional

import datasets

from draftsmith.errors import UserError

# ShareGPT speakers (and other APIs' names for a role) and the roles chat templates expect. Roles already in the
# target vocabulary map to themselves so that both shapes go through the same table.
ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    "developer": "system",  # OpenAI's current name for the system prompt
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",  # Llama-3.1's name for a tool's result (its template renders `tool` as `ipython` too)
}
# A turn's reasoning, under the name its chat template reads: `thinking` (gpt-oss's harmony template
# and transformers' convention), `reasoning_content` (Qwen3's), or `reasoning` (vLLM's responses); transformers
# hands it to the template under the first two whichever is given. Kept as given; data.thinking decides
# whether the tokens the template renders it as are trained on.
REASONING_KEYS = ("thinking", "reasoning_content", "reasoning")
# An assistant turn marked `"cut": true` was cut off before the model ended it (data_prep.regenerate writes it
# where the target reached data.regenerate.max_new_tokens): its content is trained on, the end-of-turn the
# chat template renders after it is not, since the model did not generate one there.
CUT_KEY = "cut"
# An assistant turn's OpenAI tool calls: the model generates them, so they are rendered and trained on (its content
# may then be null or empty). Each call's `arguments` is held as JSON text, given as text or as an object: Arrow
# holds one type per column, and every call's arguments have keys of their own.
TOOL_CALLS_KEY = "tool_calls"
# What a tool's turn (or any turn) may carry beside its content and templates read: the call it answers, a name
TOOL_KEYS = ("tool_call_id", "name")
# Every turn is stored under one Arrow schema, None under the fields it does not hold.
TURN_FEATURES = {
    "role": datasets.Value("string"),
    "content": datasets.Value("string"),
    **{key: datasets.Value("string") for key in REASONING_KEYS},
    CUT_KEY: datasets.Value("bool"),
    TOOL_CALLS_KEY: datasets.List(
        {
            "id": datasets.Value("string"),
            "type": datasets.Value("string"),
            "function": {"name": datasets.Value("string"), "arguments": datasets.Value("string")},
        }
    ),
    **{key: datasets.Value("string") for key in TOOL_KEYS},
}


def text_of_parts(parts: list, where: str) -> str:
    """OpenAI's content parts (`[{"type": "text", "text": ...}, ...]`) as the one string a chat template renders: the
    texts joined by newlines, as vLLM's chat API joins them; a part of another type (an image, audio) is refused, the
    targets draftsmith trains for reading text only."""
    texts = []
    for number, part in enumerate(parts, 1):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        said = f"of type {kind!r}" if kind not in (None, "text") else "that is not {'type': 'text', 'text': str}"
        raise UserError(f"{where} has a content part {number} {said}: draftsmith reads text parts only")
    return "\n".join(texts)


def normalize_turn(turn: Any, where: str) -> dict[str, Any]:
    """One raw turn (`role` and `content`, or ShareGPT's `from` and `value`) checked and normalized; `where`
    names it in an error (`FILE record 3: turn 2`). Arrow gives every turn all fields of its file, None for
    absent ones, so "missing" and "None" are alike."""
    if not isinstance(turn, dict):
        raise UserError(f"{where} is not an object with a role and a content")
    role = turn.get("role") if turn.get("role") is not None else turn.get("from")
    content = turn.get("content") if turn.get("content") is not None else turn.get("value")
    if role is None:
        raise UserError(f"{where} has no role ('role', or ShareGPT 'from')")
    if not isinstance(role, str) or role.lower() not in ROLE_ALIASES:
        raise UserError(f"{where} has an unknown role {role!r} (known: {', '.join(ROLE_ALIASES)})")
    role = ROLE_ALIASES[role.lower()]
    tool_calls = _tool_calls(turn.get(TOOL_CALLS_KEY), where, role)
    if content is None and tool_calls:  # OpenAI's `"content": null` beside the calls
        content = ""
    if content is None:
        raise UserError(f"{where} has no content ('content', or ShareGPT 'value')")
    if isinstance(content, list):  # OpenAI's content parts, as request logs hold them
        content = text_of_parts(content, where)
    if not isinstance(content, str):
        raise UserError(f"{where} has a content of type {type(content).__name__}, expected a string")
    if not content.strip() and not tool_calls:
        raise UserError(f"{where} has an empty content")
    reasoning = {key: turn.get(key) for key in REASONING_KEYS}
    tool_keys = {key: turn.get(key) for key in TOOL_KEYS}
    for key, value in {**reasoning, **tool_keys}.items():
        if value is not None and not isinstance(value, str):
            raise UserError(f"{where} has a {key} of type {type(value).__name__}, expected a string")
    cut = turn.get(CUT_KEY)
    if cut is not None and not isinstance(cut, bool):
        raise UserError(f"{where} has a {CUT_KEY} of {cut!r}, expected true or false")
    if cut and role != "assistant":
        raise UserError(f"{where} is a {role} turn marked {CUT_KEY}: only an assistant turn can be cut off")
    # only a cut turn holds the key: a finished one reads (and is written) as every other record
    return {
        "role": role,
        "content": content,
        **reasoning,
        CUT_KEY: cut or None,
        TOOL_CALLS_KEY: tool_calls,
        **tool_keys,
    }


def _tool_calls(calls: Any, where: str, role: str) -> Optional[list[dict[str, Any]]]:
    """A turn's OpenAI `tool_calls` checked, each call's `arguments` as JSON text (TOOL_CALLS_KEY); None for none."""
    if calls is None or calls == []:
        return None
    if role != "assistant":
        raise UserError(f"{where} is a {role} turn with {TOOL_CALLS_KEY}: only an assistant turn calls tools")
    if not isinstance(calls, list):
        raise UserError(f"{where} has {TOOL_CALLS_KEY} of type {type(calls).__name__}, expected a list of calls")
    checked = []
    for number, call in enumerate(calls, 1):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise UserError(
                f"{where}: tool call {number} has no function name (expected OpenAI's "
                '{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}})'
            )
        arguments = function.get("arguments")
        if arguments is None or arguments == "":  # a call without arguments, which engines render as {}
            arguments = "{}"
        elif isinstance(arguments, dict):
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str) or not isinstance(_json_or_none(arguments), dict):
            raise UserError(f"{where}: tool call {number} ({name}) has arguments that are not a JSON object")
        ids = {key: call.get(key) for key in ("id", "type")}
        for key, value in ids.items():
            if value is not None and not isinstance(value, str):
                raise UserError(f"{where}: tool call {number}'s {key} is a {type(value).__name__}, expected a string")
        checked.append({**ids, "function": {"name": name, "arguments": arguments}})
    return checked


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
