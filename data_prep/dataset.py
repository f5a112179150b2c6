"""Tokenized training data: conversations -> (input_ids, loss_mask, domain, length, sample, digest), cached on
disk; the collators that lay them into batches are data_prep/collate.py's."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import datasets
import pyarrow

from draftsmith.data_prep.cache_faults import Cache, raise_cache_fault
from draftsmith.data_prep.overlap import turns_digest
from draftsmith.data_prep.records import DEFAULT_DOMAIN, code_digest
from draftsmith.data_prep.template import render_rows, require_chat_template
from draftsmith.errors import UserError, one_line
from draftsmith.files import cache_root

logger = logging.getLogger("draftsmith.data")

# Bump when the layout of a cached data set changes. Code edits are covered by _CODE_HASH.
CACHE_VERSION = 3  # 3: a row carries its conversation's digest
OVERLONG = ("truncate", "drop", "error")
EVAL_SPLIT = "data.eval"  # the recipe key of the held-out conversations eval_accuracy.json measures
STATS_NAME = "draftsmith_stats.json"  # beside a cached data set: its tokenization's counts, logged on every load
_ROW_COUNTS = {  # a tokenization's counts of rows (each row in one at most) and their log lines
    "truncated": "truncated %d of %s to data.max_length=%d tokens",
    "dropped_overlong": "dropped %d of %s longer than data.max_length=%d tokens",
    "dropped_no_assistant_token": "dropped %d of %s with no assistant token within data.max_length=%d",
}
TOKENIZED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "domain": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "sample": datasets.Value("string"),  # where the conversation came from: `source:record`
        "digest": datasets.Value("string"),  # the conversation's turns by content (turns_digest)
    }
)
# A fix to the masking must not be hidden behind a cache written by the old code.
_CODE_HASH = code_digest(*(Path(__file__).parent / name for name in ("template.py", "dataset.py")))


def load_tokenized(
    cfg, sources: Sequence[str], tokenizer, key: str, digests: Optional[dict[str, str]] = None
) -> datasets.Dataset:
    """The recipe's conversations from `sources` (the value of recipe key `key`, for errors), read,
    validated and tokenized exactly as every stage needs them (training, capture, the eval split):
    one definition, so a capture lines up with the online data row by row. `digests`: a training start's
    files' sha256 (load_conversations)."""
    from draftsmith.eval.prompts import require_no_aggregate_domain

    if not sources:
        raise UserError(f"{key} is empty: give at least one conversation file or Hub data set id")
    require_context(cfg.target, cfg.data.max_length)
    conversations = _read_conversations(cfg, sources, key, digests)
    if key == EVAL_SPLIT:  # its domains are rows of eval_accuracy.json, beside the aggregate one
        require_no_aggregate_domain(conversations, key)
    return tokenize_conversations(
        conversations, tokenizer, cfg.data.max_length, cfg.data.overlong, cfg.data.cache_dir, cfg.data.thinking
    )


def split_heldout_rows(dataset: datasets.Dataset, count: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(the training rows, the held-out rows) of the tokenized data.train: the rows of its last `count` conversations
    (train.heldout), in file order, before any shuffling; all of them where it has fewer. A conversation rendered a
    row per turn (a thinking template) is held out whole: its rows are consecutive and share their `sample`, and
    its earlier turns trained on would be the held-out turn's context. The one rule the trainer holds them out by
    (trainer/heldout.py) and the eval leaves them out of what the run trained on by (eval/accuracy.py)."""
    left, held, last = len(dataset), 0, None
    samples = dataset.select_columns(["sample"])
    while left > 0 and held <= count:
        chunk = samples[max(left - 4096, 0) : left]["sample"]  # the tail alone: data.train may hold millions of rows
        for sample in reversed(chunk):
            if sample != last:
                held, last = held + 1, sample
                if held > count:
                    break
            left -= 1
    held_out = range(left, len(dataset)) if left < len(dataset) else []  # datasets refuses an empty range's start
    return dataset.select(range(left)), dataset.select(held_out)


def _read_conversations(
    cfg, sources: Sequence[str], key: str, digests: Optional[dict[str, str]] = None
) -> datasets.Dataset:
    """load_conversations under the recipe's data settings. data.eval is measured on its answers: a file of
    prompts alone, which eval.data takes, is refused in one line that says so."""
    from draftsmith.data_prep.conversations import load_conversations

    def read(prompts_only: bool = False) -> datasets.Dataset:
        return load_conversations(
            list(sources),
            cfg.data.max_conversations,
            prompts_only,
            skip_invalid_utf8=cfg.data.skip_invalid_utf8,
            digests=digests,
        )

    try:
        return read()
    except UserError as err:
        if key != EVAL_SPLIT:
            raise
        try:  # only a refusal reads the files again: were they refused for prompts that have no answer?
            read(prompts_only=True)
        except UserError:
            raise err from None
        raise UserError(
            f"{key}: {err}: {key} is the eval split, measured on its answers; prompts without answers "
            "(the speculative-decoding eval's) go in eval.data"
        ) from None


def require_context(target, max_length: int, config=None, new_tokens: Optional[tuple[str, int]] = None) -> None:
    """data.max_length within the context the target's config states (`target`: the recipe's target section,
    or a path; `config`: its loaded config, else read from config.json alone, no weights): a longer row would run the
    target past the positions it was trained on; and `new_tokens`, (its key, the tokens generated after a prompt),
    below it. A config that states none is taken at its word."""
    from draftsmith.target import target_section
    from draftsmith.target_loading import load_config

    context, stated = target_context(load_config(target_section(target)) if config is None else config)
    if context is not None and max_length > context:
        raise UserError(
            f"data.max_length={max_length} is more than the target's context of {context} tokens ({stated} in its "
            f"config); set data.max_length={context} or less"
        )
    if context is not None and new_tokens is not None and new_tokens[1] >= context:
        raise no_room(*new_tokens, context, stated)


def no_room(key: str, new: int, context: int, stated: str, prompt_tokens: int = 1) -> UserError:
    """The refusal of `key`=`new` tokens generated after a prompt (of `prompt_tokens` at least) in a target's context
    of `context` tokens."""
    return UserError(
        f"{key}={new} leaves no room for a prompt in the target's context of {context} tokens ({stated}): set {key} "
        f"to {context - prompt_tokens} or less"
    )


def target_context(config) -> tuple[Optional[int], str]:
    """(the most tokens the target's config says it attends over, the settings that say so), or (None, "")
    where it states no max_position_embeddings. A RoPE scaling factor (YaRN, linear, dynamic) is counted in:
    configs differ on whether max_position_embeddings is the context before scaling or after (Llama-3.1's),
    and a bound too loose refuses less, never a setting the target serves."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None, ""
    factor = max((float(f) for f in _rope_factors(text)), default=1.0)
    if factor <= 1:
        return limit, f"max_position_embeddings={limit}"
    return int(limit * factor), f"max_position_embeddings={limit} x RoPE scaling factor {factor:g}"


def _rope_factors(text_config) -> list:
    """Every RoPE scaling `factor` the config sets (`rope_parameters`, or `rope_scaling` in older configs;
    one setting, or one per attention type)."""
    factors = []
    for name in ("rope_parameters", "rope_scaling"):
        settings = getattr(text_config, name, None)
        if not isinstance(settings, Mapping):
            continue
        for setting in [settings, *(value for value in settings.values() if isinstance(value, Mapping))]:
            factor = setting.get("factor")
            if isinstance(factor, (int, float)) and not isinstance(factor, bool):
                factors.append(factor)
    return factors


def tokenize_conversations(
    conversations: datasets.Dataset,
    tokenizer,
    max_length: int,
    overlong: str = "truncate",
    cache_dir: Optional[str] = None,
    thinking: str = "train",
) -> datasets.Dataset:
    """Render, tokenize and mask every conversation, handling those over `max_length` tokens as
    `overlong` says (truncate: keep the first max_length tokens; drop; error); an assistant turn's
    reasoning is trained on or left out of the mask as `thinking` says (data.thinking); a chat template that
    rewrites earlier turns gives a row per assistant turn (render_rows). Rows left with no masked token are
    dropped. The result is cached under
    `<cache_dir or ~/.cache/draftsmith>/tokenized/<key>` and reused while the conversations, the
    tokenizer, the settings and this code are unchanged; its counts (rows, truncated, dropped) are kept
    with it, so a run that reads the cache logs what the run that wrote it did."""
    if overlong not in OVERLONG:
        raise UserError(f"data.overlong={overlong!r} is not one of {', '.join(OVERLONG)}")
    if max_length < 1:
        raise UserError(f"data.max_length={max_length} must be at least 1")
    require_chat_template(tokenizer)  # fail before any cache lookup or work
    key = cache_key(conversations, tokenizer, max_length, overlong, thinking)
    root = (Path(cache_dir).expanduser() if cache_dir else cache_root()) / "tokenized"
    final = root / key
    cached = _read_cached(final) if final.is_dir() else None
    if cached is not None:
        dataset, stats = cached
        _log_stats(stats, max_length)
        logger.info("loaded %s from the tokenized cache %s", _counted(stats, dataset), final)
        return dataset

    try:
        stats = _tokenize_into(final, conversations, tokenizer, max_length, overlong, thinking)
    except OSError as err:  # datasets' write errors name no file: the line said `no space left on device` alone
        raise_cache_fault(err, Cache("the tokenized-data cache", root, "data.cache_dir"))
        raise
    dataset = datasets.load_from_disk(str(final))
    logger.info("tokenized %s into %d tokens, cached at %s", _counted(stats, dataset), sum(dataset["length"]), final)
    return dataset


def _read_cached(final: Path) -> Optional[tuple[datasets.Dataset, dict[str, Any]]]:
    """The tokenized data set cached in `final` and its counts (none where the cache was written before they were
    kept); None where the folder is damaged (a file cut short or gone, counts of another shape), which is then removed
    with a warning and the conversations tokenized again: it is draftsmith's own cache, made from the conversations,
    not input the user gave. It was exit 70 (`ArrowInvalid`, `JSONDecodeError`), in every later run too. A disk's
    error (EIO), permissions and any other error of the reader (a KeyError of a datasets version's bug, which a new
    copy would meet again) are raised as such, the folder kept."""
    try:
        dataset = datasets.load_from_disk(str(final))
        counts = final / STATS_NAME
        stats = json.loads(counts.read_text()) if counts.is_file() else {}
    except (pyarrow.ArrowInvalid, json.JSONDecodeError, OSError) as err:  # pyarrow's short read: an OSError, no errno
        if isinstance(err, OSError) and err.errno not in (None, errno.ENOENT):
            raise
        damage = one_line(err, with_type=True)
    else:
        if isinstance(stats, dict):
            return dataset, stats
        damage = f"{STATS_NAME} holds a JSON {type(stats).__name__}, not an object of counts"
    logger.warning(
        "the tokenized-data cache %s is damaged (%s): removing it and tokenizing the conversations again", final, damage
    )
    # renamed aside first: another job reading the same key sees the whole folder or none
    aside = tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.damaged-")
    with contextlib.suppress(FileNotFoundError):  # another job found it damaged too, and moved it first
        os.replace(final, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return None


def _tokenize_into(
    final: Path, conversations: datasets.Dataset, tokenizer, max_length: int, overlong: str, thinking: str
) -> Counter[str]:
    """Tokenize the conversations into the cache folder `final`; their counts."""
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    # Everything is written inside a temporary directory next to the final one and moved into
    # place in one rename, so a killed job never leaves a half-written cache that looks complete.
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{final.name}.tmp-") as scratch:
        stats: Counter[str] = Counter()
        tokenized = conversations.map(
            _tokenize_batch,
            batched=True,  # a batch may shrink (dropped conversations) or grow (one row per turn: render_rows)
            with_indices=True,
            fn_kwargs={
                "tokenizer": tokenizer,
                "max_length": max_length,
                "overlong": overlong,
                "thinking": thinking,
                "stats": stats,
                "seen": set(),
            },
            remove_columns=conversations.column_names,
            features=TOKENIZED_FEATURES,
            cache_file_name=os.path.join(scratch, "map.arrow"),
            load_from_cache_file=False,
            new_fingerprint=final.name[:16],  # our key already identifies the result; skips hashing the tokenizer
            desc="tokenizing conversations",
        )
        stats["conversations"] = len(conversations)
        _log_stats(stats, max_length)
        if len(tokenized) == 0:
            raise UserError(
                f"no conversation is left after tokenization with data.max_length={max_length} and "
                f"data.overlong={overlong}"
            )
        staged = os.path.join(scratch, "dataset")
        tokenized.save_to_disk(staged)
        # inside the folder the rename publishes: a cached data set is never without its counts
        (Path(staged) / STATS_NAME).write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(staged, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process finished the same key first; its copy is identical, keep it.
    return stats


def _tokenize_batch(
    batch: dict[str, list],
    indices: list[int],
    tokenizer,
    max_length: int,
    overlong: str,
    thinking: str,
    stats: Counter,
    seen: set[str],
) -> dict[str, list]:
    # stats and seen (the digests of the conversations before this batch) are mutated in place: this runs in the
    # calling process (map's default num_proc=1), over the batches in order.
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "domain": [], "length": [], "sample": [], "digest": []}
    count = len(batch["messages"])
    domains = batch.get("domain") or [DEFAULT_DOMAIN] * count
    for row in range(count):
        where = _where(batch, row, indices[row])
        digest = turns_digest(batch["messages"][row])
        stats["duplicate_conversations"] += digest in seen
        seen.add(digest)
        try:
            rendered = render_rows(tokenizer, batch["messages"][row], thinking, max_length, overlong == "truncate")
        except UserError as err:
            raise UserError(f"{where}: {err}") from None
        stats["split_into_turns"] += len(rendered) > 1
        stats["rows"] += len(rendered)
        kept = len(out["input_ids"])
        sample = f"conversation {indices[row] + 1}"
        if "source" in batch:
            sample = f"{batch['source'][row]}:{batch['record'][row]}"
        for turn, (ids, mask) in enumerate(rendered, 1):
            cut = len(ids) > max_length
            if cut:
                if overlong == "error":
                    raise UserError(
                        f"{where}: {_tokens_counted(ids, max_length)} is more than data.max_length={max_length} "
                        "(raise it, or set data.overlong=truncate or drop)"
                    )
                if overlong == "drop":
                    stats["dropped_overlong"] += 1
                    continue
                ids, mask = ids[:max_length], mask[:max_length]
            if not any(mask):
                stats["dropped_no_assistant_token"] += 1
                continue
            stats["truncated"] += cut  # kept: a row cut and then dropped is counted as dropped alone
            out["input_ids"].append(ids)
            out["loss_mask"].append(mask)
            out["domain"].append(domains[row])
            out["length"].append(len(ids))
            out["sample"].append(sample if len(rendered) == 1 else f"{sample} turn {turn}")
            out["digest"].append(digest)
        stats["kept_conversations"] += len(out["input_ids"]) > kept
    return out


def _tokens_counted(ids: list[int], max_length: int) -> str:
    """A long row's length: its tokens where it was encoded whole, else a bound (render_rows reads one token past
    data.max_length of a text far longer)."""
    return f"{len(ids)} tokens" if len(ids) > max_length + 1 else f"at least {len(ids)} tokens"


def _where(batch: dict[str, list], row: int, index: int) -> str:
    """Name a conversation for an error: its file and record when it came from load_conversations."""
    if "source" in batch and "record" in batch:
        return f"{batch['source'][row]} record {batch['record'][row]}"
    return f"conversation {index + 1}"


def _log_stats(stats: Mapping[str, int], max_length: int) -> None:
    """What tokenizing did, each row counted once. A template that rewrites earlier turns makes more rows
    than conversations: the counts after that line are of rows."""
    total, rows = stats.get("conversations", 0), stats.get("rows", 0)
    if stats.get("split_into_turns"):
        logger.info(
            "rendered %d of %d conversations one row per assistant turn (%d rows in all): the chat template "
            "rewrites earlier turns",
            stats["split_into_turns"],
            total,
            rows,
        )
    if stats.get("duplicate_conversations"):
        logger.info(
            "%d of %d conversations repeat an earlier one turn for turn: kept, each trained on as often as it "
            "occurs (repeated traffic is traffic, and weights the drafter toward it)",
            stats["duplicate_conversations"],
            total,
        )
    of = f"{rows} rows" if rows != total else f"{total} conversations"
    for name, line in _ROW_COUNTS.items():
        if stats.get(name):
            logger.info(line, stats[name], of, max_length)


def _counted(stats: Mapping[str, int], dataset: datasets.Dataset) -> str:
    """`N conversations`, with `(R rows)` where a template that rewrites earlier turns made more rows than
    conversations; a cache written without counts: its rows, as conversations."""
    conversations = stats.get("kept_conversations", len(dataset))
    return f"{conversations} conversations" + ("" if conversations == len(dataset) else f" ({len(dataset)} rows)")


def cache_key(
    conversations: datasets.Dataset, tokenizer, max_length: int, overlong: str, thinking: str = "train"
) -> str:
    """sha256 over everything the tokenized data depends on. The conversations by their fingerprint, which follows
    a local file's bytes (not its modification time: conversations._load_file) and a Hub data set's revision."""
    parts = {
        "conversations": conversations._fingerprint,
        "tokenizer": tokenizer_identity(tokenizer),
        "max_length": max_length,
        "overlong": overlong,
        "thinking": thinking,
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
