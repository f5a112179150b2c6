"""Observability of the training loop (issue #37, trainer/observe.py): the FLOP count behind MFU against a
hand count on a tiny Llama, and a 3-step run that logs parameter counts, model TFLOP/s, MFU and peak
memory, and writes a profiler trace for `train.profile_steps`."""

from __future__ import annotations

import json

import pytest

from draftsmith.heads import drafter_class
from draftsmith.trainer.observe import FlopCounter, attention_width, flops_per_token, matmul_parameters, mfu
from tests.helpers import read_log, tiny_llama, train_args, train_in_process


def test_flop_count_equals_a_hand_count_on_a_tiny_llama():
    # tiny_llama: hidden 48, intermediate 96, 2 layers, 4 query heads over 2 KV heads of 12, vocab 96, untied
    target = tiny_llama()
    q, k, v, o = 48 * 48, 48 * 24, 48 * 24, 48 * 48
    mlp = 3 * 48 * 96
    lm_head = 96 * 48  # the embedding table (96 x 48) is a lookup: not counted
    assert matmul_parameters(target) == 2 * (q + k + v + o + mlp) + lm_head == 46080
    assert attention_width(target) == 2 * 4 * 12

    eagle3 = drafter_class("eagle3")
    drafter = eagle3.from_target(eagle3.Config(draft_vocab_size=64, aux_layers=[0, 1], ttt_steps=3), target, "tiny")
    fc = 2 * 48 * 48  # two aux layers fused
    layer = 96 * 48 + 2 * 96 * 24 + 48 * 48 + mlp  # q, k, v read [embedding, feature]: 2 x hidden
    draft_head = 64 * 48
    assert matmul_parameters(drafter, trainable_only=True) == fc + layer + draft_head
    assert attention_width(drafter) == 4 * 12

    seq = 10
    counted = FlopCounter(target, drafter).per_token(seq)
    target_forward = 2 * 46080 + 4 * 96 * seq
    drafter_train = 6 * fc + 3 * (6 * (layer + draft_head) + 12 * 48 * seq)
    assert counted == {
        "target_forward": target_forward,
        "drafter_train": drafter_train,
        "total": target_forward + drafter_train,
    }
    assert flops_per_token(100, 0, 10, 0, seq_len=7)["total"] == 2 * 100 + 6 * 10
    assert mfu(1e9, 1000.0, peak_tflops=1.0, devices=2) == pytest.approx(0.5)


def test_tied_lm_head_counts_once():
    target = tiny_llama()
    target.lm_head.weight = target.model.embed_tokens.weight
    assert matmul_parameters(target) == 46080  # the shared tensor, once, as the lm_head


@pytest.mark.slow
def test_a_short_run_logs_throughput_memory_parameters_and_writes_a_trace(tmp_path, small_data, token_cache):
    output_dir = tmp_path / "run"
    train_in_process(
        train_args(
            output_dir,
            small_data,
            token_cache,
            "train.max_steps=3",
            "train.profile_steps=[2,3]",
            "train.peak_tflops=0.001",
            "data.eval=[]",  # the training's log, trace and summary are read, not its eval stage
        )
    )
    log = read_log(output_dir)
    assert 0 not in log  # every row is a step's; the counts ride on the run's first logged row
    assert log[1]["params/trainable"] > 0 and log[1]["params/frozen"] >= log[1]["params/target"] > 0
    assert "params/trainable" not in log[2]
    for step in (1, 2, 3):
        row = log[step]
        assert row["train/tokens_per_s"] > 0 and row["train/model_tflops_per_s"] > 0
        assert row["train/mfu"] == pytest.approx(row["train/model_tflops_per_s"] / 0.001, rel=1e-3, abs=1e-5)
        assert row["train/peak_memory_mb"] > 0
    traces = list((output_dir / "profile").glob("*.json"))
    assert [t.name for t in traces] == ["trace_rank0_steps2-3.json"]
    trace = json.loads(traces[0].read_text())
    assert trace["traceEvents"], "an empty trace"
    summary = json.loads((output_dir / "run_summary.json").read_text())
    assert summary["parameters"]["trainable"] == log[1]["params/trainable"]
