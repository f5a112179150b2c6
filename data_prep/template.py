"""Render conversations with the target tokenizer's own chat template and mark the tokens the
assistant generates (the loss mask), without any per-template knowledge.

Method: the assistant's span of turn i starts where `messages[:i]` rendered with the generation
prompt ends, and ends where `messages[:i+1]` rendered ends; both must be prefixes of the whole
rendered conversation. The whole text is tokenized once, and a token is in the mask when its
first character lies inside a span. A turn marked cut (`"cut": true`: the model was stopped before it ended
the turn) spans its content only, up to the end of the content as rendered: the end-of-turn after it is the
template's, not the model's. An opening assistant turn (i = 0, a chat log's greeting) answers
nothing and has no `messages[:0]` to render: it is rendered as context, out of the mask.

A template that renders an earlier turn differently once a later one follows (Qwen3's and Qwen3.5's
drop an earlier turn's reasoning and its `<think></think>`) has no such prefixes: its conversation
becomes one row per assistant turn, the turns before it rendered as the template renders them when the
model is asked for that turn (`render_rows`), which is the text a serving engine shows the model then.
"""

from __future__ import annotations

import bisect
import json
from typing import Any, Optional, Sequence

from jinja2 import TemplateError

from draftsmith.data_prep.records import answered_turns
from draftsmith.data_prep.turns import CUT_KEY, REASONING_KEYS, TOOL_CALLS_KEY
from draftsmith.errors import UserError

Message = dict[str, Any]
Row = tuple[list[int], list[int]]  # token ids and the 0/1 loss mask
THINKING = ("train", "mask")
# A row or prompt of which k tokens are kept is encoded from 64·(k + 1) of the text's characters at first (its first,
# or its last) where it is more than twice as long, far more than tokens hold on real text: one answer of tens of
# megabytes took gigabytes to encode whole (88 MB aborted the process in the tokenizer's allocator), every token past
# the cut thrown away
CHARACTERS_PER_KEPT_TOKEN = 64


class NotPrefixStable(Exception):
    """The rendering of the conversation up to an assistant turn is not a prefix of the text rendered."""


def render_with_masks(tokenizer, messages: Sequence[Message], thinking: str = "train") -> Row:
    """Token ids of the whole conversation and a 0/1 mask that is 1 exactly on the tokens the
    assistant generates: its contents and the end-of-turn token(s) right after each (not after a turn
    marked cut: the model did not end that one). With `thinking`
    = "mask" (data.thinking), a turn's reasoning (its `thinking`, `reasoning_content` or `reasoning`) is left out of
    the mask where the template renders it, found verbatim inside the turn's span; the markup around
    it (a channel header, `<think>`) stays, since the model generates that too. A template that rewrites
    earlier turns is refused in one line (`render_rows` renders such a conversation a turn at a time)."""
    messages = checked(messages, thinking)
    try:
        return _whole(tokenizer, messages, thinking, None, truncated=False)
    except NotPrefixStable as err:
        raise UserError(
            f"chat template of {_name(tokenizer)} is not prefix-stable for assistant turn {err.args[0] + 1}: "
            "rendering the conversation up to that turn is not a prefix of rendering all of it (the template "
            "rewrites earlier turns)"
        ) from None


def render_rows(
    tokenizer,
    messages: Sequence[Message],
    thinking: str = "train",
    kept_tokens: Optional[int] = None,
    truncated: bool = False,
) -> list[Row]:
    """The conversation as training rows: one (`render_with_masks`) where the template is prefix-stable;
    else one row per assistant turn, the conversation up to that turn as the template renders it last
    (what the model is shown when it generates the turn), only that turn in the mask. `kept_tokens`: no row is used
    past that many tokens (data.max_length), so a row far longer holds its first kept_tokens + 1 tokens only
    (`_encode_kept`): one more than kept says it was longer. `truncated` (data.overlong=truncate): the rows are cut
    there, so a prefix-stable conversation's turns that begin past the cut are neither rendered on their own nor
    checked (each turn's prefix is rendered once more: a conversation of thousands of short turns took minutes, its
    tokens past the cut thrown away); dropped or refused rows are not cut, and every turn is checked (a template that
    rewrites a turn past the cut still gives a row per turn, those that fit kept)."""
    messages = checked(messages, thinking)
    try:
        return [_whole(tokenizer, messages, thinking, kept_tokens, truncated)]
    except NotPrefixStable:
        pass
    rows = []
    for index in answered_turns(messages):
        text = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
        prompt = _render(tokenizer, messages[:index], add_generation_prompt=True)
        try:
            rows.append(
                _masked(
                    _encode_kept(tokenizer, text, kept_tokens),
                    _turn_spans(tokenizer, messages, index, text, prompt, thinking),
                )
            )
        except NotPrefixStable:
            raise UserError(
                f"chat template of {_name(tokenizer)} does not render assistant turn {index + 1} after its own "
                "generation prompt: no text shows what the model generates"
            ) from None
    return rows


def checked(messages: Sequence[Message], thinking: str) -> list[Message]:
    if thinking not in THINKING:
        raise UserError(f"data.thinking={thinking!r} is not one of {', '.join(THINKING)}")
    return list(messages)


def _whole(tokenizer, messages: list[Message], thinking: str, kept_tokens: Optional[int], truncated: bool) -> Row:
    """The conversation rendered once, every assistant turn that answers one before it in the mask (an opening
    one is context: `answered_turns`), up to the turns that begin past its first `kept_tokens` tokens where it is
    `truncated` there (else all); NotPrefixStable where it cannot be."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    encoded = _encode_kept(tokenizer, full, kept_tokens)
    ids, offsets = encoded
    # a turn whose prompt ends past where the last token kept begins has no token in the row kept (a token the
    # tokenizer adds is (0, 0), of no text); uncut, every turn has
    cut_at = len(full)
    if truncated and kept_tokens is not None and len(ids) > kept_tokens:
        cut_at = max((start for start, end in offsets[:kept_tokens] if end > start), default=0)
    spans = []
    for index in answered_turns(messages):
        prompt = _render(tokenizer, messages[:index], add_generation_prompt=True)
        if len(prompt) > cut_at:  # it and every later turn begin past the tokens kept
            break
        spans += _turn_spans(tokenizer, messages, index, full, prompt, thinking)
    return _masked(encoded, spans)


def _turn_spans(
    tokenizer, messages: list[Message], index: int, text: str, prompt: str, thinking: str
) -> list[tuple[int, int]]:
    """The characters of `text` the model generates for assistant turn `index` (less its reasoning with
    data.thinking=mask), `prompt` being the conversation before it rendered with the generation prompt;
    NotPrefixStable where `text` does not hold that turn as the template renders it after the generation prompt."""
    turn = _render(tokenizer, messages[: index + 1], add_generation_prompt=False)
    if not (text.startswith(prompt) and text.startswith(turn) and len(turn) > len(prompt)):
        raise NotPrefixStable(index)
    if messages[index].get(CUT_KEY):
        span = (len(prompt), _content_end(text, len(prompt), len(turn), messages[index]["content"], index))
    else:
        span = (len(prompt), len(prompt) + _generated_length(text[len(prompt) : len(turn)], tokenizer.eos_token))
    if messages[index].get(TOOL_CALLS_KEY) and not _renders(tokenizer, messages, index, (TOOL_CALLS_KEY,), turn):
        raise UserError(
            f"chat template of {_name(tokenizer)} does not render assistant turn {index + 1}'s {TOOL_CALLS_KEY} (the "
            "turn renders the same without them), so the drafter would learn an end of turn where the target calls "
            "a tool: use the target's tool-calling chat template, or leave conversations with tool calls out"
        )
    key = next((key for key in REASONING_KEYS if messages[index].get(key)), None)
    reasoning = messages[index][key] if key else ""
    if not reasoning.strip():
        return [span]
    # a template that renders no reasoning would drop it without a word, and the drafter learn a turn without it
    if text.find(reasoning.strip(), *span) < 0 and not _renders(tokenizer, messages, index, REASONING_KEYS, turn):
        raise UserError(
            f"data.thinking={thinking}: the chat template of {_name(tokenizer)} does not render assistant turn "
            f"{index + 1}'s reasoning (its {key}), so it would be left out without a word: use the target's reasoning "
            "chat template, or remove the reasoning from the data (data.thinking trains on it or masks it, no setting "
            "leaves it out)"
        )
    if thinking == "mask":
        return _without(span, text, reasoning.strip(), index)
    return [span]


def _renders(tokenizer, messages: list[Message], index: int, keys: Sequence[str], turn: str) -> bool:
    """Whether the template renders turn `index`'s `keys`: `turn` (`messages[: index + 1]` rendered) changes
    without them."""
    without = {key: value for key, value in messages[index].items() if key not in keys}
    return _render(tokenizer, [*messages[:index], without], add_generation_prompt=False) != turn


def _content_end(text: str, start: int, end: int, content: str, index: int) -> int:
    """Where the content of the cut assistant turn rendered in `text[start:end]` ends: its last verbatim
    occurrence there (after any reasoning the template renders before it), or that of the content without
    its surrounding whitespace, which some templates trim (Llama-3's, Gemma's)."""
    for rendered in (content, content.strip()):
        found = text.rfind(rendered, start, end)
        if found >= 0:
            return found + len(rendered)
    raise UserError(
        f"assistant turn {index + 1} is marked {CUT_KEY}, but the chat template does not render its content "
        "verbatim, so where the end-of-turn after it begins is unknown (drop the key to train on it as finished)"
    )


def _masked(encoded: tuple[list[int], list[tuple[int, int]]], spans: list[tuple[int, int]]) -> Row:
    """The token ids and their mask: 1 where a token's first character lies in one of `spans` (disjoint, in order:
    found by bisection, as a conversation of thousands of turns has thousands of spans)."""
    ids, offsets = encoded
    starts = [lo for lo, _ in spans]

    def generated(start: int) -> bool:
        found = bisect.bisect_right(starts, start) - 1
        return found >= 0 and start < spans[found][1]

    # Offsets (0, 0) belong to tokens the tokenizer added itself (BOS), never to the rendered text.
    return ids, [int(end > start and generated(start)) for start, end in offsets]


def _without(span: tuple[int, int], full: str, reasoning: str, index: int) -> list[tuple[int, int]]:
    """The span less the first verbatim occurrence of the turn's reasoning in it."""
    start = full.find(reasoning, span[0], span[1])
    if start < 0:
        raise UserError(
            f"data.thinking=mask: the chat template does not render assistant turn {index + 1}'s reasoning verbatim "
            "in that turn, so it cannot be told apart from the answer (train on it with data.thinking=train)"
        )
    return [(span[0], start), (start + len(reasoning), span[1])]


def _generated_length(span: str, eos_token: str | None) -> int:
    """How many leading characters of an assistant span (content + whatever the template emits up
    to the next turn) the model actually generates.

    The model stops by emitting a stop token; what the template writes after that token (a newline
    before the next header, say) is glue the serving engine never sees the model produce. So:
    - if the span holds `eos_token`, the model's stop token is known: keep everything up to and
      including its last occurrence (ChatML `...<|im_end|>` + "\n", the reference `...<|end|>` + "\n");
    - otherwise the template ends turns with its own marker that is not eos_token (Llama-3
      `<|eot_id|>` with eos `<|end_of_text|>`, ChatML `<|im_end|>` with eos `<|endoftext|>`, Gemma
      `<end_of_turn>`): the span runs exactly to where the next turn begins, so keep it all but its
      trailing whitespace, which no template's end-of-turn marker ends with and which is
      inter-turn glue. Serving engines stop on these markers too (generation_config lists them).
    """
    if eos_token and eos_token in span:
        return span.rindex(eos_token) + len(eos_token)
    return len(span.rstrip())


def render_prompt(
    tokenizer, messages: Sequence[Message], kept_tokens: Optional[int] = None, from_end: bool = False
) -> tuple[list[int], Optional[str]]:
    """Token ids of the conversation up to its last assistant turn, ending with the generation
    prompt, and that assistant turn's content (the reference answer); a conversation that ends with a
    user turn (a prompt with no answer yet, as MT-bench's) is rendered whole, with no reference. An
    opening assistant turn is context, never the answer (`answered_turns`). `kept_tokens`: only that many of the
    prompt's first tokens matter (a regeneration's: a longer prompt is not answered), or with `from_end` its last
    (the eval's), so a prompt far longer holds kept_tokens + 1 of them only (`_encode_kept`)."""
    messages = list(messages)
    last = prompt_end(messages)
    answer = messages[last]["content"] if last < len(messages) else None
    text = _render(tokenizer, messages[:last], add_generation_prompt=True)
    ids, _ = _encode_kept(tokenizer, text, kept_tokens, from_end)
    return ids, answer


def prompt_end(messages: Sequence[Message]) -> int:
    """Where a conversation's prompt ends (`render_prompt`): the whole of one that ends with a user turn, else
    before its last assistant turn that answers one."""
    if messages and messages[-1]["role"] == "user":
        return len(messages)
    last = max(answered_turns(list(messages)), default=None)
    if last is None:
        raise UserError("conversation has no assistant turn after a prompt to use as the reference answer")
    return last


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(
            f"tokenizer of {_name(tokenizer)} has no chat template; use the chat/instruct version of the model "
            "or add one (a chat_template.jinja file next to tokenizer_config.json)"
        )


def _render(tokenizer, messages: list[Message], add_generation_prompt: bool) -> str:
    require_chat_template(tokenizer)
    messages = [_for_template(message) for message in messages]
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except TemplateError as err:  # raise_exception() in templates, e.g. "roles must alternate"
        raise UserError(f"chat template of {_name(tokenizer)} rejected the conversation: {err}") from None


def _for_template(message: Message) -> Message:
    """A turn as a serving engine hands it to the template. A turn without reasoning (or tool calls) has None
    under those keys (one Arrow schema for all rows): they are left out, as a template tests whether a key is
    there, not what it holds. The cut mark is draftsmith's, not the template's: a cut turn renders as any other.
    Each tool call's arguments are an object, as vLLM parses OpenAI's JSON text before rendering (what templates
    expect: most write them with `tojson`)."""
    message = {key: value for key, value in message.items() if value is not None and key != CUT_KEY}
    if TOOL_CALLS_KEY in message:
        message[TOOL_CALLS_KEY] = [
            {
                **{key: value for key, value in call.items() if value is not None},
                "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])},
            }
            for call in message[TOOL_CALLS_KEY]
        ]
    return message


def _encode(tokenizer, text: str, whole: Optional[str] = None) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokenize rendered text exactly as the target will see it.

    Special tokens (BOS) are added unless the template already wrote the BOS text itself (Llama-3
    templates start with `<|begin_of_text|>`); adding it again would give the target a doubled BOS
    it never saw in training. Tokenizers that add no BOS (Qwen) are unaffected either way. `whole`: the text that
    `text` is a cut of, which decides it (`_encode_kept`).
    """
    bos = tokenizer.bos_token
    add_special_tokens = not (bos and (text if whole is None else whole).startswith(bos))
    try:
        encoding = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True, verbose=False)
    except NotImplementedError:
        raise UserError(
            f"tokenizer of {_name(tokenizer)} gives no character offsets; a fast (tokenizers) tokenizer is needed"
        ) from None
    return list(encoding["input_ids"]), [tuple(offset) for offset in encoding["offset_mapping"]]


def _encode_kept(
    tokenizer, text: str, kept_tokens: Optional[int], from_end: bool = False
) -> tuple[list[int], list[tuple[int, int]]]:
    """`_encode(text)`; with `kept_tokens`, of a text more than twice CHARACTERS_PER_KEPT_TOKEN·(kept_tokens + 1)
    characters long (a shorter one's cut would have no second cut inside it to agree with) only its first
    kept_tokens + 1 tokens (`from_end`: its last), read from a prefix (a suffix) of it.
    A cut's tokens next to it may differ from the whole text's (a word cut in two), so the cut doubles until two cuts
    agree on the tokens kept, each holding more of them (a token the tokenizer adds at the other end, a BOS, is past
    them; the special tokens added are the whole text's). Two cuts agreeing is no proof: the tokens are the whole
    text's where no tokenizer's context reaches across the 64 characters a kept token that a cut leaves beyond them
    (none did in fuzzing of byte-level BPE and SentencePiece-style tokenizers; at 8 a SentencePiece-style one did).
    A text whose cuts never agree, or hold no more than kept_tokens + 1 tokens (over 64 characters a token), is then
    encoded whole, at up to three times the cost of encoding it whole at once."""
    length = None if kept_tokens is None else CHARACTERS_PER_KEPT_TOKEN * (kept_tokens + 1)
    if length is not None and 2 * length < len(text):
        wanted = kept_tokens + 1
        held = slice(-wanted, None) if from_end else slice(wanted)  # the tokens a cut must agree on
        shorter = None
        while length < len(text):
            ids, offsets = _encode(tokenizer, text[-length:] if from_end else text[:length], whole=text)
            if len(ids) > wanted and shorter is not None and shorter[held] == ids[held]:
                shift = len(text) - length if from_end else 0  # where the cut begins in the text
                return ids[held], [
                    (start + shift, end + shift) if end > start else (0, 0) for start, end in offsets[held]
                ]
            shorter = ids if len(ids) > wanted else None
            length *= 2
    return _encode(tokenizer, text)


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
