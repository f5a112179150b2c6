"""train.compile_drafter: the drafter's repeated blocks under torch.compile (draftsmith/compiled_layers.py); and a
train.py run with the target's layers compiled too (train.compile_target).

EAGLE-3's draft layer compiled, on the demo recipe's real micro-batches whose rows and widths vary: the losses and
gradients of the eager layer, in a bounded number of graphs that the same batches never add to, and a graph past
the limit is an error, not torch's eager fallback. On this CPU the training graphs are traced by dynamo and
AOTAutograd as inductor gets them and run by `aot_eager` (inductor's C++ for six forward and backward graphs takes
minutes on two cores), flex attention's included; inductor compiles the whole training step with flex attention
in the GPU tier (tests/test_gpu.py)."""

from __future__ import annotations

import copy
import logging
from types import SimpleNamespace

import pytest
import torch

from draftsmith import compiled_layers
from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe
from tests.helpers import read_log, train_in_process
from tests.test_ttt_flex import compiled_graphs, real_micro_batches


def with_target_outputs(drafter, target, batches) -> list[tuple[dict, object]]:
    """Each of `batches` with the host fields the drafter's loss reads, and the target's output on it (once, for every
    drafter run on it)."""
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.target import run_target

    inputs = []
    for batch in batches:
        batch = batch | drafter.host_fields(batch)
        with torch.no_grad():
            inputs.append(
                (batch, run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch)))
            )
    return inputs


def drafter_runs(drafter, inputs, grad: bool) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """(loss, gradients) of `drafter` on each (batch, target output) of `inputs`, as the trainer calls it (within the
    drafter's limits)."""
    results = []
    for batch, target_out in inputs:
        drafter.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad), compiled_layers.drafter_limits():
            loss = drafter(batch, target_out)[0]
            if grad:
                loss.backward()
        results.append((loss.detach(), [p.grad for p in drafter.parameters() if p.grad is not None]))
    return results


def graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def assert_compiled_drafter_trains_as_eager(
    device: torch.device, attention: str, picked: list[int], steps: int = 3, grad_modes=(True, False)
) -> None:
    """The demo recipe's packed micro-batches `picked` (1-4 rows of up to 384 positions: rows and widths vary)
    through EAGLE-3 (`steps` training-time-test steps, `attention`) with its draft layer compiled and not, in each of
    `grad_modes` (the held-out evaluation's forward runs without grad): equal losses and gradients (float32 rounding
    of fused operations), one graph per step kind, width kind and grad mode, none added by the same batches again,
    no graph break."""
    recipe = ["recipe=eagle3", f"drafter.ttt_steps={steps}", f"drafter.ttt_attention={attention}"]
    target, eager, batches = real_micro_batches(recipe, max(picked) + 1, pack=True)
    target, eager = target.to(device), eager.to(device)
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in batches[i].items()} for i in picked]
    inputs = with_target_outputs(eager, target, batches)
    compiled = copy.deepcopy(eager)
    assert compiled_layers.compile_drafter(compiled) == 1
    before, breaks = compiled_graphs(), graph_breaks()
    for grad in grad_modes:
        expected = drafter_runs(eager, inputs, grad)
        got = drafter_runs(compiled, inputs, grad)
        for (want_loss, want_grads), (loss, grads) in zip(expected, got):
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
            assert len(grads) == len(want_grads)
            for have, want in zip(grads, want_grads):
                torch.testing.assert_close(have, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    graphs = compiled_graphs() - before
    shapes = sorted({tuple(batch["input_ids"].shape) for batch in batches})
    assert len({rows for rows, _ in shapes}) >= 2 and len({width for _, width in shapes}) >= 2, shapes
    # a step kind each (their keys differ: the first, the second, the later) x (static, dynamic) x grad mode
    assert min(steps, 3) <= graphs <= min(steps, 3) * 2 * len(grad_modes) and graph_breaks() == breaks, (graphs, shapes)
    drafter_runs(compiled, inputs, grad=True)
    assert compiled_graphs() - before == graphs


@pytest.mark.slow
def test_compiled_draft_layer_trains_as_the_eager_one_on_real_batches(monkeypatch):
    """Two packed micro-batches of other rows and widths (3 x 365, then 4 x 384), dense attention (the CPU's), 2
    steps, with grad (the forward without it: `test_flex_attention_is_traced_into_the_compiled_draft_layer`)."""
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    assert_compiled_drafter_trains_as_eager(torch.device("cpu"), "dense", [0, 8], steps=2, grad_modes=(True,))


@pytest.mark.slow
def test_flex_attention_is_traced_into_the_compiled_draft_layer(monkeypatch):
    """The GPU's training path: flex attention inside the compiled draft layer is part of its graph (no graph break,
    one graph per step kind), and the unroll's outputs on a real packed micro-batch equal the eager layer's dense
    attention."""
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.target import run_target

    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    recipe = ["recipe=eagle3", "drafter.ttt_steps=3", "drafter.ttt_attention=flex"]
    target, flex, batches = real_micro_batches(recipe, 1, pack=True)
    dense = copy.deepcopy(flex)
    dense.config = type(flex.config)(**{**vars(flex.config), "ttt_attention": "dense"})
    compiled_layers.compile_drafter(flex)
    before, breaks = compiled_graphs(), graph_breaks()
    for batch in batches:
        with torch.no_grad():
            layers = run_target(target, batch["input_ids"], request=flex.request, **causal_lm_inputs(batch)).layers
            with compiled_layers.drafter_limits():
                got = flex.unroll(batch["input_ids"], layers, batch)
            expected = dense.unroll(batch["input_ids"], layers, batch)
        for step, (have, want) in enumerate(zip(got, expected)):
            torch.testing.assert_close(have, want, rtol=0, atol=2e-5 * float(want.abs().max()), msg=f"step {step}")
    assert graph_breaks() == breaks and compiled_graphs() - before <= 3  # one per step kind


@pytest.mark.slow
def test_a_drafter_graph_past_the_limit_is_an_error_not_an_uncompiled_block(monkeypatch):
    """With room for one graph, the second training-time-test step (whose keys differ from the first's) raises."""
    target, drafter, batches = real_micro_batches(["recipe=eagle3", "drafter.ttt_steps=2"], 1, pack=False)
    torch._dynamo.reset()  # the graphs other tests compiled count against the limit of the same function
    monkeypatch.setattr(compiled_layers, "BACKEND", "aot_eager")
    monkeypatch.setattr(compiled_layers, "DRAFTER_RECOMPILE_LIMIT", 1)
    inputs = with_target_outputs(drafter, target, batches)
    compiled_layers.compile_drafter(drafter)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        drafter_runs(drafter, inputs, grad=False)


@pytest.mark.slow
def test_a_run_with_the_target_and_the_draft_layer_compiled_learns_what_an_eager_run_learns(
    tmp_path, small_data, token_cache, monkeypatch, caplog
):
    """train.py, EAGLE-3 on the reference target, 3 steps with nothing compiled and with train.compile_target and
    train.compile_drafter: the same losses within float rounding, and the log says what was compiled."""
    from tests.helpers import REFERENCE_TARGET

    monkeypatch.setattr(compiled_layers, "BACKEND", "eager")  # dynamo's graphs as they are: the wiring is asked
    losses = {}
    for compiled in (False, True):
        output_dir = tmp_path / str(compiled)
        args = [
            "recipe=eagle3",
            f"target.name_or_path={REFERENCE_TARGET}",
            f"data.train=[{small_data['train']}]",
            f"data.cache_dir={token_cache}",
            "data.max_length=128",
            "drafter.ttt_steps=2",
            "train.micro_batch_size=2",
            "train.max_steps=3",
            "train.log_every=1",
            "eval.enabled=false",
            f"output_dir={output_dir}",
            f"train.compile_target={compiled}",
            f"train.compile_drafter={compiled}",
        ]
        with caplog.at_level(logging.INFO, logger="draftsmith"):
            train_in_process(args)
        losses[compiled] = [row["train/loss"] for _, row in sorted(read_log(output_dir).items()) if "train/loss" in row]
    assert len(losses[True]) == 3
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    assert caplog.text.count("the drafter's 1 blocks compiled (train.compile_drafter)") == 1
    assert caplog.text.count("decoder layers compiled (train.compile_target)") == 1


def test_compile_drafter_on_a_kind_without_blocks_is_refused_in_one_line():
    with pytest.raises(UserError) as info:
        load_recipe(["recipe=medusa", "train.compile_drafter=true"])
    message = str(info.value)
    assert "a medusa drafter offers none (the kinds that do: eagle3)" in message and "\n" not in message


def test_compile_drafter_under_zero3_is_refused_in_one_line():
    """DeepSpeed ZeRO-3 gathers a block's weights in hooks around it: never run compiled, refused before training."""
    with pytest.raises(UserError, match="train.compile_drafter=true under DeepSpeed ZeRO-3"):
        compiled_layers.compile_drafter(None, SimpleNamespace(zero_stage=3))
