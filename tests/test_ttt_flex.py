"""Compiled flex attention in EAGLE-3's training-time test, on real micro-batches whose rows and widths vary:
a bounded number of compiled graphs, never torch's unfused fallback, and the dense reference's outputs.

On a CPU inductor compiles flex attention's forward only, so this runs the unroll under no_grad; the GPU
tier (tests/test_gpu.py) runs the same batches with the backward, the loss and the gradients."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.slow

MICRO_BATCHES = 12  # of each collator: padded rows of the longest conversation, packed rows of varying count
ROWS = 4  # a micro-batch's rows: the widths vary as much as at 8, at half the unroll's cost
# The padded batches through EAGLE-3 with full attention, the packed ones through P-EAGLE with a sliding window
# (segments per document, a window that moves with the step, masked queries).
CASES = {
    False: ["drafter.ttt_steps=4"],
    True: [
        "drafter.ttt_steps=4",
        "drafter.sliding_window=96",
        "drafter.parallel_drafting=true",
        "drafter.mask_token_id=3",
        "drafter.fc_norm=true",
        "eval.tree=0",
    ],
}


def real_micro_batches(recipe: list[str], count: int, pack: bool):
    """The first `count` micro-batches the trainer draws from the demo recipe's data (its collators),
    with the target, the tokenizer and the recipe's drafter."""
    from omegaconf import OmegaConf

    from draftsmith.data_prep.collate import Collator, PackingCollator
    from draftsmith.data_prep.dataset import load_tokenized
    from draftsmith.heads import drafter_class
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target, load_tokenizer
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import micro_batches

    cfg = load_recipe([*recipe, f"train.micro_batch_size={ROWS}"])
    tokenizer = load_tokenizer(cfg.target)
    data = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
    target = load_target(cfg.target, "cpu")
    collate = PackingCollator(tokenizer.pad_token_id, cfg.data.max_length) if pack else Collator(tokenizer.pad_token_id)
    stream = micro_batches(data, collate, OmegaConf.create({"train": dict(cfg.train)}), 1, 0, TrainerState())
    torch.manual_seed(0)
    # the recipe's drafter, not the trainer's build of it, which refuses flex off CUDA: these tests run its forward
    settings = OmegaConf.to_object(cfg.drafter)
    drafter = drafter_class(cfg.drafter.type).from_target(settings, target, str(cfg.target.name_or_path))
    drafter.prepare(data)
    return target, drafter, [next(stream)[2] for _ in range(count)]


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_flex_unroll_compiles_once_per_bucket_and_equals_dense_on_real_batches():
    """Dozens of the demo recipe's micro-batches, padded (4 rows, the longest row's width) and packed
    (1-4 rows of up to 384 positions), through the unroll with drafter.ttt_attention=flex: the compiled
    graphs are at most one per length bucket and case (powers of two from 128 to 4 x 384 -> 2048), the
    same widths never compile again, no call runs flex uncompiled, and every step equals the dense path."""
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.heads.ttt_attention import flat_length
    from draftsmith.target import run_target

    buckets, shapes = set(), set()
    before = compiled_graphs()
    for pack, settings in CASES.items():
        target, drafter, batches = real_micro_batches(["recipe=eagle3", *settings], MICRO_BATCHES, pack)
        for batch in batches:
            width = batch["input_ids"].shape[1] - 2
            buckets.add((pack, flat_length(batch["input_ids"].shape[0] * width)))
            shapes.add(tuple(batch["input_ids"].shape))
            with torch.no_grad():
                layers = run_target(target, batch["input_ids"], request=drafter.request, **causal_lm_inputs(batch))
                drafter.config.ttt_attention = "dense"
                dense = drafter.unroll(batch["input_ids"], layers.layers, batch)
                drafter.config.ttt_attention = "flex"
                with warnings.catch_warnings():  # flex run uncompiled (torch's fallback) warns this
                    warnings.filterwarnings("error", message="flex_attention called without torch.compile")
                    flex = drafter.unroll(batch["input_ids"], layers.layers, batch)
            for step, (expected, got) in enumerate(zip(dense, flex)):
                torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=f"step {step}, {batch['sample']}")
    graphs = compiled_graphs() - before
    assert len(shapes) > 2 * len(buckets)  # the batches really vary more than the buckets
    assert 1 <= graphs <= len(buckets), (graphs, sorted(buckets), len(shapes))
