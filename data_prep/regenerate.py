"""`python -m data_prep.regenerate recipe=NAME [key=value ...]`: rewrite every assistant turn of
`data.train` with the target itself, so a drafter learns the target's own distribution (not the
data's authors').

Turn by turn: each assistant turn is generated from the conversation so far, in which the earlier assistant turns
are already the target's own; user (and system/tool) turns are kept, so is an opening assistant turn (a greeting:
nothing before it asks for it), and a conversation that ends on a user turn (a prompt-only set's prompt, or a
question after earlier answered turns) is answered after it. A turn whose prompt already holds `data.max_length`
tokens is not generated (training would cut it off), and an empty answer (the target ended its turn at once) is not
kept: the conversation ends at the assistant turn before it, or is left out when fewer than
`data.regenerate.min_turns` turns are answered by then; all are counted. An assistant turn that called tools
(`tool_calls`) is answered like any other, its calls dropped: the tool results after it answered the old calls, so
the conversation ends at that answer (counted). An answer cut off at `data.regenerate.max_new_tokens` (the target
had not ended its turn) is kept marked `"cut": true`, so that training leaves the end-of-turn after it out of the
loss (data_prep/template.py), and counted. Conversations are generated `data.regenerate.batch_size` at a time,
greedy or sampled (`temperature`, `top_p`; `samples` answers each), by one of two engines (`data.regenerate.engine`;
data_prep/answer_engines.py):

- `transformers`: `model.generate` over left-padded batches; chunk i is seeded with `seed + i`, so a
  resumed run draws what an uninterrupted one would;
- `vllm`: the real vLLM engine in a worker process (draftsmith/engines.py; `data.regenerate.vllm.python`
  names its environment when it is not this one), all of a chunk's prompts at once (continuous
  batching), token ids in and out so the chat template and the decoding stay draftsmith's; conversation
  i is seeded with `seed + i`. Under `accelerate launch`/`torchrun` every rank runs its own engine on
  its own `tensor_parallel_size` GPUs: data parallel. An engine that cannot start or dies is a temporary
  failure (exit 69); the finished parts are kept and the same command resumes.

What is asked of the engine can be less: `reuse` names earlier greedy regenerations of this target whose
answers stand for new ones where the conversation so far is the same (a first-turn regeneration gives
the later turns their first answers); `exclude` names held-out conversations whose first user turns no
record may hold; `min_turns` leaves out conversations with fewer assistant turns before any is generated.

Output (`data.regenerate.output`, default `<output_dir>/regenerated`): a conversation data set
that `data.train` reads as it is (the directory or `DIR/*.jsonl.gz`), one record a line with
`messages`, `domain` and `regenerated_by` (the target). Each batch is one part file,
`part-NNNNN.jsonl.gz`, written to a temporary name and renamed when complete; a killed run
resumes by skipping the finished parts. `regenerate.settings` records what the parts were made
with, the conversations by their content (the same conversations read from another path or machine
resume the directory), the reused answers by theirs, the dtype vLLM ran the target in, and a run with
other settings or data refuses to mix into them.

Under `torchrun`/`accelerate launch` rank r of N generates the parts still to do whose position in
that list is r modulo N (a part is the same bytes whichever rank made it); with `target.shard=fsdp`
the ranks hold pieces of one target and generate in step (draftsmith/sharding.py).
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below (torch's: seconds): draftsmith.cli.run_module
    from draftsmith.cli import run_module

    run_module("draftsmith.data_prep.regenerate", __doc__, command="regenerate")

import gzip
import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from accelerate import PartialState
from omegaconf import DictConfig, OmegaConf

from draftsmith.data_prep.answer_engines import ANSWER_ENGINES, Answer, answer_engine
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import require_context
from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
from draftsmith.data_prep.records import answered_turns
from draftsmith.data_prep.regenerate_turns import left_out_line, prompt_key, regenerate_batch, without_nulls
from draftsmith.data_prep.turns import CUT_KEY
from draftsmith.data_prep.vllm_stage import warn_unread_vllm
from draftsmith.errors import UserError
from draftsmith.files import read_json, replacing, require_same_settings, write_text_atomic
from draftsmith.outputs import held_by_main_process
from draftsmith.progress import progress_bar
from draftsmith.recipe import load_recipe
from draftsmith.sharding import end_process_group, ranks_state
from draftsmith.target import load_tokenizer

logger = logging.getLogger("draftsmith.data")

# The settings that decide a turn's answer: a reused regeneration must have made its answers with these.
ANSWER_SETTINGS = ("target", "revision", "engine", "max_new_tokens", "temperature", "top_p", "vllm_dtype")
# What the parts' turns mark: an answer cut at max_new_tokens carries "cut": true. A regeneration made before
# the mark has none in its settings, and its cut answers read as finished turns.
MARKS = ["cut"]


@dataclass
class RegenerateResult:
    directory: Path
    conversations: int  # written to the output, finished parts of earlier runs included
    generated: int  # conversations this run generated and wrote
    cut: int = 0  # of those, conversations that end early: a later turn's prompt reached data.max_length
    empty: int = 0  # of those, conversations that end early: the target's answer to a turn was empty
    tool_calls: int = 0  # of those, conversations that end early: at the answer to a turn that had called tools
    # conversations this run took up and left out, by why they ended before min_turns answers: "max_length",
    # "empty answer" or "tool calls" (regenerate_batch)
    left_out: Counter = field(default_factory=Counter)
    reused: int = 0  # answers taken from an earlier regeneration (data.regenerate.reuse), not asked of the engine
    cut_answers: int = 0  # answers in the conversations written now that the target had not ended at max_new_tokens
    # the output's totals over every run's parts (a resumed run's own counts are only what it did):
    # rows (a conversation per data.regenerate.samples) of the finished parts' batches that no part holds
    left_out_in_all: int = 0
    cut_answers_in_all: int = 0  # answers in the written conversations cut at max_new_tokens
    excluded: int = 0  # data.train conversations not regenerated: a held-out first prompt (data.regenerate.exclude)
    short: int = 0  # data.train conversations not regenerated: fewer than data.regenerate.min_turns assistant turns


def main(argv: Sequence[str]) -> None:
    cfg = load_recipe(argv)
    result = regenerate(cfg)
    state = PartialState()
    if state.is_main_process:
        max_length, min_turns = cfg.data.max_length, cfg.data.regenerate.min_turns
        print(
            f"{result.conversations} conversations in {result.directory} and {result.left_out_in_all} left out, "
            f"every run's parts counted ({result.generated} generated now, "
            f"{result.cut} of them ended early at a later prompt of data.max_length={max_length} tokens or more, "
            f"{result.empty} at an empty answer; of those taken up now, "
            f"{left_out_line(result.left_out, max_length, min_turns)}; "
            f"{result.reused} answers taken from data.regenerate.reuse; not "
            f"regenerated: {result.excluded} held out, {result.short} with fewer than min_turns={min_turns} turns)"
        )
        if result.tool_calls:  # the tool results after such a turn answered its old calls, not the target's answer
            print(f"{result.tool_calls} conversations end at an answer to a turn that called tools (its calls dropped)")
        if result.cut_answers_in_all:
            print(
                f"{result.cut_answers_in_all} answers cut at data.regenerate.max_new_tokens="
                f"{cfg.data.regenerate.max_new_tokens} in {result.directory} ({result.cut_answers} of them generated "
                "now; kept and marked cut: their end-of-turn is not trained on); raise "
                "data.regenerate.max_new_tokens for the target's whole answers"
            )
    end_process_group()


def output_part_name(index: int) -> str:
    return f"part-{index:05d}.jsonl.gz"


def regenerate(cfg: DictConfig, target=None, tokenizer=None) -> RegenerateResult:
    """Regenerate data.train into the output directory (held by the main process while every rank
    runs); `target`/`tokenizer`: ones the caller has loaded already (a benchmark's, a test's), used instead of
    loading them again. `generated` counts all ranks' conversations."""
    section = cfg.data.regenerate
    directory = Path(section.output or Path(cfg.output_dir) / "regenerated")
    if not cfg.data.train:
        raise UserError("data.train is empty: give at least one conversation file or Hub data set id to regenerate")
    # answers that long left no prompt room in the context: generated past it (1e9: on and on), as training data
    answers = ("data.regenerate.max_new_tokens", int(section.max_new_tokens))
    require_context(cfg.target, cfg.data.max_length, None if target is None else target.config, answers)
    refused = ANSWER_ENGINES[section.engine].SHARDING_REFUSED
    if refused and cfg.target.shard != "none":
        raise UserError(f"data.regenerate.engine={section.engine} with target.shard={cfg.target.shard}: {refused}")
    ANSWER_ENGINES[section.engine].require_runnable(cfg)
    warn_unread_vllm(section, "data.regenerate")

    conversations = load_conversations(
        list(cfg.data.train),
        cfg.data.max_conversations,
        prompts_only=True,
        skip_invalid_utf8=cfg.data.skip_invalid_utf8,
    ).map(with_a_turn_to_answer, desc="prompts get a turn to answer")
    conversations, excluded, short = kept_conversations(conversations, section)
    if len(conversations) == 0:  # it wrote its settings alone and exited 0; training then found no data file
        raise UserError(
            f"no conversation of data.train is left to regenerate ({excluded} held out by data.regenerate.exclude, "
            f"{short} with fewer than data.regenerate.min_turns={section.min_turns} assistant turns): nothing written"
        )
    settings = {
        "target": cfg.target.name_or_path,
        "revision": cfg.target.revision,
        "data": content_digest(conversations),
        "max_length": cfg.data.max_length,
        **OmegaConf.to_container(section),
    }
    for key in ("output", "vllm", "exclude"):  # where things are and how the engine runs, not what is written
        settings.pop(key)
    settings |= ANSWER_ENGINES[section.engine].recorded(cfg)
    settings["marks"] = MARKS
    # the part files a finished run holds (regenerate_into's chunks): a folder source reads none before it has all
    settings["parts"] = -(-len(conversations) * section.samples // section.batch_size)
    check_reusable(section.reuse, settings)
    reused = load_conversations(list(section.reuse)) if section.reuse else None
    settings["reuse"] = None if reused is None else content_digest(reused)  # the answers by their content
    state = ranks_state()
    started = not (directory / REGENERATE_SETTINGS).is_file()
    with held_by_main_process(
        directory, state, check=lambda: claim_directory(directory, settings), key="data.regenerate.output"
    ):
        try:
            result = regenerate_into(cfg, directory, conversations, known_answers(reused), target, tokenizer, state)
        except UserError:
            # Refused before any part was written: no settings left behind either, which would name data the
            # user is about to fix and refuse the next run over it
            if started and state.is_main_process and not any(directory.glob("part-*.jsonl.gz")):
                (directory / REGENERATE_SETTINGS).unlink(missing_ok=True)
            raise
    result.excluded, result.short = excluded, short
    return result


def with_a_turn_to_answer(row: dict) -> dict:
    """A prompt (a conversation with no assistant turn after a user turn: named:arena_hard, a request log, a
    greeting and a question) gets an empty assistant turn after its last turn, which the target writes like
    every other."""
    messages = row["messages"]
    if not answered_turns(messages):  # an opening assistant turn is context, not an answer
        messages = [*messages, {**dict.fromkeys(messages[-1]), "role": "assistant", "content": ""}]  # no user's name
    return {"messages": messages}


def kept_conversations(conversations, section):
    """data.train less the conversations with a held-out first user turn (`exclude`) and those with fewer
    assistant turns than `min_turns`; and how many of each were left out."""
    held_out = set()
    if section.exclude:
        held_out = {first_user_turn(row["messages"]) for row in load_conversations(list(section.exclude))}
    keep, excluded, short = [], 0, 0
    for index, row in enumerate(conversations.select_columns(["messages"])):
        if first_user_turn(row["messages"]) in held_out:
            excluded += 1
        elif len(answered_turns(row["messages"])) < section.min_turns:
            short += 1
        else:
            keep.append(index)
    return (conversations if len(keep) == len(conversations) else conversations.select(keep)), excluded, short


def first_user_turn(messages: list[dict]) -> Optional[str]:
    return next((message["content"] for message in messages if message["role"] == "user"), None)


def check_reusable(directories, settings: dict[str, Any]) -> None:
    """Each reused directory is a regeneration whose answers were made as this run's would be."""
    for directory in map(Path, directories):
        path = directory / REGENERATE_SETTINGS
        if not path.is_file():
            raise UserError(
                f"data.regenerate.reuse: {directory} holds no {REGENERATE_SETTINGS}, so no regeneration to reuse"
            )
        saved = read_json(path, "regeneration record", "leave it out of data.regenerate.reuse")
        require_marks(saved, directory, "leave it out of data.regenerate.reuse")
        require_same_settings(
            {key: saved.get(key) for key in ANSWER_SETTINGS},
            {key: settings.get(key) for key in ANSWER_SETTINGS},
            f"data.regenerate.reuse: {directory} was answered",
            "its answers are not this run's; leave it out of data.regenerate.reuse",
        )


def known_answers(reused) -> dict[str, Answer]:
    """Every assistant turn of the reused regenerations, by the conversation before it."""
    known = {}
    for row in reused.select_columns(["messages"]) if reused is not None else []:
        for turn in answered_turns(row["messages"]):
            message = row["messages"][turn]
            known[prompt_key(row["messages"][:turn])] = Answer(message["content"], bool(message[CUT_KEY]))
    return known


def regenerate_into(
    cfg: DictConfig, directory: Path, conversations, known: dict[str, Answer], target, tokenizer, state
) -> RegenerateResult:
    """Conversation k // samples written as row k of the output, in parts of data.regenerate.batch_size rows."""
    section, name = cfg.data.regenerate, cfg.target.name_or_path
    tokenizer = tokenizer or load_tokenizer(cfg.target)
    batch_size, rows_total = section.batch_size, len(conversations) * section.samples
    chunks = [list(range(start, min(start + batch_size, rows_total))) for start in range(0, rows_total, batch_size)]
    todo = [index for index in range(len(chunks)) if not (directory / output_part_name(index)).is_file()]
    mine = todo[state.process_index :: state.num_processes]
    done = rows_total - sum(len(chunks[index]) for index in todo)
    if done and state.is_main_process:  # said as it starts: the line that counts the folder's totals comes at the end
        written = len(chunks) - len(todo)
        logger.info(
            "resuming the regeneration in %s: %d of its %d parts written by an earlier run (%d of %d rows), %d to go",
            directory, written, len(chunks), done, rows_total, len(todo),
        )  # fmt: skip
    progress = progress_bar(
        total=rows_total,
        initial=done,
        desc=f"regenerate ({section.engine})",
        unit="conversation",
        disable=not state.is_main_process,
    )
    generated, cut, empty, tool_calls, reused, cut_answers = 0, 0, 0, 0, 0, 0
    left_out: Counter = Counter()
    with answer_engine(cfg, target, tokenizer, state, bool(mine)) as engine:
        for index in mine:
            rows = [conversations[k // section.samples] for k in chunks[index]]
            seeds = chunks[index]  # each conversation's, for an engine that seeds each prompt (vLLM)
            torch.manual_seed(section.seed + index)
            messages, ended, taken = regenerate_batch(
                engine,
                tokenizer,
                [row["messages"] for row in rows],
                section,
                cfg.data.max_length,
                seeds,
                known,
                [f"{row['source']} record {row['record']}" for row in rows],
            )
            records = [
                {"messages": without_nulls(m), "domain": row["domain"], "regenerated_by": name}
                for m, row in zip(messages, rows)
                if m is not None
            ]
            write_part(directory / output_part_name(index), records)
            why_kept_ended = [why for m, why in zip(messages, ended) if m is not None]
            generated += len(records)
            cut += why_kept_ended.count("max_length")
            empty += why_kept_ended.count("empty answer")
            tool_calls += why_kept_ended.count("tool calls")
            left_out.update(why for m, why in zip(messages, ended) if m is None)
            reused += taken
            cut_answers += sum(bool(m[t].get(CUT_KEY)) for m in messages if m is not None for t in answered_turns(m))
            # The others go at about the same pace; the estimate stops at the total.
            progress.update(min(len(rows) * state.num_processes, progress.total - progress.n))
    progress.close()
    if state.num_processes > 1:
        from accelerate.utils import gather_object

        # a collective: past it, every rank's parts are written
        generated, cut, empty, tool_calls, reused, cut_answers = (
            sum(gather_object([value])) for value in (generated, cut, empty, tool_calls, reused, cut_answers)
        )
        left_out = sum(gather_object([left_out]), Counter())
    # the output's totals, read from every part (earlier runs' too): what a part does not hold of its batch was left out
    written = cut_in_all = left_out_in_all = 0
    for index, chunk in enumerate(chunks):
        with gzip.open(directory / output_part_name(index), "rt") as part:
            records = [json.loads(line) for line in part]
        written += len(records)
        left_out_in_all += len(chunk) - len(records)
        cut_in_all += sum(bool(r["messages"][t].get(CUT_KEY)) for r in records for t in answered_turns(r["messages"]))
    return RegenerateResult(
        directory,
        written,
        generated,
        cut,
        empty,
        tool_calls,
        left_out,
        reused,
        cut_answers,
        left_out_in_all,
        cut_in_all,
    )


def content_digest(conversations) -> str:
    """What a regeneration reads, by content: sha256 over every conversation's messages and domain, in order,
    the keys holding None left out, so that a field the loader adds to every turn (`cut`, `tool_calls`) moves no
    digest. Not the data set's fingerprint: that changes with the file's path, the library's version and
    draftsmith's own loading code, and a finished regeneration must stay resumable across those (moved to
    another machine, committed beside a benchmark: benchmarks/redigest_regenerations.py)."""
    digest = hashlib.sha256()
    for row in conversations.select_columns(["messages", "domain"]):
        digest.update(json.dumps(without_nulls(row), sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()[:16]


def require_marks(saved: dict[str, Any], directory: Path, advice: str) -> None:
    """A regeneration's settings record the marks its turns carry (MARKS): one made before them is not resumed
    or reused, since its answers cut at max_new_tokens would count as finished."""
    if saved.get("marks") != MARKS:
        raise UserError(
            f"{directory} was regenerated before draftsmith marked answers cut at data.regenerate.max_new_tokens "
            f"(`cut`), so its cut answers would read as finished turns: {advice}, and regenerate"
        )


def claim_directory(directory: Path, settings: dict[str, Any]) -> None:
    """Start a new output directory, or resume one made with the same settings; drop partial parts."""
    path, advice = directory / REGENERATE_SETTINGS, "use another data.regenerate.output or delete it"
    if path.is_file():
        saved = read_json(path, "regeneration record", advice)
        require_marks(saved, directory, advice)
        if saved.get("data") != settings["data"]:  # a digest: say what it is of
            advice = (
                "data is the digest of the conversations to answer (data.train, data.max_conversations, "
                f"data.regenerate.exclude and min_turns decide them); {advice}"
            )
        if saved.get("temperature") == settings["temperature"] == 0:  # greedy answers read no seed (one was recorded)
            saved = {**saved, "seed": settings["seed"]}
        # the part count follows from the data and batch_size (and was not recorded before): not compared
        saved, compared = ({key: value for key, value in kept.items() if key != "parts"} for kept in (saved, settings))
        require_same_settings(saved, compared, f"{directory} holds a regeneration", advice)
    elif any(directory.glob("part-*")):
        raise UserError(f"{directory} holds part files but no {REGENERATE_SETTINGS}; {advice}")
    elif foreign := sorted(entry.name for entry in directory.iterdir() if not entry.name.startswith(".")):
        raise UserError(
            f"{directory} holds files no regeneration wrote ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}): data.train=[{directory}] would read them with its parts; "
            "use another data.regenerate.output"
        )
    else:
        write_text_atomic(path, json.dumps(settings, indent=2) + "\n")
    for leftover in directory.glob("*.tmp"):  # a part a killed run was writing
        leftover.unlink()


def write_part(path: Path, records: list[dict[str, Any]]) -> None:
    """Write to `<name>.tmp`, rename into place (`replacing`). The gzip header's time is fixed (mtime 0), so the
    same records always give the same bytes, whether or not the run was interrupted."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    with replacing(path) as tmp:
        with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
            f.write(text.encode())
