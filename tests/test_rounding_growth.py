"""benchmarks/rounding_growth.py measures how far one bfloat16 rounding of a target's input travels to its routers and
logits (the measure behind docs/targets-matrix.md's "Why the seeded Qwen3.5-MoE parted"): it finds a mixture-of-experts
target's routers and sees one rounding at the input arrive at the first router as about one rounding, and move the
logits."""

from __future__ import annotations

import pytest

from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from tests.helpers import benchmark_module

GROWTH = benchmark_module("rounding_growth")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory):
    """A seeded tiny Qwen3.5-MoE, untrained (the target whose bfloat16 outputs parted beyond near ties in vLLM)."""
    return write_random_target("qwen3_5_moe_text", tmp_path_factory.mktemp("moe"), seed_from=demo_tokenizer_dir())


def test_one_rounding_reaches_the_first_router_as_about_one(moe_target):
    moved = GROWTH.growth(str(moe_target), 1.0, 1)
    assert list(moved["routers"]) == [f"model.layers.{layer}.mlp.gate" for layer in range(4)]
    first = moved["routers"]["model.layers.0.mlp.gate"]
    assert 0.25 <= first["median"] <= 4
    assert moved["logits"]["median"] > 0
