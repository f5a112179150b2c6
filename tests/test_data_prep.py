"""data_prep: reading conversations, chat-template loss masks, the tokenized cache, the collator."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import datasets
import pyarrow.parquet
import pytest
import torch
from tokenizers import processors

from draftsmith.data_prep import conversations
from draftsmith.data_prep.collate import Collator
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import cache_key, tokenize_conversations
from draftsmith.data_prep.template import render_prompt, render_rows, render_with_masks
from draftsmith.errors import OutOfMemory, UserError
from draftsmith.target import load_tokenizer
from tests.helpers import assert_one_line_error, run_entry_in_process, train_args

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO.parent / "shared" / "models" / "reference-target"
MATH_EVAL = REPO.parent / "shared" / "data" / "corpus" / "math.eval.jsonl.gz"

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_TEMPLATE = (
    r"{% set loop_messages = messages %}{% for message in loop_messages %}"
    r"{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    r"+ message['content'] | trim + '<|eot_id|>' %}"
    r"{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's template without its `tools` branch (no tools are passed here): ChatML with
# a default system message when the conversation has none.
QWEN25_TEMPLATE = r"""{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""  # noqa: E501

ANSWER_1 = "Paris is the capital of France.\n"  # the trailing newline is content, Llama-3's trim drops it
ANSWER_2 = "About 2.1 million people live in Paris."
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": ANSWER_1},
    {"role": "user", "content": "How many people live there?"},
    {"role": "assistant", "content": ANSWER_2},
]


@pytest.fixture(scope="module", autouse=True)
def isolated_datasets_cache(tmp_path_factory):
    """Keep datasets' own cache (json/parquet builders, map results) out of the user's home."""
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = str(tmp_path_factory.mktemp("hf_datasets"))
    datasets.disable_progress_bars()
    yield datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = saved
    datasets.enable_progress_bars()


@pytest.fixture(scope="module")
def reference_tokenizer():
    return load_tokenizer(str(REFERENCE))


def test_a_conversation_of_thousands_of_turns_renders_only_the_turns_a_truncated_row_keeps(
    reference_tokenizer, monkeypatch
):
    """Every assistant turn's prefix was rendered through the template and each token tested against every turn's
    span: quadratic in the turns, before data.max_length cut the row (2,000 short exchanges took 89 s for 64 tokens
    kept). With data.overlong=truncate the turns that begin past the tokens kept are not rendered on their own, and
    the rows cut are as before, token for token and mask for mask, whichever token the cut falls on (multi-byte
    characters included)."""
    import draftsmith.data_prep.template as template

    def exchanges(count: int) -> list[dict]:
        return [
            m
            for i in range(count)
            for m in ({"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": f"a{i} 🙂"})
        ]

    whole = render_rows(reference_tokenizer, exchanges(12))
    assert len(whole) == 1
    ids, mask = whole[0]
    for kept in range(1, len(ids) + 2):
        (cut_ids, cut_mask), *more = render_rows(reference_tokenizer, exchanges(12), kept_tokens=kept, truncated=True)
        assert not more and (cut_ids[:kept], cut_mask[:kept]) == (ids[:kept], mask[:kept]), kept
    renders = []
    real = template._render
    monkeypatch.setattr(template, "_render", lambda *args, **kwargs: renders.append(1) or real(*args, **kwargs))
    (cut_ids, cut_mask), *_ = render_rows(reference_tokenizer, exchanges(2000), kept_tokens=64, truncated=True)
    assert len(renders) < 20 and any(cut_mask[:64])


def test_a_dropped_conversations_turns_that_fit_are_kept_where_a_later_turn_is_rewritten(tmp_path):
    """data.overlong=drop reads every turn: a template that rewrites a turn only past data.max_length (its reasoning
    rendered only while it is the last turn, as gpt-oss's does) still makes a row per turn, and the first turn's,
    which fits, is kept; the conversation as one row, dropped whole, lost it (a review of the cut rows, 2026-12-06)."""
    tokenizer = load_tokenizer(str(REFERENCE))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]})
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.bos_token, tokenizer.eos_token = None, "<|im_end|>"
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and m.reasoning_content and loop.last %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "tell me " + "a lot " * 60},
        {"role": "assistant", "content": "sure", "reasoning_content": "thinking"},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "welcome"},
    ]
    conversations = load_conversations([str(write_jsonl(tmp_path / "c.jsonl", [{"messages": messages}]))])
    rows = tokenize_conversations(conversations, tokenizer, 30, overlong="drop", cache_dir=str(tmp_path / "cache"))
    assert len(rows) == 1 and len(rows[0]["input_ids"]) <= 30 and any(rows[0]["loss_mask"])


def lengths_encoded(monkeypatch) -> list[int]:
    """The length of every text the chat template's code tokenizes from now on, in order."""
    import draftsmith.data_prep.template as template

    lengths, real = [], template._encode

    def encode(tokenizer, text, **kwargs):
        lengths.append(len(text))
        return real(tokenizer, text, **kwargs)

    monkeypatch.setattr(template, "_encode", encode)
    return lengths


@pytest.mark.slow
def test_an_answer_of_megabytes_is_encoded_only_as_far_as_the_row_keeps(reference_tokenizer, monkeypatch):
    """One answer of tens of megabytes was encoded whole before data.max_length cut its row (20 MB: 45 s and 4 GB;
    88 MB aborted the process in the tokenizer's allocator). A row cut to k tokens is read from a prefix of the text
    now, doubled until two cuts agree on its first k + 1 tokens: the same tokens and mask as the whole text's, for
    words, multi-byte characters and one word of 200,000 characters, from a quarter of the text or less, with a
    byte-level BPE and a SentencePiece-style tokenizer (the whole text one BPE word)."""
    import random

    encoded = lengths_encoded(monkeypatch)
    words = random.Random(0).choices(["alpha", "béta", "🙂", "gamma\n", "x" * 300], k=6000)
    for tokenizer in (reference_tokenizer, sentencepiece_style(reference_tokenizer.chat_template)):
        for answer in (" ".join(words), "ab" * 100_000 + " end"):
            messages = [{"role": "user", "content": "Summarise."}, {"role": "assistant", "content": answer}]
            ids, mask = render_rows(tokenizer, messages)[0]
            for kept in (1, 17, 64, 300):
                encoded.clear()
                (cut_ids, cut_mask), *more = render_rows(tokenizer, messages, kept_tokens=kept)
                assert not more and len(cut_ids) == kept + 1, kept
                assert (cut_ids, cut_mask) == (ids[: kept + 1], mask[: kept + 1]), kept
                assert max(encoded) < len(answer) / 4, (kept, encoded)


def sentencepiece_style(chat_template: str):
    """A tokenizer as Llama-2's and Mistral's tokenizer.json are: spaces made "▁" and the whole text one BPE word (no
    pre-tokenizer splits it), byte fallback, a BOS added; its merges learnt here from a few thousand words."""
    import random

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["alpha", "béta", "gamma", "the", "of", "and", "🙂", "123", "x" * 30, "\n"]
    corpus = [" ".join(rng.choices(words, k=200)) for _ in range(100)]
    model = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], max_token_length=40)
    model.train_from_iterator(corpus, trainer)
    model.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.mark.slow
def test_a_prompt_of_megabytes_is_encoded_only_as_far_as_the_eval_keeps(reference_tokenizer, monkeypatch):
    """The eval keeps a long prompt's last tokens, and a regeneration answers no prompt of data.max_length tokens or
    more: both were read from the whole prompt encoded (an 88 MB prompt aborts the process in the tokenizer). Read from
    a suffix or a prefix now, doubled as a row's is: the same tokens as the whole prompt's, with the reference's BOS
    added and with a template that writes its own BOS text."""
    import random

    encoded = lengths_encoded(monkeypatch)
    words = " ".join(random.Random(1).choices(["alpha", "béta", "🙂", "gamma\n", "x" * 300], k=6000))
    messages = [{"role": "user", "content": words}, {"role": "assistant", "content": "Done."}]
    for tokenizer in (reference_tokenizer, llama3_tokenizer("<|eot_id|>")):
        ids, answer = render_prompt(tokenizer, messages)
        for kept in (1, 64, 300):
            encoded.clear()
            tail, same = render_prompt(tokenizer, messages, kept, from_end=True)
            assert (tail[-kept:], same) == (ids[-kept:], answer) and len(tail) == kept + 1, kept
            assert max(encoded) < len(words) / 4, (kept, encoded)
            head, _ = render_prompt(tokenizer, messages, kept)  # a regeneration's: longer than kept, not answered
            assert head == ids[: kept + 1], kept


def llama3_tokenizer(eos: str):
    tokenizer = load_tokenizer(str(REFERENCE))
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|end_of_text|>",
            ]
        }
    )
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.eos_token = eos
    tokenizer.chat_template = LLAMA3_TEMPLATE
    return tokenizer


def qwen_tokenizer(eos: str):
    tokenizer = load_tokenizer(str(REFERENCE))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    # Like Qwen's own tokenizer: no BOS token and none added by the post-processor.
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.bos_token = None
    tokenizer.eos_token = eos
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The masked tokens decoded, one string per contiguous masked run."""
    runs: list[list[int]] = []
    for position, (token, flag) in enumerate(zip(ids, mask)):
        if flag:
            if position == 0 or not mask[position - 1]:
                runs.append([])
            runs[-1].append(token)
    return [decode(tokenizer, run) for run in runs]


def write_jsonl(path: Path, records: list, opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return path


# ---- loss masks -------------------------------------------------------------------------------


def test_reference_template_masks_exactly_the_answers(reference_tokenizer):
    ids, mask = render_with_masks(reference_tokenizer, CONVERSATION)
    assert len(ids) == len(mask)
    assert ids[0] == reference_tokenizer.bos_token_id  # the tokenizer adds <|bos|>; the template does not
    assert decode(reference_tokenizer, ids) == "<|bos|>" + reference_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )
    assert masked_runs(reference_tokenizer, ids, mask) == [ANSWER_1 + "<|end|>", ANSWER_2 + "<|end|>"]


@pytest.mark.parametrize("eos", ["<|eot_id|>", "<|end_of_text|>"])
def test_llama3_template_masks_exactly_the_answers(eos):
    tokenizer = llama3_tokenizer(eos)
    ids, mask = render_with_masks(tokenizer, CONVERSATION)
    # The template writes <|begin_of_text|> itself, so no second BOS is added.
    assert decode(tokenizer, ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert decode(tokenizer, ids[:2]) == "<|begin_of_text|><|start_header_id|>"
    # With eos <|end_of_text|> the span ends at the template's own <|eot_id|>: same mask.
    assert masked_runs(tokenizer, ids, mask) == [ANSWER_1.strip() + "<|eot_id|>", ANSWER_2 + "<|eot_id|>"]


@pytest.mark.parametrize("eos", ["<|im_end|>", "<|endoftext|>"])
@pytest.mark.parametrize("with_system", [True, False])
def test_chatml_template_masks_exactly_the_answers(eos, with_system):
    tokenizer = qwen_tokenizer(eos)
    conversation = CONVERSATION if with_system else CONVERSATION[1:]  # else the default system prompt
    ids, mask = render_with_masks(tokenizer, conversation)
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert decode(tokenizer, ids) == text  # no BOS added
    assert masked_runs(tokenizer, ids, mask) == [ANSWER_1 + "<|im_end|>", ANSWER_2 + "<|im_end|>"]


# Gemma's turns: a system prompt folds into the first user turn, the assistant is "model", every turn
# ends with <end_of_turn> (eos is <eos>, which a turn never holds).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% set system = '' %}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set system = m['content'] + '\n\n' %}{% else %}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
    "{% if loop.index0 == 1 and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# gpt-oss's harmony format for one answer: the model writes its reasoning on the analysis channel, then
# a header of its own and the answer on the final channel, ending with <|return|>.
HARMONY_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% if m.get('thinking') %}<|start|>assistant<|channel|>analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|return|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def family_tokenizer(template: str, specials: list[str], eos: str, bos: str | None):
    tokenizer = load_tokenizer(str(REFERENCE))
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # the template writes BOS
    tokenizer.bos_token, tokenizer.eos_token, tokenizer.chat_template = bos, eos, template
    return tokenizer


def test_gemma_turns_mask_exactly_the_answers():
    tokenizer = family_tokenizer(GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>", "<|bos|>")
    ids, mask = render_with_masks(tokenizer, CONVERSATION)
    assert decode(tokenizer, ids) == tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert masked_runs(tokenizer, ids, mask) == [ANSWER_1.strip() + "<end_of_turn>", ANSWER_2 + "<end_of_turn>"]


def test_harmony_masks_the_analysis_channel_and_the_final_answer():
    """What gpt-oss generates after `<|start|>assistant`: its reasoning, the final channel's header
    and the answer, up to <|return|>; the prompt's turns stay out."""
    specials = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"]
    tokenizer = family_tokenizer(HARMONY_TEMPLATE, specials, "<|return|>", None)
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": ANSWER_1, "thinking": "The user asks for a capital."}]  # fmt: skip
    ids, mask = render_with_masks(tokenizer, conversation)
    assert masked_runs(tokenizer, ids, mask) == [
        "<|channel|>analysis<|message|>The user asks for a capital.<|end|><|start|>assistant<|channel|>final<|message|>"
        + ANSWER_1
        + "<|return|>"
    ]


# Qwen3's way: the reasoning as `reasoning_content`, rendered between <think> tags before the answer.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.reasoning_content is string %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING = "The user asks for a capital."
# As Qwen3's and Qwen3.5's templates do (written for this test): an assistant turn after the last user message
# carries a <think> block, empty without reasoning; an earlier turn is rendered without one
REWRITING_TEMPLATE = (
    "{% set last = namespace(user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set last.user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > last.user %}"
    "<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_rewrites_earlier_turns_gives_a_row_per_assistant_turn(tmp_path, reference_tokenizer):
    """No rendering up to a turn is a prefix of the whole conversation's, so each assistant turn is a row of
    its own: the conversation up to it as the template renders it when the model is asked for that turn, only
    that turn (its <think> block included, its reasoning out with data.thinking=mask) in the mask. A
    prefix-stable template keeps one row; the tokenized data set names each turn's row."""
    tokenizer = family_tokenizer(
        REWRITING_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None
    )
    with pytest.raises(UserError, match="is not prefix-stable for assistant turn 3"):
        render_with_masks(tokenizer, CONVERSATION)
    rows = render_rows(tokenizer, CONVERSATION)
    assert [decode(tokenizer, ids) for ids, _ in rows] == [
        tokenizer.apply_chat_template(CONVERSATION[:end], tokenize=False) for end in (3, 5)
    ]
    assert "<think>" not in decode(tokenizer, rows[1][0]).split(ANSWER_2)[0].split("How many")[0]  # rewritten
    assert [masked_runs(tokenizer, *row) for row in rows] == [
        [f"<think>\n\n</think>\n\n{answer}<|im_end|>"] for answer in (ANSWER_1, ANSWER_2)
    ]
    reasoned = [*CONVERSATION[:4], {**CONVERSATION[4], "reasoning_content": REASONING}]
    _, (ids, mask) = render_rows(tokenizer, reasoned, thinking="mask")
    assert masked_runs(tokenizer, ids, mask) == ["<think>\n", f"\n</think>\n\n{ANSWER_2}<|im_end|>"]
    assert render_rows(reference_tokenizer, CONVERSATION) == [render_with_masks(reference_tokenizer, CONVERSATION)]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}])
    tokenized = tokenize_conversations(load_conversations([str(path)]), tokenizer, 512, cache_dir=str(tmp_path))
    assert list(tokenized["input_ids"]) == [rows[0][0], rows[1][0], rows[0][0]]
    assert [sample.split(":")[-1] for sample in tokenized["sample"]] == ["1 turn 1", "1 turn 2", "2"]


@pytest.mark.parametrize("family", ["harmony", "qwen3"])
def test_thinking_is_trained_on_or_masked_by_a_setting(family):
    """data.thinking=mask leaves the reasoning itself out of the loss, wherever the template puts it;
    the markup around it, which the model generates too, stays in."""
    if family == "harmony":
        tokenizer = family_tokenizer(
            HARMONY_TEMPLATE, ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"], "<|return|>", None
        )
        turn, before, after = (
            {"thinking": REASONING},
            "<|channel|>analysis<|message|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
        )
        end = "<|return|>"
    else:
        tokenizer = family_tokenizer(
            THINK_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None
        )
        turn, before, after, end = {"reasoning_content": REASONING}, "<think>\n", "\n</think>\n\n", "<|im_end|>"
    conversation = [{"role": "user", "content": "What is the capital of France?"},
                    {"role": "assistant", "content": ANSWER_1, "thinking": None, "reasoning_content": None,
                     **turn}]  # fmt: skip
    ids, trained = render_with_masks(tokenizer, conversation)
    assert masked_runs(tokenizer, ids, trained) == [before + REASONING + after + ANSWER_1 + end]
    same, masked = render_with_masks(tokenizer, conversation, thinking="mask")
    assert same == ids and masked_runs(tokenizer, ids, masked) == [before, after + ANSWER_1 + end]
    silent = family_tokenizer(
        GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>", "<eos>"], "<eos>", "<|bos|>"
    )  # renders none: the reasoning was left out without a word with data.thinking=train (the default)
    key = next(iter(turn))
    for thinking in ("train", "mask"):
        with pytest.raises(UserError) as caught:
            render_with_masks(silent, conversation, thinking=thinking)
        assert str(caught.value) == (
            f"data.thinking={thinking}: the chat template of {silent.name_or_path} does not render assistant turn 2's "
            f"reasoning (its {key}), so it would be left out without a word: use the target's reasoning chat "
            "template, or remove the reasoning from the data (data.thinking trains on it or masks it, no setting "
            "leaves it out)"
        )
    if family == "qwen3":  # rendered, but not as given: trained on, not masked
        shouting = family_tokenizer(
            THINK_TEMPLATE.replace("m.reasoning_content }}", "m.reasoning_content | upper }}"),
            ["<|im_start|>", "<|im_end|>", "<think>", "</think>"],
            "<|im_end|>",
            None,
        )
        ids, trained = render_with_masks(shouting, conversation)
        assert masked_runs(shouting, ids, trained) == [before + REASONING.upper() + after + ANSWER_1 + end]
        with pytest.raises(UserError, match="does not render assistant turn 2's reasoning verbatim"):
            render_with_masks(shouting, conversation, thinking="mask")


def test_a_cut_answer_is_trained_on_but_not_the_end_of_turn_after_it(tmp_path, reference_tokenizer):
    """An answer marked cut (data_prep.regenerate's `"cut": true`: the target reached max_new_tokens before it
    ended its turn) keeps its content in the mask and leaves out the end-of-turn the template renders after it,
    which the target did not generate there; the rendered ids stay the same. In every family, with reasoning
    masked, in a row per turn, and read from a user's file."""
    cut = [*CONVERSATION[:2], {**CONVERSATION[2], "cut": True}, *CONVERSATION[3:]]
    ids, mask = render_with_masks(reference_tokenizer, cut)
    assert ids == render_with_masks(reference_tokenizer, CONVERSATION)[0]
    assert masked_runs(reference_tokenizer, ids, mask) == [ANSWER_1, ANSWER_2 + "<|end|>"]
    ids, mask = render_with_masks(llama3_tokenizer("<|eot_id|>"), cut)  # trims the content it renders
    assert masked_runs(llama3_tokenizer("<|eot_id|>"), ids, mask) == [ANSWER_1.strip(), ANSWER_2 + "<|eot_id|>"]
    chatml = qwen_tokenizer("<|im_end|>")
    assert masked_runs(chatml, *render_with_masks(chatml, cut)) == [ANSWER_1, ANSWER_2 + "<|im_end|>"]

    think = family_tokenizer(THINK_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None)
    reasoned = [CONVERSATION[1], {**CONVERSATION[2], "reasoning_content": REASONING, "cut": True}]
    assert masked_runs(think, *render_with_masks(think, reasoned, thinking="mask")) == [
        "<think>\n",
        "\n</think>\n\n" + ANSWER_1,
    ]
    rewriting = family_tokenizer(
        REWRITING_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None
    )
    rows = render_rows(rewriting, [*CONVERSATION[:4], {**CONVERSATION[4], "cut": True}])
    assert [masked_runs(rewriting, *row) for row in rows] == [
        [f"<think>\n\n</think>\n\n{ANSWER_1}<|im_end|>"],
        [f"<think>\n\n</think>\n\n{ANSWER_2}"],
    ]

    path = write_jsonl(tmp_path / "cut.jsonl", [{"messages": cut}, {"messages": CONVERSATION}])
    conversations = load_conversations([str(path)])
    assert [[m["cut"] for m in row["messages"]] for row in conversations] == [
        [None, None, True, None, None],
        [None] * 5,
    ]
    tokenized = tokenize_conversations(conversations, reference_tokenizer, 512, cache_dir=str(tmp_path / "cache"))
    assert [masked_runs(reference_tokenizer, row["input_ids"], row["loss_mask"]) for row in tokenized] == [
        [ANSWER_1, ANSWER_2 + "<|end|>"],
        [ANSWER_1 + "<|end|>", ANSWER_2 + "<|end|>"],
    ]
    for turn, value, error in [
        (2, "yes", r"turn 3 has a cut of 'yes', expected true or false"),
        (1, True, "turn 2 is a user turn marked cut: only an assistant turn can be cut off"),
    ]:
        messages = [dict(m) for m in CONVERSATION]
        messages[turn]["cut"] = value
        bad = write_jsonl(tmp_path / f"bad{turn}.jsonl", [{"messages": messages}])
        with pytest.raises(UserError, match=rf"bad{turn}\.jsonl record 1: {error}"):
            load_conversations([str(bad)])


def test_the_loader_keeps_a_turns_reasoning_and_the_setting_keys_the_cache(tmp_path):
    path = tmp_path / "reasoning.jsonl"
    record = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                           {"role": "assistant", "content": ANSWER_1, "reasoning_content": REASONING}]}  # fmt: skip
    path.write_text(json.dumps(record) + "\n")
    conversations = load_conversations([str(path)])
    assert (
        conversations[0]["messages"][1]["reasoning_content"] == REASONING
        and conversations[0]["messages"][1]["thinking"] is None
    )
    tokenizer = family_tokenizer(
        THINK_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None
    )
    cache = str(tmp_path / "cache")
    trained = tokenize_conversations(conversations, tokenizer, 256, cache_dir=cache)
    masked = tokenize_conversations(conversations, tokenizer, 256, cache_dir=cache, thinking="mask")
    assert trained[0]["input_ids"] == masked[0]["input_ids"] and sum(masked[0]["loss_mask"]) < sum(
        trained[0]["loss_mask"]
    )
    path.write_text(
        json.dumps(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "thinking": 3}]}
        )
        + "\n"
    )
    with pytest.raises(UserError, match="turn 2 has a thinking of type int, expected a string"):
        load_conversations([str(path)])


# Qwen2.5-Instruct's own branch for an assistant turn that calls tools, verbatim (QWEN25_TEMPLATE leaves it out).
QWEN25_TOOL_CALLS = r"""    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
"""
TOOL_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def tool_conversation(content, call=TOOL_CALL, role="assistant") -> dict:
    """OpenAI's shape: the assistant calls a tool (its content null, empty or text), the tool answers."""
    return {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Paris?"},
                         {"role": role, "content": content, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 12}'},
                         {"role": "assistant", "content": "12 degrees."}]}  # fmt: skip


def test_tool_calls_are_trained_on_or_refused_where_the_template_renders_none(tmp_path, reference_tokenizer):
    """An assistant turn's OpenAI tool calls are what the target generates there: kept, handed to the template
    with their arguments an object as vLLM does (given as JSON text or as an object alike), and in the loss mask.
    A turn with a null content was refused, one with text lost its calls, and the drafter learned an end of turn
    where the target calls a tool; a template that renders no tool calls is refused in one line."""
    tokenizer = qwen_tokenizer("<|im_end|>")
    tool_branch = '    {%- elif message.role == "tool" %}'
    tokenizer.chat_template = QWEN25_TEMPLATE.replace(tool_branch, QWEN25_TOOL_CALLS + tool_branch)
    as_object = {**TOOL_CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    records = [tool_conversation(None), tool_conversation("", as_object), tool_conversation("Let me check.")]
    path = write_jsonl(tmp_path / "tools.jsonl", records)
    conversations = load_conversations([str(path)])
    assert [row["messages"][2]["tool_calls"] for row in conversations] == [[TOOL_CALL]] * 3  # arguments as JSON text
    assert conversations[0]["messages"][3]["tool_call_id"] == "call_1"
    tokenized = tokenize_conversations(conversations, tokenizer, 512, cache_dir=str(tmp_path / "cache"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert [masked_runs(tokenizer, row["input_ids"], row["loss_mask"]) for row in tokenized] == [
        [call, "12 degrees.<|im_end|>"],
        [call, "12 degrees.<|im_end|>"],
        ["Let me check.\n" + call, "12 degrees.<|im_end|>"],
    ]
    with pytest.raises(UserError) as caught:  # the reference target's template renders content alone
        tokenize_conversations(conversations, reference_tokenizer, 512, cache_dir=str(tmp_path / "cache"))
    assert str(caught.value) == (
        f"{path} record 1: chat template of {reference_tokenizer.name_or_path} does not render assistant turn 3's "
        "tool_calls (the turn renders the same without them), so the drafter would learn an end of turn where the "
        "target calls a tool: use the target's tool-calling chat template, or leave conversations with tool calls out"
    )
    for record, error in [
        (tool_conversation("Hi", role="user"), "turn 3 is a user turn with tool_calls: only an assistant turn calls"),
        (tool_conversation(None, {"function": {"arguments": "{}"}}), "turn 3: tool call 1 has no function name"),
        (
            tool_conversation(None, {"function": {"name": "f", "arguments": "{oops"}}),
            r"turn 3: tool call 1 \(f\) has arguments that are not a JSON object",
        ),
    ]:
        with pytest.raises(UserError, match=rf"bad\.jsonl record 1: {error}"):
            load_conversations([str(write_jsonl(tmp_path / "bad.jsonl", [record]))])


def test_render_prompt_stops_at_the_last_assistant_turn(reference_tokenizer):
    ids, answer = render_prompt(reference_tokenizer, CONVERSATION)
    assert answer == ANSWER_2
    expected = reference_tokenizer.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert decode(reference_tokenizer, ids) == "<|bos|>" + expected
    assert expected.endswith("<|assistant|>\n")
    llama_ids, _ = render_prompt(llama3_tokenizer("<|eot_id|>"), CONVERSATION)
    assert decode(llama3_tokenizer("<|eot_id|>"), llama_ids[:1]) == "<|begin_of_text|>"  # still a single BOS


def test_template_errors():
    tokenizer = load_tokenizer(str(REFERENCE))
    tokenizer.chat_template = None
    with pytest.raises(UserError, match="tokenizer of .*reference-target has no chat template"):
        render_with_masks(tokenizer, CONVERSATION)
    # A template whose output depends on the number of messages rewrites earlier turns.
    tokenizer.chat_template = (
        "{{ messages | length }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    )
    with pytest.raises(UserError, match="is not prefix-stable for assistant turn 3"):
        render_with_masks(tokenizer, CONVERSATION)
    with pytest.raises(UserError, match="does not render assistant turn 3 after its own generation prompt"):
        render_rows(tokenizer, CONVERSATION)  # not even a turn alone: its prompt is no prefix of it
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(UserError, match="rejected the conversation: roles must alternate"):
        render_with_masks(tokenizer, CONVERSATION)


# ---- reading conversations --------------------------------------------------------------------

RECORDS = [
    {"id": "a", "domain": "geo", "messages": CONVERSATION},
    {"id": "b", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
]
SHAREGPT_ROLES = {"system": "system", "user": "human", "assistant": "gpt"}
SHAREGPT = [
    {
        "domain": "geo",
        "conversations": [{"from": SHAREGPT_ROLES[t["role"]], "value": t["content"]} for t in CONVERSATION],
    },
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "chatgpt", "value": "Hello!"}]},
]


def test_all_formats_give_identical_conversations(tmp_path):
    paths = [
        write_jsonl(tmp_path / "plain.jsonl", RECORDS),
        write_jsonl(tmp_path / "packed.jsonl.gz", RECORDS, opener=gzip.open),
        write_jsonl(tmp_path / "sharegpt.jsonl", SHAREGPT),
        tmp_path / "array.json",
        tmp_path / "table.parquet",
    ]
    paths[3].write_text(json.dumps(RECORDS))
    datasets.Dataset.from_list(RECORDS).to_parquet(str(paths[4]))
    no_reasoning = dict.fromkeys(  # one Arrow schema: absent reads as None
        ["thinking", "reasoning_content", "reasoning", "cut", "tool_calls", "tool_call_id", "name"]
    )
    expected = [[{**message, **no_reasoning} for message in record["messages"]] for record in RECORDS]
    for path in paths:
        loaded = load_conversations([str(path)])
        assert loaded.column_names == ["messages", "domain", "source", "record"]
        assert loaded["messages"] == expected, path.name
        assert list(loaded["domain"]) == ["geo", "default"], path.name
        assert list(loaded["source"]) == [str(path)] * 2 and list(loaded["record"]) == [1, 2]


def test_globs_directories_and_per_file_cap(tmp_path):
    (tmp_path / "sub").mkdir()
    first = write_jsonl(tmp_path / "a.jsonl", RECORDS)
    second = write_jsonl(tmp_path / "sub" / "b.jsonl", RECORDS[::-1])
    (tmp_path / "notes.txt").write_text("not data")
    for source in (str(tmp_path), str(tmp_path / "**" / "*.jsonl")):
        loaded = load_conversations([source], max_conversations=1)
        assert list(loaded["source"]) == [str(first), str(second)]
        assert list(loaded["domain"]) == ["geo", "default"]  # the first record of each file
    assert len(load_conversations([str(first), str(second)])) == 4


def test_a_folder_of_many_files_is_one_line_of_the_log(tmp_path, caplog):
    """A sharded dump of 500 one-record files logged 500 lines before training, every start: past 10 files a folder or
    glob is one line; up to 10 each file has its own."""
    many, few = tmp_path / "many", tmp_path / "few"
    for folder, count in ((many, 12), (few, 2)):
        folder.mkdir()
        for index in range(count):
            write_jsonl(folder / f"part-{index:02d}.jsonl", RECORDS[:1])
    caplog.set_level(logging.INFO, logger="draftsmith.data")
    assert len(load_conversations([str(many), str(few)])) == 14
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("loaded ")]
    assert lines == [f"loaded 12 conversations from 12 files of {many}"] + [
        f"loaded 1 conversations from {few / name}" for name in ("part-00.jsonl", "part-01.jsonl")
    ]


def test_hub_ids_go_through_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(path, split, revision):
        calls.append((path, split, revision))
        return datasets.Dataset.from_list(RECORDS)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    loaded = load_conversations(["someone/chats:validation", "someone/other@v1.0"])
    assert calls == [("someone/chats", "validation", None), ("someone/other", "train", "v1.0")]
    assert list(loaded["source"]) == ["someone/chats:validation"] * 2 + ["someone/other@v1.0"] * 2


USER = {"role": "user", "content": "Hi"}
ASSISTANT = {"role": "assistant", "content": "Hello!"}
GOOD = {"messages": [USER, ASSISTANT]}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([GOOD, GOOD, '{"messages": [oops'], r"bad\.jsonl:3: malformed JSON \(Expecting value column 15\)"),
        ([GOOD, {"messages": [USER, {"content": "Hello!"}]}], r"bad\.jsonl record 2: turn 2 has no role"),
        (
            [GOOD, {"messages": [USER, {"role": "assistant", "content": "  \n"}]}],
            r"bad\.jsonl record 2: turn 2 has an empty content",
        ),
        (
            [{"messages": [{"role": "wizard", "content": "Hi"}, ASSISTANT]}],
            r"bad\.jsonl record 1: turn 1 has an unknown role 'wizard'",
        ),
        ([GOOD, {"messages": [USER]}], r"bad\.jsonl record 2: no assistant turn"),
        (
            [GOOD, {"messages": [USER, {"role": "assistant", "content": 5}]}],
            r"bad\.jsonl record 2: turn 2 has a content of type int",
        ),
        ([{"prompt": "Hi", "response": "Hello!"}], r"bad\.jsonl record 1: no 'messages' field"),
        ([], r"bad\.jsonl has no records"),
        # was a report row named "['a']"
        ([GOOD, {**GOOD, "domain": ["a"]}], r"bad\.jsonl record 2: 'domain' must be a name \(a string\), not list"),
        # lines that are arrays were read as one JSON document: "bad.jsonl:2: malformed JSON (Extra data)"
        ([[1, 2, 3], GOOD], r"bad\.jsonl record 1: expected a JSON object, got list"),
    ],
    ids=[
        "malformed",
        "no-role",
        "empty-turn",
        "unknown-role",
        "no-assistant",
        "non-string",
        "no-messages",
        "empty-file",
        "list-domain",
        "array-lines",
    ],
)
def test_bad_records_name_file_and_record(tmp_path, lines, message):
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(UserError, match=message) as caught:
        load_conversations([str(path)])
    assert "\n" not in str(caught.value)


def test_openai_content_parts_are_read_as_their_texts_and_other_parts_refused(tmp_path):
    """Request logs hold OpenAI's content parts (a load sweep's journey, 2026-12-08: "a content of type list,
    expected a string"): text parts joined by newlines, as vLLM's chat API joins them, beside plain contents in the
    same file; an image part, or a part that is no object, is one line naming the record, turn and part."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    path = write_jsonl(tmp_path / "parts.jsonl", [{"messages": [{"role": "user", "content": parts}, ASSISTANT]}, GOOD])
    assert [turn["content"] for turn in load_conversations([str(path)])["messages"][0]] == ["Hello\nthere", "Hello!"]
    for part, said in (
        ({"type": "image_url", "image_url": {"url": "x"}}, "of type 'image_url'"),
        ("hi", "that is not"),
    ):
        path = write_jsonl(
            tmp_path / "image.jsonl", [GOOD, {"messages": [{"role": "user", "content": [part]}, ASSISTANT]}]
        )
        with pytest.raises(UserError, match=rf"image\.jsonl record 2: turn 1 has a content part 1 {said}.*text parts"):
            load_conversations([str(path)])


@pytest.mark.parametrize(
    "name, content, line",
    [("null.jsonl", b"null\n", 1), ("first.jsonl", b'\xef\xbb\xbf\n  null\n{"messages": []}\n', 2),
     ("one.json", b"null", 1), ("null.jsonl.gz", gzip.compress(b"null\n"), 1), ("second-batch.jsonl", None, None)],
    ids=["alone", "after-a-blank-line", "json", "gzip", "first-of-the-second-batch"],
)  # fmt: skip
def test_a_null_record_is_one_line_not_a_crash(tmp_path, name, content, line):
    """pyarrow's JSON reader ended the process with SIGSEGV (exit 139, no line, the run's lock left) on a null line
    that starts a block it parses: the file's first, or a later batch's first (datasets' builder hands pyarrow a file
    10 MiB at a time)."""
    if content is None:
        good = json.dumps(GOOD).encode() + b"\n"
        line = (10 << 20) // len(good) + 2
        content = good * (line - 1) + b"null\n" + good
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError, match=rf"^\S+{re.escape(name)}:{line}: a record that is null, not a JSON object$"):
        load_conversations([str(tmp_path / name)])


@pytest.mark.parametrize(
    "depth, keyed", [(10_000, False), (100_000, False), (1_000, True)], ids=["10k", "100k", "keys"]
)
def test_json_nested_too_deep_is_one_line_not_a_crash(tmp_path, depth, keyed):
    """A record holding JSON nested 10,000 levels deep crashed the process in pyarrow's reader (SIGSEGV, exit 139,
    no line, the run's lock left); 5,000 was exit 70 (RecursionError in draftsmith's own diagnosis). Nesting past
    500 levels is refused naming its line, keyed objects as well as arrays; nesting within it reads, as do brackets
    in a string."""
    opened = '{"a": ' * depth + "1" + "}" * depth if keyed else "[" * depth + "]" * depth
    good = json.dumps(GOOD)
    (tmp_path / "deep.jsonl").write_text(f'{good}\n{good[:-1]}, "meta": {opened}}}\n')
    with pytest.raises(UserError, match=r"deep.jsonl:2: JSON nested more than 500 levels deep, which no conv"):
        load_conversations([str(tmp_path / "deep.jsonl")])
    (tmp_path / "fine.jsonl").write_text(f'{good}\n{good[:-1]}, "meta": {"[" * 50 + "1" + "]" * 50}}}\n')
    assert len(load_conversations([str(tmp_path / "fine.jsonl")])) == 2
    brackets = {"messages": [USER, {**ASSISTANT, "content": '[{"\\"' * 600}]}  # in a string: text, no nesting
    (tmp_path / "text.jsonl").write_text(json.dumps(brackets) + "\n")
    assert load_conversations([str(tmp_path / "text.jsonl")])[0]["messages"][1]["content"] == '[{"\\"' * 600


@pytest.mark.slow
@pytest.mark.parametrize("name", ["late.jsonl", "late.jsonl.gz"])
def test_a_key_that_first_appears_past_ten_megabytes_is_read(tmp_path, name, monkeypatch):
    """datasets' JSON builder takes a file's columns from its first 10 MiB: a key first appearing later (a regenerated
    answer's `cut`, a `domain`, another field) was `cannot read FILE: DatasetGenerationError: An error occurred
    while generating the dataset`, exit 2, on valid data. It is read, every record as written."""
    long = {"messages": [USER, {**ASSISTANT, "content": "x" * 20_000}]}  # few records: their checks cost the time
    good = (json.dumps(long) + "\n").encode()
    count = (10 << 20) // len(good) + 10
    late = {**long, "domain": "code", "meta": {"x": 1}}
    late["messages"] = [*long["messages"][:-1], {**long["messages"][-1], "cut": True}]
    data = good * count + (json.dumps(late) + "\n").encode()
    (tmp_path / name).write_bytes(gzip.compress(data, compresslevel=1) if name.endswith(".gz") else data)
    # read whole, it is parsed at once: where that needs more memory than is available, one line says what to change
    with monkeypatch.context() as patched:
        patched.setattr(conversations, "WHOLE_READ_MEMORY", 1 << 40)
        said = rf"{name}: records past its first 10 MiB have keys the first ones lack \(domain, meta\), and read whole"
        with pytest.raises(OutOfMemory, match=said + r".* about \d+\.\d GiB of memory, .* GiB available; give those"):
            load_conversations([str(tmp_path / name)])
    loaded = load_conversations([str(tmp_path / name)])
    assert len(loaded) == count + 1 and loaded[-1]["domain"] == "code" and loaded[-1]["messages"][-1]["cut"] is True
    assert loaded[0]["messages"] == loaded[1]["messages"] and loaded[0]["messages"][-1]["cut"] is None


def test_a_gzip_file_damaged_inside_is_one_line(tmp_path):
    """Its deflate stream broken past the header: zlib's error was exit 70, an internal error."""
    damaged = bytearray(gzip.compress(json.dumps(GOOD).encode() * 200))
    damaged[30:60] = bytes(byte ^ 0x55 for byte in damaged[30:60])
    (tmp_path / "damaged.jsonl.gz").write_bytes(bytes(damaged))
    with pytest.raises(UserError, match=r"damaged.jsonl.gz: a damaged gzip file \(Error -3 while decompressing"):
        load_conversations([str(tmp_path / "damaged.jsonl.gz")])


def test_bad_sources(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_conversations([str(tmp_path / "missing.jsonl")])
    with pytest.raises(UserError, match="matches no"):
        load_conversations([str(tmp_path / "*.parquet")])
    with pytest.raises(UserError, match="a data source is empty"):  # `data.train=`: was the Hub's IndexError
        load_conversations([""])
    with pytest.raises(UserError, match="max_conversations"):
        load_conversations([str(write_jsonl(tmp_path / "ok.jsonl", [GOOD]))], max_conversations=0)
    empty = tmp_path / "empty.parquet"  # the columns, no rows: was `DatasetGenerationError: An error occurred ...`
    pyarrow.parquet.write_table(datasets.Dataset.from_list([GOOD]).data.table.slice(0, 0), empty)
    with pytest.raises(UserError, match=r"^\S+empty\.parquet has no records$"):
        load_conversations([str(empty)])


def test_an_empty_or_broken_parquet_file_is_our_line_alone(tmp_path, caplog):
    """A parquet file of no rows, of no bytes, or not parquet at all: our one line, and no line of datasets'
    before it (its builder logged `Failed to read file '...' with error ArrowInvalid: BatchSize must be greater
    than 0`, or `Failed to read schema ...`, above ours)."""
    no_rows, no_bytes, junk = tmp_path / "rows.parquet", tmp_path / "bytes.parquet", tmp_path / "junk.parquet"
    pyarrow.parquet.write_table(datasets.Dataset.from_list([GOOD]).data.table.slice(0, 0), no_rows)
    no_bytes.write_bytes(b"")
    junk.write_bytes(b"not parquet at all")
    caplog.set_level("DEBUG", logger="datasets")
    for path, message in [(no_rows, "has no records"), (no_bytes, "has no records"), (junk, "cannot read")]:
        with pytest.raises(UserError, match=message):
            load_conversations([str(path)])
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("datasets")]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("datasets")], logged


def test_openai_developer_and_llama_ipython_roles_read_as_system_and_tool(tmp_path):
    """OpenAI's current name for the system prompt and Llama-3.1's for a tool's result map to the roles every
    template knows, as ShareGPT's speakers do; both were refused as unknown roles."""
    record = {"messages": [{"role": "developer", "content": "Be terse."}, USER, ASSISTANT,
                           {"role": "ipython", "content": "42"}, ASSISTANT]}  # fmt: skip
    loaded = load_conversations([str(write_jsonl(tmp_path / "roles.jsonl", [record]))])
    roles = [message["role"] for message in loaded[0]["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]


# A traffic log's line with bytes that are not UTF-8, as the probe of issue #40 wrote it.
INVALID_UTF8_LINE = (
    b'{"messages": [{"role": "user", "content": "hi \xff\xfe"}, {"role": "assistant", "content": "ok"}]}'
)


def write_lines(path: Path, lines: list[bytes]) -> Path:
    data = b"".join(line + b"\n" for line in lines)
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
    return path


@pytest.mark.parametrize("name", ["traffic.jsonl", "traffic.jsonl.gz"])
def test_invalid_utf8_names_the_line_or_is_skipped_and_counted(tmp_path, name, caplog):
    good = json.dumps(GOOD).encode()
    path = write_lines(tmp_path / name, [good, b"", INVALID_UTF8_LINE, good, INVALID_UTF8_LINE])
    with pytest.raises(UserError, match=rf"{name}:3: invalid UTF-8 \(byte 0xff at byte 47 of the line\)") as caught:
        load_conversations([str(path)])
    assert "\n" not in str(caught.value) and "data.skip_invalid_utf8=true" in str(caught.value)
    with caplog.at_level("WARNING", logger="draftsmith.data"):
        kept = load_conversations([str(path)], skip_invalid_utf8=True)
    assert list(kept["record"]) == [1, 3]  # records keep their numbers in the file (a blank line is no record)
    assert f"{name}: skipped 2 record(s) that are not valid UTF-8 (data.skip_invalid_utf8=true), on line(s) 3, 5" in (
        caplog.text
    )
    # max_conversations keeps the first records before the check: a bad line after them is not read
    assert len(load_conversations([str(path)], max_conversations=1)) == 1


def test_two_user_turns_in_a_row_are_kept_and_counted(tmp_path, caplog):
    doubled = {"messages": [USER, {"role": "user", "content": "and another thing"}, ASSISTANT]}
    apart = {"messages": [USER, ASSISTANT, USER, ASSISTANT]}
    path = write_jsonl(tmp_path / "chats.jsonl", [GOOD, doubled, apart, doubled])
    with caplog.at_level("WARNING", logger="draftsmith.data"):
        loaded = load_conversations([str(path)])
    assert len(loaded) == 4
    assert "chats.jsonl: 2 conversation(s) have two user turns in a row (records 2, 4)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="draftsmith.data"):
        load_conversations([str(write_jsonl(tmp_path / "clean.jsonl", [GOOD, apart]))])
    assert "in a row" not in caplog.text


GREETING = {"role": "assistant", "content": "Hello! How can I help?"}


def test_an_opening_assistant_turn_is_context_not_trained_on(tmp_path, reference_tokenizer, caplog):
    """A chat log that opens with the assistant's greeting: the greeting is rendered, out of the mask (no
    turn before it asks for it, and no template renders the empty conversation before it), in one row or a
    row per turn; a record whose only assistant turn is the opening one has nothing to train on: one line
    naming its file and record, as a record with no assistant turn."""
    greeted = [GREETING, USER, ASSISTANT]
    ids, mask = render_with_masks(reference_tokenizer, greeted)
    assert GREETING["content"] in decode(reference_tokenizer, ids)
    assert masked_runs(reference_tokenizer, ids, mask) == [ASSISTANT["content"] + "<|end|>"]
    rewriting = family_tokenizer(
        REWRITING_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None
    )
    ((ids, mask),) = render_rows(rewriting, [GREETING, *CONVERSATION[1:3]])  # one row: the greeting's is none
    assert masked_runs(rewriting, ids, mask) == [f"<think>\n\n</think>\n\n{ANSWER_1}<|im_end|>"]
    assert render_prompt(reference_tokenizer, greeted)[1] == ASSISTANT["content"]
    ids, answer = render_prompt(reference_tokenizer, [GREETING, USER])  # a prompt: rendered whole
    assert answer is None and decode(reference_tokenizer, ids) == "<|bos|>" + reference_tokenizer.apply_chat_template(
        [GREETING, USER], tokenize=False, add_generation_prompt=True
    )

    path = write_jsonl(tmp_path / "log.jsonl", [GOOD, {"messages": greeted}, {"messages": greeted}])
    with caplog.at_level("WARNING", logger="draftsmith.data"):
        conversations = load_conversations([str(path)])
    assert "log.jsonl: 2 conversation(s) open with an assistant turn (records 2, 3): kept as context" in caplog.text
    tokenized = tokenize_conversations(conversations, reference_tokenizer, 128, cache_dir=str(tmp_path / "cache"))
    assert [masked_runs(reference_tokenizer, row["input_ids"], row["loss_mask"]) for row in tokenized] == [
        [ASSISTANT["content"] + "<|end|>"]
    ] * 3
    only_greeting = write_jsonl(tmp_path / "asstfirst.jsonl", [GOOD, {"messages": [GREETING, USER]}])
    with pytest.raises(UserError, match=r"asstfirst\.jsonl record 2: no assistant turn after the opening one"):
        load_conversations([str(only_greeting)])
    assert len(load_conversations([str(only_greeting)], prompts_only=True)) == 2  # a prompt, for eval or regenerate


def test_regeneration_keeps_an_opening_assistant_turn_and_answers_the_prompt_after_it():
    """The opening greeting is kept as written, every later assistant turn is the target's; a greeting
    followed by a user turn alone gets an answer after it."""
    from omegaconf import OmegaConf

    from draftsmith.data_prep.answer_engines import Answer
    from draftsmith.data_prep.regenerate import regenerate_batch, with_a_turn_to_answer

    class Answers:
        def __init__(self):
            self.asked = []

        def answers(self, prompts, seeds):
            self.asked += prompts
            return [Answer(f"answer {i}", cut=False) for i in range(len(prompts))]

    tokenizer, engine = load_tokenizer(str(REFERENCE)), Answers()
    prompt = with_a_turn_to_answer({"messages": [GREETING, USER]})["messages"]
    assert [m["role"] for m in prompt] == ["assistant", "user", "assistant"]
    section = OmegaConf.create({"max_turns": None, "min_turns": 1})
    out, ended, _ = regenerate_batch(engine, tokenizer, [[GREETING, USER, ASSISTANT], prompt], section, 1024)
    assert out == [
        [GREETING, USER, {**ASSISTANT, "content": "answer 0"}],
        [GREETING, USER, {**prompt[2], "content": "answer 1"}],
    ]
    assert ended == [None, None] and engine.asked == [render_prompt(tokenizer, [GREETING, USER, ASSISTANT])[0]] * 2


@pytest.mark.slow  # a whole train.py run with its eval, for its log lines: 3.4 s
def test_a_run_says_each_file_it_read_once(tmp_path, capsys):
    """Training reads data.train and data.eval for the training, again for the held-out accuracy and the eval's
    prompts and their overlap with the training set: each read said "loaded 8 conversations from ..." again, three or
    four times a file. The stderr log says each once."""
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", "data.max_conversations=8", "train.max_steps=1",
            "eval.max_prompts=1", "eval.max_new_tokens=4", "eval.tree=0", "eval.ngram_baseline=false"]  # fmt: skip
    done = run_entry_in_process(["train.py", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = [line.split("draftsmith.data: ")[1] for line in done.stderr.splitlines() if "conversations from /" in line]
    assert sorted(loaded) == [
        f"loaded 8 conversations from {REPO / 'demo' / 'data' / name}.jsonl.gz" for name in ("eval", "train")
    ]


def test_opening_assistant_turns_through_regenerate_and_train(tmp_path, token_cache, capsys):
    """The real commands on a chat log with greetings: regenerate keeps each greeting, answers the rest,
    writes no null keys and counts what it wrote (a conversation whose first prompt is over data.max_length
    is left out, not generated); train refuses a record with nothing after its greeting in one line. A
    regeneration the chat template refuses leaves no output directory behind."""
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target

    data = write_jsonl(
        tmp_path / "log.jsonl", [{"messages": [GREETING, USER, ASSISTANT]}, {"messages": [GREETING, USER]}, LONG_PROMPT]
    )
    args = ["recipe=draft", f"target.name_or_path={REFERENCE}", f"data.train=[{data}]", "data.max_length=64",
            "data.regenerate.max_new_tokens=2", f"data.regenerate.output={tmp_path / 'out'}",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    done = run_entry_in_process(["-m", "data_prep.regenerate", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (
        f"2 conversations in {tmp_path / 'out'} and 1 left out, every run's parts counted (2 generated now, 0 of "
        "them ended early at a later prompt of data.max_length=64 tokens or more, 0 at an empty answer; of those taken "
        "up now, 1 left out, ended before min_turns=1 answers: 1 at a prompt of data.max_length=64 tokens or more; "
        "0 answers taken" in done.stdout
    )
    written = [json.loads(line) for line in gzip.open(tmp_path / "out" / "part-00000.jsonl.gz", "rt")]
    assert [record["messages"][:2] for record in written] == [[GREETING, USER]] * 2  # no `"thinking": null`
    assert all(m["role"] == "assistant" and m["content"] for m in (r["messages"][2] for r in written))
    # two tokens are not a whole answer: each is kept marked cut, and the summary says so
    assert all(r["messages"][2]["cut"] is True for r in written)
    assert "2 answers cut at data.regenerate.max_new_tokens=2" in done.stdout

    refusing = load_tokenizer(str(REFERENCE))
    refusing.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with a user turn') }}"
        "{% endif %}" + refusing.chat_template
    )
    with pytest.raises(UserError, match=r"log\.jsonl record 1: chat template .* must start with a user turn"):
        regenerate(load_recipe([*args[:-2], f"data.regenerate.output={tmp_path / 'refused'}", args[-1]]),
                   load_target(str(REFERENCE)), refusing)  # fmt: skip
    assert not (tmp_path / "refused").exists()

    only_greeting = write_jsonl(tmp_path / "asstfirst.jsonl", [{"messages": [GREETING, USER]}])
    result = run_entry_in_process(
        ["train.py", *train_args(tmp_path / "train", {"train": only_greeting, "eval": only_greeting}, token_cache)],
        capsys,
    )
    assert "record 1: no assistant turn after the opening one" in assert_one_line_error(result, 2)


def test_max_length_beyond_the_targets_context_is_refused_by_every_command(tmp_path, token_cache, capsys):
    """data.max_length over the max_position_embeddings the target's config.json states (2048 for the reference
    target; times a RoPE scaling factor) is one line naming both, exit 2, from train, capture and regenerate
    before their data is read; a config that states no context is taken at its word."""
    from transformers import LlamaConfig, PretrainedConfig

    from draftsmith.data_prep.dataset import require_context, target_context

    assert target_context(LlamaConfig(max_position_embeddings=4096)) == (4096, "max_position_embeddings=4096")
    yarn = LlamaConfig(max_position_embeddings=4096, rope_parameters={"rope_type": "yarn", "factor": 4.0})
    assert target_context(yarn)[0] == 16384
    assert target_context(PretrainedConfig()) == (None, "")  # states no context
    require_context(str(REFERENCE), 2048)
    with pytest.raises(UserError, match=r"data.max_length=2049 is more than the target's context of 2048 tokens"):
        require_context(str(REFERENCE), 2049)

    missing = tmp_path / "not-read.jsonl"  # the check comes first: the data file is never opened
    data = {"train": missing, "eval": missing}
    for command in (["train.py"], ["-m", "data_prep.capture"], ["-m", "data_prep.regenerate"]):
        args = train_args(tmp_path / "run", data, token_cache, "data.max_length=100000")
        line = assert_one_line_error(run_entry_in_process([*command, *args], capsys), 2)
        assert line == (
            "error: data.max_length=100000 is more than the target's context of 2048 tokens "
            "(max_position_embeddings=2048 in its config); set data.max_length=2048 or less"
        ), command
    # a regeneration's answers as long as the context (3,000 tokens ran on past it, written as training data; 1e9 for
    # minutes until killed), as the eval's are
    args = train_args(tmp_path / "run", data, token_cache, "data.regenerate.max_new_tokens=3000")
    line = assert_one_line_error(run_entry_in_process(["-m", "data_prep.regenerate", *args], capsys), 2)
    assert line == (
        "error: data.regenerate.max_new_tokens=3000 leaves no room for a prompt in the target's context of 2048 tokens "
        "(max_position_embeddings=2048): set data.regenerate.max_new_tokens to 2047 or less"
    )


def test_invalid_utf8_in_a_json_document_names_the_line(tmp_path):
    path = write_lines(tmp_path / "chats.json", [b"[", json.dumps(GOOD).encode() + b",", INVALID_UTF8_LINE, b"]"])
    for skip in (False, True):
        with pytest.raises(UserError, match=r"chats\.json:3: invalid UTF-8 .*one JSON document"):
            load_conversations([str(path)], skip_invalid_utf8=skip)


def test_train_on_invalid_utf8_is_one_line_and_exit_2(tmp_path, token_cache, capsys):
    path = write_lines(tmp_path / "traffic.jsonl", [json.dumps(GOOD).encode(), INVALID_UTF8_LINE])
    data = {"train": path, "eval": path}
    result = run_entry_in_process(["train.py", *train_args(tmp_path / "run", data, token_cache)], capsys)
    assert assert_one_line_error(result, 2).startswith(f"error: {path}:2: invalid UTF-8 (byte 0xff")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow  # processes of their own
def test_fingerprint_is_stable_across_processes_and_follows_the_file(tmp_path, isolated_datasets_cache):
    path = write_jsonl(tmp_path / "chats.jsonl", RECORDS)
    fingerprint = load_conversations([str(path)])._fingerprint
    assert load_conversations([str(path)])._fingerprint == fingerprint
    script = (
        "from draftsmith.data_prep.conversations import load_conversations; "
        f"print(load_conversations([{str(path)!r}])._fingerprint)"
    )
    env = {**os.environ, "HF_DATASETS_CACHE": isolated_datasets_cache}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == fingerprint
    write_jsonl(path, RECORDS[:1])
    os.utime(path, (path.stat().st_atime + 5, path.stat().st_mtime + 5))
    assert load_conversations([str(path)])._fingerprint != fingerprint


# ---- tokenized data set -----------------------------------------------------------------------


def test_tokenized_dataset_carries_domains(tmp_path, reference_tokenizer):
    conversations = load_conversations([str(write_jsonl(tmp_path / "c.jsonl", RECORDS))])
    tokenized = tokenize_conversations(
        conversations, reference_tokenizer, max_length=512, cache_dir=str(tmp_path / "cache")
    )
    assert tokenized.column_names == ["input_ids", "loss_mask", "domain", "length", "sample", "digest"]
    assert list(tokenized["domain"]) == ["geo", "default"]
    assert sorted(tokenized.unique("domain")) == ["default", "geo"]
    ids, mask = render_with_masks(reference_tokenizer, CONVERSATION)
    assert tokenized[0]["input_ids"] == ids and tokenized[0]["loss_mask"] == mask and tokenized[0]["length"] == len(ids)


LONG = {
    "domain": "long",
    "messages": [{"role": "user", "content": "Tell me."}, {"role": "assistant", "content": "Fine. " * 40}],
}
LONG_PROMPT = {"messages": [{"role": "user", "content": "Listen. " * 80}, ASSISTANT]}


def test_overlong_policies(tmp_path, reference_tokenizer):
    conversations = load_conversations([str(write_jsonl(tmp_path / "c.jsonl", [GOOD, LONG, LONG_PROMPT]))])
    full = [render_with_masks(reference_tokenizer, row["messages"]) for row in conversations]
    max_length = 60
    assert len(full[0][0]) <= max_length < len(full[1][0]) and len(full[2][0]) > max_length
    cache = str(tmp_path / "cache")

    with pytest.raises(UserError, match=r"c\.jsonl record 2: \d+ tokens is more than data.max_length=60"):
        tokenize_conversations(conversations, reference_tokenizer, max_length, overlong="error", cache_dir=cache)

    truncated = tokenize_conversations(
        conversations, reference_tokenizer, max_length, overlong="truncate", cache_dir=cache
    )
    # LONG_PROMPT keeps no assistant token within 60 tokens, so it goes even when truncating.
    assert len(truncated) == 2
    assert truncated[1]["input_ids"] == full[1][0][:max_length] and truncated[1]["loss_mask"] == full[1][1][:max_length]
    assert truncated[1]["length"] == max_length and truncated[1]["domain"] == "long"

    dropped = tokenize_conversations(conversations, reference_tokenizer, max_length, overlong="drop", cache_dir=cache)
    assert len(dropped) == 1 and dropped[0]["input_ids"] == full[0][0]

    with pytest.raises(UserError, match="data.overlong='cut' is not one of"):
        tokenize_conversations(conversations, reference_tokenizer, max_length, overlong="cut", cache_dir=cache)


def test_tokenizing_without_chat_template_fails(tmp_path):
    tokenizer = load_tokenizer(str(REFERENCE))
    tokenizer.chat_template = None
    conversations = load_conversations([str(write_jsonl(tmp_path / "c.jsonl", [GOOD]))])
    with pytest.raises(UserError, match="has no chat template"):
        tokenize_conversations(conversations, tokenizer, 64, cache_dir=str(tmp_path / "cache"))


def test_cache_is_reused_and_keyed_on_settings(tmp_path, reference_tokenizer, monkeypatch):
    conversations = load_conversations([str(write_jsonl(tmp_path / "c.jsonl", RECORDS))])
    cache = tmp_path / "cache"
    first = tokenize_conversations(conversations, reference_tokenizer, 512, cache_dir=str(cache))
    key = cache_key(conversations, reference_tokenizer, 512, "truncate")
    assert [p.name for p in (cache / "tokenized").iterdir()] == [key]  # no temporary leftovers

    def no_map(*args, **kwargs):
        raise AssertionError("tokenized again instead of loading the cache")

    monkeypatch.setattr(datasets.Dataset, "map", no_map)
    again = tokenize_conversations(conversations, reference_tokenizer, 512, cache_dir=str(cache))
    assert again.to_list() == first.to_list()
    monkeypatch.undo()

    assert cache_key(conversations, reference_tokenizer, 256, "truncate") != key
    assert cache_key(conversations, reference_tokenizer, 512, "drop") != key
    assert cache_key(conversations, qwen_tokenizer("<|im_end|>"), 512, "truncate") != key
    tokenize_conversations(conversations, reference_tokenizer, 256, cache_dir=str(cache))
    assert len(list((cache / "tokenized").iterdir())) == 2


# ---- collator ---------------------------------------------------------------------------------


def test_collator_pads_right_and_masks_padding():
    rows = [
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "domain": "a", "length": 3},
        {"input_ids": [8], "loss_mask": [1], "domain": "b", "length": 1},
    ]
    batch = Collator(pad_token_id=0)(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(batch[name].dtype == torch.long for name in ("input_ids", "attention_mask", "loss_mask"))
    assert batch["domain"] == ["a", "b"]


def test_collator_with_dataloader(tmp_path, reference_tokenizer):
    conversations = load_conversations([str(write_jsonl(tmp_path / "c.jsonl", RECORDS + [LONG]))])
    tokenized = tokenize_conversations(conversations, reference_tokenizer, 512, cache_dir=str(tmp_path / "cache"))
    pad = reference_tokenizer.pad_token_id
    loader = torch.utils.data.DataLoader(tokenized, batch_size=3, collate_fn=Collator(pad))
    batch = next(iter(loader))
    lengths = list(tokenized["length"])
    assert batch["input_ids"].shape == (3, max(lengths))
    assert batch["attention_mask"].sum(dim=1).tolist() == lengths
    assert (batch["input_ids"][batch["attention_mask"] == 0] == pad).all()
    assert (batch["loss_mask"][batch["attention_mask"] == 0] == 0).all()
    assert batch["loss_mask"].sum(dim=1).tolist() == [sum(row["loss_mask"]) for row in tokenized]
    assert batch["domain"] == ["geo", "default", "long"]


# ---- the real corpus --------------------------------------------------------------------------


def test_real_corpus_slice(tmp_path, reference_tokenizer):
    conversations = load_conversations([str(MATH_EVAL)], max_conversations=200)
    assert len(conversations) == 200 and conversations.unique("domain") == ["math"]
    tokenized = tokenize_conversations(conversations, reference_tokenizer, 512, cache_dir=str(tmp_path / "cache"))
    assert len(tokenized) == 200
    assert all(any(row["loss_mask"]) for row in tokenized)
    first = tokenized[0]
    answer = conversations[0]["messages"][-1]["content"]
    assert masked_runs(reference_tokenizer, first["input_ids"], first["loss_mask"]) == [answer + "<|end|>"]


@pytest.mark.parametrize("reuse", [False, True])
def test_a_regeneration_record_cut_short_is_one_line_naming_it(tmp_path, token_cache, capsys, reuse):
    """A stage's own JSON record edited by hand or cut short (here `regenerate.settings`, as an output to
    resume and as a regeneration to reuse) is one line naming the file, exit 2, as every such record is
    (draftsmith.files.read_json); it was exit 70 (JSONDecodeError)."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "regenerate.settings").write_text("{not json")
    output = tmp_path / "regenerated"
    args = ["-m", "data_prep.regenerate", "recipe=draft", "data.max_conversations=2", f"output_dir={tmp_path}/run",
            f"data.regenerate.output={earlier if not reuse else output}"]  # fmt: skip
    if reuse:
        args.append(f"data.regenerate.reuse=[{earlier}]")
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2, "regenerate.settings: corrupt regeneration")
    assert line.endswith("leave it out of data.regenerate.reuse" if reuse else "or delete it")


def test_a_regeneration_that_would_keep_no_conversation_is_one_line_writing_nothing(tmp_path, capsys):
    """Every conversation held out or below min_turns: it wrote its settings file alone and exited 0, and training
    on the folder then found no data file."""
    output = tmp_path / "regenerated"
    args = ["-m", "data_prep.regenerate", "recipe=draft", "data.max_conversations=3", f"output_dir={tmp_path}/run",
            f"data.regenerate.output={output}", "data.regenerate.min_turns=5"]  # fmt: skip
    line = assert_one_line_error(run_entry_in_process(args, capsys), 2)
    assert line == (
        "error: no conversation of data.train is left to regenerate (0 held out by data.regenerate.exclude, 3 with "
        "fewer than data.regenerate.min_turns=5 assistant turns): nothing written"
    )
    assert not output.exists()


# ---- the eval split's refusals at load, and tokenization's counts (cache hit or not) -----------------------------


def test_tokenization_counts_each_row_once_and_a_cache_hit_logs_them_again(tmp_path, reference_tokenizer, caplog):
    """The log counts rows where a template that rewrites earlier turns makes more rows than conversations, a row
    cut and then left with no assistant token as dropped alone (it was counted truncated too), and a run that
    reads the cache logs the same counts (they were logged only when tokenizing)."""
    import logging

    caplog.set_level(logging.INFO, logger="draftsmith.data")

    def logged(conversations, tokenizer, max_length: int) -> list[str]:
        caplog.clear()
        tokenize_conversations(conversations, tokenizer, max_length, cache_dir=str(tmp_path / "cache"))
        return [record.getMessage().split(", cached at")[0].split(" from the tokenized cache")[0]
                for record in caplog.records]  # fmt: skip

    rewriting = family_tokenizer(
        REWRITING_TEMPLATE, ["<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<|im_end|>", None
    )
    split = load_conversations([str(write_jsonl(tmp_path / "split.jsonl", [{"messages": CONVERSATION}, GOOD]))])
    first = logged(split, rewriting, 512)
    assert first[0] == (
        "rendered 1 of 2 conversations one row per assistant turn (3 rows in all): the chat template rewrites "
        "earlier turns"
    )
    assert first[1].startswith("tokenized 2 conversations (3 rows) into ")
    assert logged(split, rewriting, 512) == [first[0], "loaded 2 conversations (3 rows)"]

    long = load_conversations([str(write_jsonl(tmp_path / "long.jsonl", [GOOD, LONG, LONG_PROMPT]))])
    counts = [
        "truncated 1 of 3 conversations to data.max_length=60 tokens",  # LONG; LONG_PROMPT is dropped alone
        "dropped 1 of 3 conversations with no assistant token within data.max_length=60",
    ]
    tokenized = logged(long, reference_tokenizer, 60)
    assert tokenized[:2] == counts and tokenized[2].startswith("tokenized 2 conversations into ")
    assert logged(long, reference_tokenizer, 60) == [*counts, "loaded 2 conversations"]
    cached = tmp_path / "cache" / "tokenized" / cache_key(long, reference_tokenizer, 60, "truncate")
    assert json.loads((cached / "draftsmith_stats.json").read_text())["truncated"] == 1

    (cached / "draftsmith_stats.json").unlink()  # a cache written before the counts were kept: none logged
    assert logged(long, reference_tokenizer, 60) == ["loaded 2 conversations"]


def refused_training(run: Path, data: dict, cache: Path, capsys, *extra: str) -> str:
    """The one error line `train.py` on `data` ends with (exit 2), having trained no step."""
    line = assert_one_line_error(run_entry_in_process(["train.py", *train_args(run, data, cache, *extra)], capsys), 2)
    assert not (run / "checkpoints").exists()
    return line


def test_an_eval_split_domain_named_all_is_refused_before_training(tmp_path, small_data, token_cache, capsys):
    """A domain named `all` in data.eval would merge into eval_accuracy.json's row of every domain (and the
    report's): one line naming the record, exit 2, where the data loads (after the target loads), before a step
    trains; it was refused only by the report, after training, the accuracy table already merged."""
    path = write_jsonl(tmp_path / "eval.jsonl", [{**GOOD, "domain": "code"}, {**GOOD, "domain": "all"}])
    data = {"train": small_data["train"], "eval": path}
    assert refused_training(tmp_path / "run", data, token_cache, capsys) == (
        f"error: data.eval: {path} record 2 has the domain 'all', the name the eval's tables give the row of "
        "every domain together; rename that domain"
    )
    # the report's own prompts (eval.data) are read before training too
    line = refused_training(
        tmp_path / "run2", small_data, token_cache, capsys, "eval.enabled=true", f"eval.data=[{path}]"
    )
    assert "record 2 has the domain 'all'" in line


def test_a_prompt_only_data_eval_is_one_line_pointing_to_eval_data(tmp_path, small_data, token_cache, capsys):
    """data.eval is measured on its answers (eval_accuracy.json): a file of prompts alone is refused in one line
    naming data.eval and eval.data, which takes prompts; it named the record only. A file refused for another
    reason keeps its own line, and data.train's line is as it was."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"messages": [USER]}, GOOD])
    assert refused_training(tmp_path / "run", {"train": small_data["train"], "eval": prompts}, token_cache, capsys) == (
        f"error: data.eval: {prompts} record 1: no assistant turn, so nothing to train on: data.eval is the eval "
        "split, measured on its answers; prompts without answers (the speculative-decoding eval's) go in eval.data"
    )
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"messages": [USER]}, {"messages": [ASSISTANT]}])
    data = {"train": small_data["train"], "eval": broken}
    assert refused_training(tmp_path / "run", data, token_cache, capsys).startswith(f"error: {broken} record ")
    data = {"train": prompts, "eval": small_data["eval"]}
    line = refused_training(tmp_path / "run", data, token_cache, capsys)
    assert f"{prompts} record 1: no assistant turn" in line and "eval.data" not in line


def test_a_regeneration_knows_its_conversations_by_content_whatever_fields_a_turn_may_hold(tmp_path):
    """regenerate.settings records its input and reused answers by content_digest, and a resume or a reuse
    compares them: a field the loader adds to every turn (None where a turn has none) must move no digest, or
    every finished regeneration is refused after it, as the committed benchmarks/data folders were after `cut`
    and `tool_calls`. The keys holding None are left out at any depth (a tool call without an id); a value
    counts. Pinned: the digest of the same conversations never moves."""
    from draftsmith.data_prep.regenerate import content_digest, without_nulls

    plain = datasets.Dataset.from_list([{"messages": [USER, ASSISTANT], "domain": "chat"}])
    assert content_digest(plain) == "a413355ae87996fb"
    later = [{**turn, "a_later_field": None} for turn in (USER, ASSISTANT)]
    assert content_digest(datasets.Dataset.from_list([{"messages": later, "domain": "chat"}])) == "a413355ae87996fb"
    loaded = load_conversations(
        [str(write_jsonl(tmp_path / "plain.jsonl", [{"messages": [USER, ASSISTANT], "domain": "chat"}]))]
    )
    assert loaded[0]["messages"][0]["tool_calls"] is None and content_digest(loaded) == "a413355ae87996fb"
    cut = [USER, {**ASSISTANT, "cut": True}]
    assert content_digest(datasets.Dataset.from_list([{"messages": cut, "domain": "chat"}])) != "a413355ae87996fb"

    no_id = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tools = load_conversations([str(write_jsonl(tmp_path / "tools.jsonl", [tool_conversation(None, no_id)]))])
    assert tools[0]["messages"][2]["tool_calls"][0]["id"] is None  # Arrow's None beside the type
    rows = [{"messages": without_nulls(row["messages"]), "domain": row["domain"]} for row in tools]
    assert "id" not in rows[0]["messages"][2]["tool_calls"][0]
    assert content_digest(tools) == content_digest(datasets.Dataset.from_list(rows))


class NumberedAnswers:
    """A stand-in engine: answer i of each call is `answer i`; counts the prompts it is asked."""

    def __init__(self):
        self.asked = 0

    def answers(self, prompts, seeds):
        from draftsmith.data_prep.answer_engines import Answer

        self.asked += len(prompts)
        return [Answer(f"answer {i}", cut=False) for i in range(len(prompts))]


def test_a_regenerated_turn_that_called_tools_ends_its_conversation_without_the_old_calls(tmp_path, capsys):
    """The target's answer replaces a turn that called a tool: the old calls go with the old content (the answer
    did not make them), and so do the turns after it, whose tool result answered those calls: the conversation
    ends at that answer, counted, or is left out below min_turns; a call in the last turn ends nothing early. It
    kept the old calls beside the new text, the tool's result after them. The conversation before an answer is
    known by its tool calls too (a turn that only calls a tool has an empty content)."""
    from omegaconf import OmegaConf

    from draftsmith.data_prep.regenerate import prompt_key, regenerate_batch, without_nulls

    path = write_jsonl(tmp_path / "tools.jsonl", [tool_conversation(None)])
    messages = load_conversations([str(path)])[0]["messages"]
    section = OmegaConf.create({"max_turns": None, "min_turns": 1})
    engine = NumberedAnswers()
    out, ended, _ = regenerate_batch(engine, load_tokenizer(str(REFERENCE)), [messages, messages[:3]], section, 1024)
    system, user = without_nulls(messages[:2])
    assert [without_nulls(m) for m in out] == [
        [system, user, {"role": "assistant", "content": f"answer {i}"}] for i in (0, 1)
    ]
    assert ended == ["tool calls", None] and engine.asked == 2  # the final answer after the tool's result is not asked
    section.min_turns = 2
    assert regenerate_batch(NumberedAnswers(), load_tokenizer(str(REFERENCE)), [messages], section, 1024)[:2] == (
        [None],
        ["tool calls"],
    )

    other = {**TOOL_CALL, "function": {"name": "get_time", "arguments": "{}"}}
    assert prompt_key(messages[:3]) != prompt_key([*messages[:2], {**messages[2], "tool_calls": [other]}])
    assert prompt_key(messages[:2]) == prompt_key(without_nulls(messages[:2]))  # None is no field

    args = ["recipe=draft", f"target.name_or_path={REFERENCE}", f"data.train=[{path}]", "data.max_length=64",
            "data.regenerate.max_new_tokens=2", f"data.regenerate.output={tmp_path / 'out'}",
            f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    done = run_entry_in_process(["-m", "data_prep.regenerate", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "1 conversations end at an answer to a turn that called tools (its calls dropped)" in done.stdout
    written = [json.loads(line) for line in gzip.open(tmp_path / "out" / "part-00000.jsonl.gz", "rt")]
    assert [[m["role"] for m in record["messages"]] for record in written] == [["system", "user", "assistant"]]
    assert "tool_calls" not in written[0]["messages"][2] and written[0]["messages"][2]["content"]


def test_a_file_edited_with_its_time_kept_is_read_and_tokenized_again(tmp_path, reference_tokenizer, caplog):
    """datasets knew a local file by its path and modification time: a file edited with its time put back (cp -p,
    rsync -a, tar x) loaded its old parse, and train read the old tokenized data ("loaded 2 conversations from the
    tokenized cache"). A file is known by its bytes."""
    path = write_jsonl(tmp_path / "chats.jsonl", [GOOD, GOOD])
    times = (path.stat().st_atime_ns, path.stat().st_mtime_ns)
    cache = str(tmp_path / "cache")
    caplog.set_level("INFO", logger="draftsmith.data")
    first = tokenize_conversations(load_conversations([str(path)]), reference_tokenizer, 64, cache_dir=cache)
    path.write_text(path.read_text().replace("Hello!", "Howdy!"))  # the same size, as sed -i makes it
    os.utime(path, ns=times)
    caplog.clear()
    edited = load_conversations([str(path)])
    assert [messages[1]["content"] for messages in edited["messages"]] == ["Howdy!", "Howdy!"]
    again = tokenize_conversations(edited, reference_tokenizer, 64, cache_dir=cache)
    assert any(record.getMessage().startswith("tokenized 2 conversations") for record in caplog.records)
    assert not any("from the tokenized cache" in record.getMessage() for record in caplog.records)
    assert again["input_ids"] != first["input_ids"]
    assert again["input_ids"][0] == render_with_masks(reference_tokenizer, edited[0]["messages"])[0]


def test_a_folders_files_not_read_are_named_and_suffixes_match_in_any_case(tmp_path, caplog):
    """A folder's files of other suffixes were left out without a word (`UPPER.JSONL`, `more.ndjson` among them,
    which datasets reads); they are read now, and the files not read are named in one warning, as a file named
    directly with their suffix is refused. A regeneration's settings file is draftsmith's own, not named."""
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl.gz", [GOOD], gzip.open)
    write_jsonl(folder / "Y.JSON.GZ", [GOOD], gzip.open)
    write_jsonl(folder / "more.ndjson", [GOOD])
    write_jsonl(folder / "UPPER.JSONL", [GOOD])
    (folder / "sub" / "x.jsonl.bz2").write_bytes(b"BZh9")
    (folder / "README.txt").write_text("not data")
    (folder / "regenerate.settings").write_text("{}")
    with caplog.at_level("WARNING", logger="draftsmith.data"):
        loaded = load_conversations([str(folder)])
    assert sorted(set(loaded["source"])) == sorted(
        str(folder / name) for name in ("a.jsonl.gz", "Y.JSON.GZ", "more.ndjson", "UPPER.JSONL")
    )
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert warnings == [
        f"data directory {str(folder)!r}: 2 file(s) not read, their suffix not "
        ".jsonl/.jsonl.gz/.ndjson/.ndjson.gz/.json/.json.gz/.parquet: README.txt, sub/x.jsonl.bz2"
    ]
    with pytest.raises(UserError, match=r"x\.jsonl\.bz2' has an unsupported format \(expected \.jsonl/"):
        load_conversations([str(folder / "sub" / "x.jsonl.bz2")])
    assert len(load_conversations([str(folder / "UPPER.JSONL")])) == 1


def test_a_local_files_load_asks_nothing_of_the_network(tmp_path, monkeypatch):
    """datasets sent a HEAD request to count a download of its json builder on every local file's load: 0.14 s a
    file without a network (a regeneration's folder of 75 parts read in 11 s, 0.4 s without), a round trip with."""
    import datasets.load

    asked = []
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)  # as a user's default (AUTO)
    session = type("Session", (), {"head": lambda self, url, **options: asked.append(url)})
    monkeypatch.setattr(datasets.load, "get_session", session)
    for part in range(3):
        write_jsonl(tmp_path / f"part-{part:05d}.jsonl.gz", [GOOD], gzip.open)
    assert len(load_conversations([str(tmp_path)])) == 3 and asked == []
    assert datasets.config.HF_UPDATE_DOWNLOAD_COUNTS  # the setting is the user's again for a Hub data set's load


def test_a_greedy_regeneration_recorded_with_a_seed_resumes_and_a_sampled_one_keeps_its_seed(tmp_path):
    """A greedy regeneration recorded the seed it was given (accepted until data.regenerate.seed at temperature 0 was
    refused as unread): it resumes at the default seed. A sampled one's seed is its answers', compared as before."""
    from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
    from draftsmith.data_prep.regenerate import MARKS, claim_directory

    settings = {"data": "d", "temperature": 0.0, "seed": 0, "marks": MARKS}
    (tmp_path / "greedy").mkdir()
    (tmp_path / "greedy" / REGENERATE_SETTINGS).write_text(json.dumps({**settings, "seed": 7}))
    claim_directory(tmp_path / "greedy", settings)
    (tmp_path / "sampled").mkdir()
    sampled = {**settings, "temperature": 0.7}
    (tmp_path / "sampled" / REGENERATE_SETTINGS).write_text(json.dumps({**sampled, "seed": 7}))
    with pytest.raises(UserError, match="holds a regeneration"):
        claim_directory(tmp_path / "sampled", sampled)
