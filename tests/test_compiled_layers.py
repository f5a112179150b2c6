"""train.compile_target: the frozen target's decoder layers under torch.compile (draftsmith/compiled_layers.py).

On real micro-batches whose rows and widths vary the compiled layers give the eager features, compile a bounded
number of graphs that the same shapes never add to, and a graph past the limit is an error, not torch's eager
fallback (a training run with it: tests/test_compiled_drafter.py)."""

from __future__ import annotations

import pytest
import torch

from draftsmith.recipe import load_recipe
from tests.test_ttt_flex import compiled_graphs, real_micro_batches


def features(target, drafter, batch) -> list[torch.Tensor]:
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.target import run_target

    with torch.no_grad():
        out = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
    return [out.final, out.logits, *(out.layers[layer] for layer in sorted(out.layers))]


@pytest.mark.slow
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_compiled_layers_equal_eager_on_real_batches_in_a_bounded_number_of_graphs(pack):
    """Five or six of the demo recipe's first twelve micro-batches, each of another shape (padded: 4 rows of each
    batch's longest conversation; packed: 2-4 rows of up to 384 positions): every feature the drafter reads equals
    the eager target's; the graphs stay within a few per layer function however many shapes come (not one set per
    shape), the same batches run again compile nothing, and no call runs uncompiled (past the limit it would raise).
    The GPU tier runs the same on CUDA (tests/test_gpu.py)."""
    assert_compiled_layers_equal_eager(pack, torch.device("cpu"))


def assert_compiled_layers_equal_eager(pack: bool, device: torch.device) -> None:
    from draftsmith import compiled_layers

    target, drafter, batches = real_micro_batches(["recipe=eagle3"], 12, pack)
    batches = [batches[i] for i in ((0, 1, 2, 7, 8, 11) if pack else (0, 1, 2, 7, 11))]  # a shape each
    target = target.to(device)
    batches = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()} for batch in batches]
    eager = [features(target, drafter, batch) for batch in batches]
    before = compiled_graphs()
    assert compiled_layers.compile_layers(target) == target.config.num_hidden_layers
    first = None
    for batch, expected in zip(batches, eager):
        with compiled_layers.limits():
            got = features(target, drafter, batch)
        first = first or compiled_graphs() - before  # the first batch's graphs: one shape
        for name, want, have in zip(["final", "logits", "layers"], expected, got):
            # float32 rounding of fused operations, against the tensor's largest value
            atol = 4e-6 * float(want.abs().max())
            torch.testing.assert_close(have, want, rtol=0, atol=atol, msg=f"{name}, {batch['sample']}")
    graphs = compiled_graphs() - before
    shapes = {tuple(batch["input_ids"].shape) for batch in batches}
    assert len(shapes) >= 5 and first >= 1
    assert graphs <= 4 * first, (graphs, first, sorted(shapes))  # static, dynamic width, rows, one row
    with compiled_layers.limits():
        for batch in batches:
            features(target, drafter, batch)
    assert compiled_graphs() - before == graphs


@pytest.mark.slow
def test_a_graph_past_the_limit_is_an_error_not_an_uncompiled_layer(monkeypatch):
    from draftsmith import compiled_layers

    target, drafter, batches = real_micro_batches(["recipe=eagle3"], 2, pack=False)
    assert batches[0]["input_ids"].shape != batches[1]["input_ids"].shape
    torch._dynamo.reset()  # the graphs other tests compiled count against the limit of the same functions
    monkeypatch.setattr(compiled_layers, "RECOMPILE_LIMIT", 1)
    compiled_layers.compile_layers(target)
    with compiled_layers.limits():
        features(target, drafter, batches[0])
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            features(target, drafter, batches[1])


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("data.features=/nonexistent", "train.compile_target=true compiles the target's layers, which a run on"),
        ("target.shard=fsdp", "train.compile_target=true with target.shard=fsdp: compiling a sharded target's"),
    ],
    ids=["captured-features", "sharded-target"],
)
def test_compile_target_where_it_would_not_run_as_asked_is_refused_in_one_line(setting, fragment):
    """A run on data.features never runs the target (the setting would be ignored); a sharded target's layers
    compiled were never run."""
    from draftsmith.errors import UserError

    with pytest.raises(UserError) as info:
        load_recipe(["recipe=eagle3", setting, "train.compile_target=true"])
    assert fragment in str(info.value) and "\n" not in str(info.value)
