"""The eval's prompts (the first conversations of each domain, rendered up to the generation prompt)
and the token ids that end a generation: what draftsmith's eval and the engine check decode alike."""

from __future__ import annotations

from draftsmith.errors import UserError

ALL = "all"  # the aggregate "domain" of a report: counters summed over every domain


def load_prompts(
    sources: list[str], tokenizer, max_prompts: int, max_length: int, skip_invalid_utf8: bool = False
) -> dict[str, list[list[int]]]:
    """The first `max_prompts` conversations of each domain, rendered up to their last assistant turn
    with the generation prompt; prompts longer than `max_length` keep their last tokens.
    `skip_invalid_utf8`: data.skip_invalid_utf8 (load_conversations)."""
    from draftsmith.data_prep import load_conversations, render_prompt

    conversations = load_conversations(sources, prompts_only=True, skip_invalid_utf8=skip_invalid_utf8)
    picked: dict[str, list[int]] = {}
    for index, domain in enumerate(conversations["domain"]):
        rows = picked.setdefault(domain, [])
        if len(rows) < max_prompts:
            rows.append(index)
    if ALL in picked:
        raise UserError(f"domain name {ALL!r} is reserved for the report's aggregate row; rename it in the eval data")
    prompts: dict[str, list[list[int]]] = {}
    for domain in sorted(picked):
        for row in conversations.select(picked[domain]):
            ids, _ = render_prompt(tokenizer, row["messages"])
            prompts.setdefault(domain, []).append(ids[-max_length:])
    if not prompts:
        raise UserError(f"no conversations in the eval data {sources}")
    return prompts


def eos_ids_of(model, tokenizer) -> frozenset[int]:
    """Generation stops at any EOS the model's generation config or the tokenizer names."""
    generation_config = getattr(model, "generation_config", None)
    ids = getattr(generation_config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)
