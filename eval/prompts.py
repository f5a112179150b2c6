"""The eval's prompts (the first conversations of each domain, rendered up to the generation prompt)
and the token ids that end a generation: what draftsmith's eval and the engine check decode alike."""

from __future__ import annotations

import logging
from typing import Any, Optional

from draftsmith.errors import UserError

log = logging.getLogger(__name__)
ALL = "all"  # the aggregate "domain" of a report: counters summed over every domain


def prompt_sources(cfg) -> tuple[list[str], Optional[int]]:
    """The eval's prompts as the recipe names them: (eval.data, else data.eval; the cap per file they are read
    under). data.eval's files are read under data.max_conversations, as the eval split reads them, so the report
    and eval_accuracy.json start from the same conversations; eval.data's (its own prompts, a monitor's traffic
    sample) under none. eval.max_prompts then takes the first of each domain of what was read."""
    if cfg.eval.data:
        return list(cfg.eval.data), None
    return list(cfg.data.eval), cfg.data.max_conversations


def load_prompts(
    sources: list[str],
    tokenizer,
    max_prompts: int,
    max_length: int,
    skip_invalid_utf8: bool = False,
    max_conversations: Optional[int] = None,
) -> dict[str, list[list[int]]]:
    """The token ids of `prompt_conversations`' prompts (`render_prompts`)."""
    chosen = prompt_conversations(sources, max_prompts, skip_invalid_utf8, max_conversations)
    return render_prompts(chosen, tokenizer, max_length)


def prompt_conversations(
    sources: list[str], max_prompts: int, skip_invalid_utf8: bool = False, max_conversations: Optional[int] = None
) -> dict[str, list[list[dict[str, Any]]]]:
    """The messages of the first `max_prompts` conversations of each domain, domains in order.
    `skip_invalid_utf8`, `max_conversations`: data.skip_invalid_utf8 and the cap per file (load_conversations;
    `prompt_sources` says which cap), applied before `max_prompts`."""
    from draftsmith.data_prep.conversations import load_conversations

    conversations = load_conversations(
        sources, max_conversations, prompts_only=True, skip_invalid_utf8=skip_invalid_utf8
    )
    require_no_aggregate_domain(conversations, "the eval data")
    picked: dict[str, list[int]] = {}
    for index, domain in enumerate(conversations["domain"]):
        rows = picked.setdefault(domain, [])
        if len(rows) < max_prompts:
            rows.append(index)
    if not picked:
        raise UserError(f"no conversations in the eval data {sources}")
    return {domain: conversations.select(picked[domain])["messages"] for domain in sorted(picked)}


def render_prompts(
    chosen: dict[str, list[list[dict[str, Any]]]], tokenizer, max_length: int
) -> dict[str, list[list[int]]]:
    """Each conversation rendered up to its last assistant turn with the generation prompt (render_prompt);
    prompts longer than `max_length` keep their last tokens, and how many were cut is said (the prefill a
    measurement of speed serves is then shorter than the traffic's)."""
    from draftsmith.data_prep.template import render_prompt

    rendered = {
        domain: [render_prompt(tokenizer, messages, max_length, from_end=True)[0] for messages in conversations]
        for domain, conversations in chosen.items()
    }
    cut = sum(len(ids) > max_length for prompts in rendered.values() for ids in prompts)
    if cut:
        log.info(
            "%d of the %d prompts are longer than data.max_length=%d tokens: their last %d tokens are decoded from",
            cut, sum(map(len, rendered.values())), max_length, max_length,
        )  # fmt: skip
    return {domain: [ids[-max_length:] for ids in prompts] for domain, prompts in rendered.items()}


def require_no_aggregate_domain(conversations, key: str) -> None:
    """`conversations` (load_conversations') hold no domain named `all`: the eval's tables (the report's,
    eval_accuracy.json's) name their row of every domain together so, and would merge that domain into it.
    `key`: where the conversations came from, for the error."""
    domains = list(conversations["domain"])
    if ALL not in domains:
        return
    first = conversations[domains.index(ALL)]
    raise UserError(
        f"{key}: {first['source']} record {first['record']} has the domain {ALL!r}, the name the eval's tables give "
        "the row of every domain together; rename that domain"
    )


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    """Generation stops at any EOS the model's generation config or the tokenizer names."""
    generation_config = getattr(model, "generation_config", None)
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
