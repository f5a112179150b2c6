"""Held-out evaluation during training (train.heldout, train.eval_every): the chain estimate from
per-depth top-1, the best checkpoint (best/) and its state, the acceptance-vs-tokens curve, and the
real train.py keeping best/ equal to the step that evaluated best, exactly across a resume."""

from __future__ import annotations

import json
import math
from dataclasses import asdict

import datasets
import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file

from draftsmith.errors import InternalError, UserError
from draftsmith.heads import drafter_class
from draftsmith.recipe import load_recipe
from draftsmith.target import TargetShape
from draftsmith.trainer.checkpoint import TrainerState
from draftsmith.trainer.curve import chain_tau, depth_top1, plot_curves, write_curve
from draftsmith.trainer.heldout import (
    BEST_DIR,
    BEST_JSON,
    evaluations_since_best,
    keep_best,
    patience_spent,
    split_heldout,
)
from tests.helpers import kill_train_after, read_curve, read_log, run_entry_in_process, train_args, train_in_process

HELDOUT = [
    "train.heldout=8",
    "train.eval_every=2",
    "train.max_steps=4",
    "train.save_every=2",
    "train.keep_checkpoints=0",
    "data.eval=[]",
]


# -- fast: the estimate, the best-checkpoint decision, the curve, the checks ---------------------


def test_depth_top1_and_chain_tau():
    metrics = {
        "head2/top1": 0.5,
        "head1/top1": 0.8,
        "head1/top5": 0.9,
        "head3/top1": 0.2,
        "backbone/top1": 0.99,
        "loss": 3.0,
    }
    head = "head{depth}/top1"
    assert depth_top1(metrics, 2, head) == [("head1/top1", 0.8), ("head2/top1", 0.5)]
    assert [name for name, _ in depth_top1(metrics, 9, head)] == ["head1/top1", "head2/top1", "head3/top1"]
    # only the run's kind's metrics: a kind whose loss names none by its DEPTH_TOP1 is a bug (its held-out τ estimate
    # was 1 at every evaluation, and best/ and train.patience followed that constant)
    with pytest.raises(InternalError, match=r"reports no step1/top1 \(its Drafter.DEPTH_TOP1, 'step\{depth\}/top1'\)"):
        depth_top1(metrics, 2, "step{depth}/top1")
    step = "step{depth}/top1"
    assert depth_top1({"step1/top1": 0.7, "step3/top1": 0.1}, 3, step) == [("step1/top1", 0.7)]  # consecutive from 1
    blocks = {"block1/top1": 0.6, "block2/top1": 0.3}
    assert depth_top1(blocks, 3, "block{depth}/top1") == [("block1/top1", 0.6), ("block2/top1", 0.3)]
    assert chain_tau([0.8, 0.5, 0.2]) == pytest.approx(1 + 0.8 + 0.4 + 0.08)
    assert chain_tau([]) == 1.0


def tiny_medusa():
    cls = drafter_class("medusa")
    return cls(cls.Config(num_heads=2), TargetShape("tiny", "llama", hidden_size=8, vocab_size=16, num_hidden_layers=2))


def weights_equal(directory, drafter) -> bool:
    saved = load_file(str(directory / "model.safetensors"))
    own = drafter.state_dict()
    return saved.keys() == own.keys() and all(torch.equal(saved[name], own[name]) for name in own)


def test_keep_best_writes_best_only_when_tau_rises(tmp_path):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    drafter, state = tiny_medusa(), TrainerState()
    best = tmp_path / BEST_DIR

    def evaluate(step, tau):
        state.step, state.tokens = step, 100 * step
        return keep_best(accelerator, drafter, state, tmp_path, {"head1/top1": tau - 1, "tau_est": tau})

    assert evaluate(2, 1.5)
    first = {name: value.clone() for name, value in drafter.state_dict().items()}
    assert weights_equal(best, drafter) and sorted(p.name for p in best.iterdir()) == [
        "best.json",
        "config.json",
        "model.safetensors",
    ]
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(1.0)
    assert not evaluate(4, 1.5)  # a tie keeps the earlier evaluation
    assert not evaluate(5, math.nan)
    saved = load_file(str(best / "model.safetensors"))
    assert all(torch.equal(saved[name], first[name]) for name in first)
    assert json.loads((best / BEST_JSON).read_text())["step"] == 2 and state.best["step"] == 2

    assert evaluate(6, 1.75)
    assert weights_equal(best, drafter)
    recorded = json.loads((best / BEST_JSON).read_text())
    assert (
        recorded
        == state.best
        == {"step": 6, "tokens": 600, "tau_est": 1.75, "metrics": {"heldout/head1/top1": 0.75, "heldout/tau_est": 1.75}}
    )
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))

    # The state carries best and the curve through a checkpoint; a state saved before they existed loads.
    state.curve.append({"step": 6, "tokens": 600, "tau_est": 1.75, "top1": {"head1/top1": 0.75}})
    assert TrainerState(**json.loads(json.dumps(asdict(state)))) == state
    old = TrainerState(**{"step": 4, "epoch": 0, "batch_in_epoch": 4, "skipped_steps": 0})
    assert (old.tokens, old.best, old.curve) == (0, None, [])


def test_patience_counts_the_evaluations_after_the_best():
    def state(taus, best_step):
        rows = [{"step": 2 * (i + 1), "tau_est": tau} for i, tau in enumerate(taus)]
        return TrainerState(curve=rows, best=None if best_step is None else {"step": best_step})

    assert evaluations_since_best(state([], None)) == 0
    assert evaluations_since_best(state([1.2, 1.5, 1.4, 1.5], 4)) == 2  # a tie is no new best
    assert evaluations_since_best(state([math.nan, math.nan], None)) == 2  # nothing finite: every one counts
    assert not patience_spent(state([1.2, 1.5, 1.4, 1.5], 4), 3) and patience_spent(state([1.2, 1.5, 1.4, 1.5], 4), 2)
    assert not patience_spent(state([1.2, 1.1, 1.0, 0.9], 2), 0)  # 0 = never stop early


def test_curve_files_and_plot_of_several_runs(tmp_path):
    rows = [
        {"step": s, "tokens": 500 * s, "tau_est": 1 + 0.1 * s, "top1": {"step1/top1": 0.05 * s, "step2/top1": 0.02 * s}}
        for s in (2, 4)
    ]
    write_curve(tmp_path, rows, best={"step": 4})
    assert read_curve(tmp_path) == {"best": {"step": 4}, "rows": rows}
    assert (tmp_path / "curve.png").stat().st_size > 0
    plot_curves({"a": rows, "b": rows[:1]}, tmp_path / "both.png", title="two runs")
    assert (tmp_path / "both.png").stat().st_size > 0


def test_split_heldout_takes_the_last_conversations():
    rows = range(10)  # a conversation each
    data = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in rows], "sample": [f"s:{i}" for i in rows]})
    kept, heldout = split_heldout(data, 3, step_size=4)
    assert [row[0] for row in kept["input_ids"]] == list(range(7)) and [row[0] for row in heldout["input_ids"]] == [
        7,
        8,
        9,
    ]
    with pytest.raises(UserError) as info:
        split_heldout(data, 7, step_size=4)
    assert "train.heldout=7 leaves 3 of the 10 data.train rows" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow  # 2.3-3 s on a 2-core CI machine: over the fast tier's share (docs/tests.md)
def test_a_step_counts_accumulation_and_an_epoch_says_what_it_leaves_out(tmp_path, small_data, token_cache, capsys):
    """The held-out refusal said a step was processes x micro-batch (4 here) where grad_accum makes it 8, and
    passed a held-out share that left 7 conversations, so that the next refusal, which does not name
    train.heldout, said they could not fill a step; an epoch cut to whole steps left conversations out without
    a word."""
    from tests.helpers import assert_one_line_error

    def run(*extra, output="run"):  # no eval stage: nothing here reads it
        args = train_args(
            tmp_path / output, small_data, token_cache, "data.max_conversations=10", "data.eval=[]", *extra
        )
        return run_entry_in_process(["train.py", *args], capsys)

    assert_one_line_error(
        run("train.heldout=7", "train.grad_accum=2"),
        2,
        "leaves 3 of the 10 data.train rows for training, fewer than one step of 8 (processes x "
        "train.micro_batch_size x train.grad_accum)",
    )
    assert_one_line_error(run("train.heldout=3", "train.grad_accum=2"), 2, "train.heldout=3 leaves 7 of the 10")
    result = run("train.max_steps=2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "an epoch is 2 steps of 4 conversations: 2 of the 10 training conversations are left out of each one" in (
        result.stderr
    )
    shorter = run("train.max_steps=1", output="shorter")  # no epoch ends: none is left out
    assert shorter.returncode == 0 and "left out of each one" not in shorter.stderr


@pytest.mark.parametrize(
    "override, fragment",
    [
        (["train.eval_every=5"], "train.eval_every=5 needs train.heldout > 0"),
        (["train.heldout=-1"], "train.heldout=-1 must be >= 0"),
        (["train.heldout=4", "train.eval_every=-2"], "train.eval_every=-2 must be >= 0"),
        (["train.heldout=4", "train.patience=2"], "train.patience=2 needs train.eval_every > 0"),
        (["train.heldout=4", "train.eval_every=5", "train.patience=-1"], "train.patience=-1 must be >= 0"),
        (["data.features=/nonexistent", "train.heldout=4"], "train.heldout=4 is not supported with data.features yet"),
    ],
)
def test_recipe_checks_are_one_line(override, fragment):
    with pytest.raises(UserError) as info:
        load_recipe(["recipe=medusa", *override])
    assert fragment in str(info.value) and "\n" not in str(info.value)
    assert load_recipe(["recipe=medusa", "train.heldout=4", "train.eval_every=5"]).train.eval_every == 5


# -- slow: the real train.py -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def heldout_run(tmp_path_factory, small_data, token_cache):
    output_dir = tmp_path_factory.mktemp("heldout") / "run"
    train_in_process(train_args(output_dir, small_data, token_cache, *HELDOUT))
    return output_dir


@pytest.mark.slow
def test_training_keeps_the_best_heldout_checkpoint(heldout_run):
    out = heldout_run
    log = read_log(out)
    assert sorted(step for step, row in log.items() if "heldout/tau_est" in row) == [2, 4]
    assert all("train/tokens" in row for row in log.values())
    tokens = [log[step]["train/tokens"] for step in sorted(log)]
    assert tokens == sorted(tokens) and tokens[0] > 0 and len(set(tokens)) == len(tokens)
    for step in (2, 4):
        row = log[step]
        assert {"heldout/head1/top1", "heldout/head2/top1", "heldout/head3/top1", "heldout/loss"} <= set(row)
        expected = 1 + row["heldout/head1/top1"] * (1 + row["heldout/head2/top1"] * (1 + row["heldout/head3/top1"]))
        assert row["heldout/tau_est"] == pytest.approx(expected, abs=1e-5)

    # best/ is the step with the highest tau_est (the first of equals), in final/'s format
    taus = {step: log[step]["heldout/tau_est"] for step in (2, 4)}
    best_step = max(taus, key=lambda step: (taus[step], -step))
    best = json.loads((out / BEST_DIR / BEST_JSON).read_text())
    assert best["step"] == best_step and best["tokens"] == log[best_step]["train/tokens"]
    assert best["tau_est"] == pytest.approx(taus[best_step], abs=1e-6)
    for name, value in best["metrics"].items():
        assert log[best_step][name] == pytest.approx(value, abs=1e-6), name
    assert {p.name for p in (out / BEST_DIR).iterdir()} == {p.name for p in (out / "final").iterdir()} | {BEST_JSON}
    at_step = load_file(str(out / "checkpoints" / f"step_{best_step:07d}" / "drafter" / "model.safetensors"))
    in_best = load_file(str(out / BEST_DIR / "model.safetensors"))
    assert in_best.keys() == at_step.keys() and all(torch.equal(in_best[k], at_step[k]) for k in at_step)
    if best_step != 4:  # and not the final weights
        final = load_file(str(out / "final" / "model.safetensors"))
        assert any(not torch.equal(in_best[k], final[k]) for k in final)

    curve = read_curve(out)
    assert [(r["step"], r["tokens"], r["samples"]) for r in curve["rows"]] == [
        (s, log[s]["train/tokens"], 4 * s) for s in (2, 4)
    ]
    assert [r["tau_est"] for r in curve["rows"]] == pytest.approx([taus[s] for s in (2, 4)], abs=1e-6)
    assert list(curve["rows"][0]["top1"]) == ["head1/top1", "head2/top1", "head3/top1"] and curve["best"] == best
    assert (out / "curve.png").stat().st_size > 0
    assert OmegaConf.load(out / "recipe.yaml").train.heldout == 8


@pytest.mark.slow
def test_resume_continues_the_best_and_the_curve_exactly(heldout_run, tmp_path, small_data, token_cache, capsys):
    killed = tmp_path / "killed"
    args = train_args(killed, small_data, token_cache, *HELDOUT)
    checkpoint = killed / "checkpoints" / "step_0000002"
    kill_train_after(checkpoint, args)
    assert sorted(p.name for p in (killed / "checkpoints").iterdir() if not p.name.endswith(".tmp")) == ["step_0000002"]
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert [row["step"] for row in state["curve"]] == [2] and state["best"]["step"] == 2

    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step_0000002" in resumed.stderr
    a, b = read_log(heldout_run), read_log(killed)
    for step in (3, 4):
        for key in ("train/loss", "heldout/tau_est", "train/tokens"):
            if key in a[step]:
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-6), (step, key)
    best_a, best_b = (json.loads((out / BEST_DIR / BEST_JSON).read_text()) for out in (heldout_run, killed))
    assert (best_b["step"], best_b["tokens"]) == (best_a["step"], best_a["tokens"])
    assert best_b["tau_est"] == pytest.approx(best_a["tau_est"], rel=1e-5)
    weights_a, weights_b = (load_file(str(out / BEST_DIR / "model.safetensors")) for out in (heldout_run, killed))
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-5, atol=1e-6)
    rows_a, rows_b = read_curve(heldout_run)["rows"], read_curve(killed)["rows"]
    assert [(r["step"], r["tokens"]) for r in rows_b] == [(r["step"], r["tokens"]) for r in rows_a]
    assert [r["tau_est"] for r in rows_b] == pytest.approx([r["tau_est"] for r in rows_a], rel=1e-5)


@pytest.mark.slow
def test_patience_stops_training_on_acceptance_and_a_resume_counts_on(tmp_path, small_data, token_cache, capsys):
    """A learning rate too small to move a float32 weight keeps tau_est level: the first evaluation is
    the best, and train.patience=2 ends the run two evaluations later, at step 3 of 10. Resumed with
    patience 3, it counts on from the state and stops one evaluation later."""
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, "train.heldout=8", "train.eval_every=1", "train.max_steps=10",
                      "train.lr=1e-12", "data.eval=[]")  # fmt: skip
    first = run_entry_in_process(["train.py", *args, "train.patience=2"], capsys)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "stopped at step 3 of 10: 2 held-out evaluations in a row without beating step 1's tau_est" in first.stderr
    assert max(read_log(out)) == 3 and json.loads((out / "run_summary.json").read_text())["ended"] == "patience"
    assert json.loads((out / BEST_DIR / BEST_JSON).read_text())["step"] == 1 and (out / "final").is_dir()

    resumed = run_entry_in_process(["train.py", *args, "train.patience=3", "train.resume=true"], capsys)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "stopped at step 4 of 10: 3 held-out evaluations" in resumed.stderr
    assert [row["step"] for row in read_curve(out)["rows"]] == [1, 2, 3, 4]
    assert json.loads((out / "run_summary.json").read_text())["steps"] == 4
