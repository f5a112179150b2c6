"""Duplicate conversations in data.train (counted, kept), data.eval conversations that data.train holds too
(a warning, and the count in eval_accuracy.json), eval report prompts that data.train answers (a warning, and
the count in report.json and report.md); regenerate's count of what it left out, by reason."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.dataset import load_tokenized
from draftsmith.data_prep.overlap import answered_prompt_digests, eval_in_train, prompt_digest
from draftsmith.data_prep.regenerate_turns import left_out_line
from draftsmith.recipe import load_recipe
from draftsmith.target import load_tokenizer
from tests.helpers import REFERENCE_TARGET, run_entry_in_process, train_args


def conversation(question: str, answer: str, domain: str = "chat") -> dict:
    return {
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        "domain": domain,
    }


# the third repeats the first turn for turn (its domain aside); the eval split shares the second with data.train
TRAIN = [conversation("2+2?", "4"), conversation("Capital of France?", "Paris."), conversation("2+2?", "4", "math")]
TRAIN += [conversation(f"Say {word}.", word) for word in ("one", "two", "three", "four", "five")]
EVAL = [conversation("Capital of France?", "Paris."), conversation("Capital of Spain?", "Madrid.")]


def write(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_duplicates_are_counted_and_kept_and_eval_in_train_is_warned_of(tmp_path, caplog):
    """A conversation that repeats an earlier one turn for turn is counted in one line and trained on as often
    as it occurs (on a cache hit the line comes again); a data.eval conversation that data.train holds too is
    counted in one warning naming both keys' files."""
    train, held = write(tmp_path / "train.jsonl", TRAIN), write(tmp_path / "eval.jsonl", EVAL)
    cfg = load_recipe(
        [
            "recipe=medusa",
            f"target.name_or_path={REFERENCE_TARGET}",
            f"data.train=[{train}]",
            f"data.eval=[{held}]",
            f"data.cache_dir={tmp_path / 'cache'}",
            f"output_dir={tmp_path / 'run'}",
        ]  # fmt: skip
    )
    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    caplog.set_level(logging.INFO, logger="draftsmith.data")
    duplicates = (
        "1 of 8 conversations repeat an earlier one turn for turn: kept, each trained on as often as it occurs "
        "(repeated traffic is traffic, and weights the drafter toward it)"
    )
    for _ in ("tokenized", "read from the cache"):
        caplog.clear()
        rows = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
        assert [record.getMessage() for record in caplog.records].count(duplicates) == 1
        assert len(rows) == 8  # none dropped
    eval_rows = load_tokenized(cfg, cfg.data.eval, tokenizer, "data.eval")
    caplog.clear()
    assert eval_in_train(rows, eval_rows, cfg) == {"conversations": 1, "of": 2}
    [warning] = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert warning.getMessage().startswith(
        f"1 of the 2 data.eval conversations ({held}) are in data.train ({train}) too, turn for turn: "
    )
    caplog.clear()
    assert eval_in_train(rows, eval_rows.select([1]), cfg) == {"conversations": 0, "of": 1}
    assert not caplog.records  # nothing shared: nothing said


def test_a_prompt_is_in_train_where_an_answered_turn_answers_it_turn_for_turn():
    """A prompt (its turns up to its last answer, or all of them where it ends with a user turn) is in data.train
    where a training conversation answers those very turns, whatever answer either gives; not where one turn
    differs or the training conversation only goes on from it (the turns after a prompt are not its answer)."""
    system = {"role": "system", "content": "Be brief."}
    user = {"role": "user", "content": "2+2?"}
    answered = [system, user, {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    answered.append({"role": "assistant", "content": "6"})
    trained = set(answered_prompt_digests(answered))
    assert len(trained) == 2  # the prompt of each of its two answers
    assert prompt_digest([system, user]) in trained  # a prompt with no answer yet
    assert prompt_digest([system, user, {"role": "assistant", "content": "Four."}]) in trained  # another answer
    assert prompt_digest(answered) in trained  # the second answer's prompt: every turn before it
    assert prompt_digest([user]) not in trained  # without the system turn: another prompt
    assert prompt_digest([system, {"role": "user", "content": "2+2 ?"}]) not in trained
    assert prompt_digest([system, user, answered[2], answered[3], answered[4], user]) not in trained


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_a_run_warns_at_start_and_records_the_counts_in_eval_accuracy_and_the_report(
    tmp_path, token_cache, capsys, monkeypatch
):
    """train.py says so before training; the eval split's table records how many of its conversations data.train
    holds (eval_accuracy.json's `eval_in_train`), and the report how many of its prompts data.train answers
    (report.json's `prompts_in_train`, a line in report.md), from the start's count: data.train is gone through
    once."""
    from draftsmith.data_prep import overlap

    went_through = []
    monkeypatch.setattr(
        overlap, "answered_prompt_digests", lambda m: went_through.append(m) or answered_prompt_digests(m)
    )
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    write(data["train"], TRAIN), write(data["eval"], EVAL)
    prompts = write(tmp_path / "prompts.jsonl", [
        {"messages": [{"role": "user", "content": "2+2?"}], "domain": "chat"},  # data.train answers it twice
        {"messages": [{"role": "user", "content": "Capital of Italy?"}], "domain": "chat"},
    ])  # fmt: skip
    report_settings = ["eval.enabled=true", f"eval.data=[{prompts}]", "eval.max_new_tokens=4", "eval.tree=0"]
    args = train_args(tmp_path / "run", data, token_cache, "train.max_steps=1", *report_settings)
    done = run_entry_in_process(["train.py", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    said = done.stdout + done.stderr
    assert said.count("1 of the 2 data.eval conversations") == 1  # at the start; the table says it in its own words
    assert "1 of these 2 conversations are in data.train too" in done.stdout
    accuracy = json.loads((tmp_path / "run" / "eval_accuracy.json").read_text())
    assert accuracy["eval_in_train"] == {"conversations": 1, "of": 2}
    assert said.count(f"1 of the 2 prompts of the eval report ({prompts}) are prompts data.train") == 1
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["prompts_in_train"] == {"prompts": 1, "of": 2, "per_domain": {"chat": 1}}
    assert len(went_through) == len(TRAIN)  # at the start alone: the report reused its count
    assert (
        "**1 of these 2 prompts are prompts data.train answers** (chat 1)"
        in (tmp_path / "run" / "eval" / "report.md").read_text()
    )


def test_an_eval_away_from_the_training_data_says_its_prompts_were_not_counted(tmp_path):
    """A standalone eval whose recipe's data.train this machine cannot read still evaluates: the report says the
    prompts were not counted, and why."""
    from draftsmith.data_prep.overlap import prompts_in_train

    cfg = load_recipe(["recipe=medusa", f"data.train=[{tmp_path / 'elsewhere.jsonl'}]"])
    counted, count = prompts_in_train({"chat": [[{"role": "user", "content": "2+2?"}]]}, cfg)
    assert count is None
    assert counted["prompts"] is None and counted["of"] == 1
    assert counted["not_counted"].startswith("data.train could not be read: ")
    assert "elsewhere.jsonl" in counted["not_counted"]


def test_regenerates_left_out_line_says_why_with_counts():
    """The final line's `N left out` names each reason with its count, so that a user knows which setting to
    change; none left out says just that."""
    left_out = Counter({"max_length": 9, "empty answer": 2, "tool calls": 1})
    assert left_out_line(left_out, 2048, 1) == (
        "12 left out, ended before min_turns=1 answers: 9 at a prompt of data.max_length=2048 tokens or more, "
        "2 at an empty answer, 1 at the answer to a turn that called tools"
    )
    assert left_out_line(Counter({"empty answer": 3}), 2048, 2) == (
        "3 left out, ended before min_turns=2 answers: 3 at an empty answer"
    )
    assert left_out_line(Counter(), 2048, 1) == "0 left out"


QUESTIONS = ["2+2?", "Capital of Italy?"]  # data.train answers the first


def test_the_runs_second_count_of_unchanged_data_goes_through_no_conversation_again(tmp_path, monkeypatch):
    """A training run counts the report's prompts in data.train at its start and its report again at its end:
    the start's count, passed to the report's, spares it going through every conversation's turns again (it went
    through all of data.train twice); data.train edited in between, or other prompts, are counted afresh. Nothing
    is kept between counts but what the caller passes."""
    from draftsmith.data_prep import overlap

    went_through = []
    monkeypatch.setattr(
        overlap, "answered_prompt_digests", lambda m: went_through.append(m) or answered_prompt_digests(m)
    )
    train = tmp_path / "train.jsonl"
    cfg = load_recipe(["recipe=medusa", f"data.train=[{write(train, TRAIN)}]"])
    prompts = write(tmp_path / "prompts.jsonl", [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS])
    chosen = {"chat": load_conversations([prompts], prompts_only=True)["messages"]}  # every turn's keys, as eval's
    counted, start = overlap.prompts_in_train(chosen, cfg)
    assert overlap.prompts_in_train(chosen, cfg, start) == (counted, start)
    assert counted == {"prompts": 1, "of": 2, "per_domain": {"chat": 1}}
    assert len(went_through) == len(TRAIN)  # the first count alone
    overlap.prompts_in_train(chosen, cfg)  # no count passed: counted afresh
    assert len(went_through) == 2 * len(TRAIN)
    write(train, [*TRAIN, conversation("Capital of Italy?", "Rome.")])  # the same path, other content
    assert overlap.prompts_in_train(chosen, cfg, start)[0]["prompts"] == 2
    assert len(went_through) == 3 * len(TRAIN) + 1
    counted, _ = overlap.prompts_in_train({"chat": chosen["chat"][:1]}, cfg, start)  # other prompts: counted
    assert counted["prompts"] == 1 and len(went_through) == 4 * len(TRAIN) + 2
    kept = [name for name, value in vars(overlap).items() if isinstance(value, (dict, set, list))]
    assert kept == ["__builtins__"]  # no module-level state: a long `monitor watch` retrains in one process


@pytest.mark.slow
def test_the_eval_split_counts_against_what_the_run_trained_on_not_its_held_out_conversations(
    tmp_path, token_cache, capsys
):
    """With train.heldout the eval split's table prepared its untrained drafter on all of data.train and counted
    eval_in_train against it, held-out conversations included: an EAGLE-3 untrained baseline had another draft
    vocabulary than the trained one. data.eval here is data.train's last 2, exactly the held-out ones."""
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    write(data["train"], TRAIN), write(data["eval"], TRAIN[-2:])
    args = train_args(tmp_path / "run", data, token_cache, "train.max_steps=1", "train.heldout=2")
    done = run_entry_in_process(["train.py", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    accuracy = json.loads((tmp_path / "run" / "eval_accuracy.json").read_text())
    assert accuracy["eval_in_train"] == {"conversations": 0, "of": 2}
