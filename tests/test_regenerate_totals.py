"""regenerate's final lines count the output folder's totals, every run's parts read, beside what the run
itself did: a resumed run that finishes the last part says how many conversations were left out and how many
answers cut in all, not only its own."""

from __future__ import annotations

import gzip
import json

from tests.helpers import REFERENCE_TARGET, run_entry_in_process

QUESTIONS = ["Say hi.", "Name a number above 3.", "Count to five."]


def conversation(question: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": "?"}]}


def test_a_resumed_regeneration_counts_the_folders_totals(tmp_path, capsys):
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target, load_tokenizer

    overlong = {"messages": [{"role": "user", "content": "Listen. " * 80}, {"role": "assistant", "content": "?"}]}
    rows = [conversation(QUESTIONS[0]), overlong, *map(conversation, QUESTIONS[1:])]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = [
        "recipe=draft",
        f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{train}]",
        "data.max_length=64",  # the overlong prompt is left out
        "data.regenerate.batch_size=1",
        "data.regenerate.max_new_tokens=2",  # every answer is cut
        f"data.regenerate.output={out}",
        f"output_dir={tmp_path / 'run'}",
    ]
    first = regenerate(load_recipe(args), load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET)))
    assert (first.conversations, first.generated, first.left_out_in_all, first.cut_answers_in_all) == (3, 3, 1, 3)
    (out / "part-00003.jsonl.gz").unlink()  # as a run killed before its last part

    done = run_entry_in_process(["-m", "data_prep.regenerate", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    # said as it starts, not only in the totals at its end
    assert f"resuming the regeneration in {out}: 3 of its 4 parts written by an earlier run (3 of 4 rows), 1 to go" in (
        done.stderr
    )
    assert (
        f"3 conversations in {out} and 1 left out, every run's parts counted (1 generated now, 0 of them ended "
        "early at a later prompt of data.max_length=64 tokens or more, 0 at an empty answer; of those taken up now, 0 "
        "left out;"
    ) in done.stdout
    assert f"3 answers cut at data.regenerate.max_new_tokens=2 in {out} (1 of them generated now;" in done.stdout

    done = run_entry_in_process(["-m", "data_prep.regenerate", *args], capsys)  # finished: nothing to do
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"3 conversations in {out} and 1 left out, every run's parts counted (0 generated now" in done.stdout
    assert f"3 answers cut at data.regenerate.max_new_tokens=2 in {out} (0 of them generated now;" in done.stdout


def test_a_conversations_last_unanswered_question_is_answered(tmp_path, capsys):
    """A chat that ends on a user turn after answered turns gets the target's answer to it, as a prompt-only
    conversation does: it was written ending on that question, a last turn nothing trains on. The input's digest
    in regenerate.settings is the conversations' as read, so regenerations finished before resume as they were."""
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.data_prep.regenerate import content_digest

    chat = {
        "messages": [
            {"role": "user", "content": QUESTIONS[0]},
            {"role": "assistant", "content": "?"},
            {"role": "user", "content": QUESTIONS[1]},
        ]
    }
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps(chat) + "\n")
    out = tmp_path / "out"
    args = [
        "recipe=draft",
        f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{train}]",
        "data.max_length=64",
        "data.regenerate.max_new_tokens=2",
        f"data.regenerate.output={out}",
        f"output_dir={tmp_path / 'run'}",
    ]
    done = run_entry_in_process(["-m", "data_prep.regenerate", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"1 conversations in {out} and 0 left out" in done.stdout
    assert f"2 answers cut at data.regenerate.max_new_tokens=2 in {out}" in done.stdout  # both turns answered
    (record,) = [json.loads(line) for line in gzip.open(out / "part-00000.jsonl.gz", "rt")]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    assert record["messages"][2]["content"] == QUESTIONS[1]
    assert all(m["content"] and m["content"] != "?" for m in record["messages"][1::2])
    settings = json.loads((out / "regenerate.settings").read_text())
    assert settings["data"] == content_digest(load_conversations([str(train)], prompts_only=True))
