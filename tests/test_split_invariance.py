"""Split invariance (issue #37): one optimizer step on the same 8 conversations gives the same
gradients, and the same weights after the step, whether they come as one micro-batch of 8, as 4
accumulated micro-batches of 2, packed or padded, or (slow tier) on 2 gloo ranks of 4 each — for every
registered kind. Each drafter returns its loss *sum* and its normaliser (heads/base.py, "The loss
contract"); the loop (trainer/loop.py) counts a step's normaliser on the host, agrees on it across
ranks, and scales each micro-batch's backward by `loss_scale`. The gradients are computed here with the
loop's own helpers (`next_step`, `agree`, `loss_scale`, `forward_backward`) under a real Accelerator.

A micro-batch *mean* (what drafters returned before) is not split-invariant: the last test shows the
same comparison failing for it, so the tolerance here would catch a regression."""

from __future__ import annotations

import functools
import gzip
import json
from dataclasses import replace

import pytest
import torch
from accelerate import Accelerator
from omegaconf import OmegaConf

from draftsmith.data_prep.collate import Collator, PackingCollator
from draftsmith.data_prep.template import render_with_masks
from draftsmith.heads import drafter_class, drafters
from draftsmith.heads.packing import causal_lm_inputs
from draftsmith.recipe import load_recipe
from draftsmith.resources import bundled
from draftsmith.target import load_target, load_tokenizer, run_target
from draftsmith.trainer.loop import agree, forward_backward, loss_scale, next_step
from tests.forked import forked_ranks
from tests.helpers import demo_recipe, fast_tier

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = sorted(drafters())
# Drafter keys of the runs compared. EAGLE's feature noise (its recipe's) and DFlash's anchor draw (fewer
# anchors than a conversation has candidates) stay random: each conversation's own draw, whatever the split
# (heads/packing.py conversation_rand). Medusa-2's heads ramp stays on, the step taken mid-ramp: it follows
# the optimizer step, not the micro-batches.
SETTINGS = {"eagle": {}, "dflash": {"anchors": 3, "block_size": 4}, "medusa2": {"heads_warmup": 4}}
OPTIMIZER_STEP = 2  # the step being trained, as the trainer sets it (Drafter.optimizer_step)
SPLITS = {  # name -> (micro-batch size, grad_accum, packed)
    "1x8": (8, 1, False),
    "2x4-accum": (2, 4, False),
    "1x8-packed": (8, 1, True),
    "2x4-accum-packed": (2, 4, True),
}
PACK = 96  # rows of up to 96 tokens: several conversations share one
# Relative to the norm (float32: the target and the drafter run on other batch shapes, so their sums
# round differently). A micro-batch mean differs by about 0.5 here (the last fast test).
TOLERANCE, PER_TENSOR = 1e-5, 1e-3
LR = 0.1


@functools.cache
def conversations() -> list[dict]:
    """The demo's first 8 training conversations, tokenized with the demo target's chat template and
    cut to windows of different lengths (16 to 51 tokens) around the start of the first assistant turn:
    rows of the tokenized data set, a few prompt tokens without loss, then assistant tokens with it."""
    tokenizer = load_tokenizer(str(bundled("demo/target")))
    rows = []
    with gzip.open(bundled("demo/data") / "train.jsonl.gz", "rt") as f:
        for line in f:
            record = json.loads(line)
            ids, mask = render_with_masks(tokenizer, record["messages"])
            if 1 not in mask:
                continue
            start = max(0, mask.index(1) - 6)  # a few prompt tokens, then the assistant's
            end = min(len(ids), start + 16 + 5 * len(rows))
            rows.append({"input_ids": ids[start:end], "loss_mask": mask[start:end], "domain": record["domain"]})
            if len(rows) == 8:
                return rows
    raise AssertionError("the demo data holds fewer than 8 conversations with assistant tokens")


def fresh(kind: str):
    """(its demo recipe's target, a fresh `kind` drafter for it fitted to the conversations, its initial
    weights): the same every call. A target per drafter: Medusa-2 puts its LoRA adapters into it."""
    recipe = load_recipe([f"recipe={demo_recipe(kind)}"])
    target = load_target(recipe.target.name_or_path)
    config = replace(OmegaConf.to_object(recipe.drafter), **SETTINGS.get(kind, {}))
    torch.manual_seed(0)
    drafter = drafter_class(kind).from_target(config, target, recipe.target.name_or_path)
    drafter.prepare(conversations())
    return target, drafter.train(), {k: v.clone() for k, v in drafter.state_dict().items()}


def step(drafter, target, rows: list[dict], micro: int, accum: int, packed: bool, accelerator=None) -> dict:
    """One optimizer step over `rows` the way trainer/loop.py takes it; returns the gradients and the
    weights after an SGD step, by parameter name (SGD: AdamW's first step, lr x g / |g| elementwise,
    would turn a rounding-level gradient element of either sign into a full step), and the names of
    the statistics the loss reported. Checks that the count the loss returns is the one counted on the host."""
    accelerator = accelerator or Accelerator(gradient_accumulation_steps=accum, cpu=True)
    collate = PackingCollator(0, PACK) if packed else Collator(0)
    stream = ((0, i, collate(rows[start : start + micro])) for i, start in enumerate(range(0, len(rows), micro)))
    module = accelerator.unwrap_model(drafter)
    module.optimizer_step = OPTIMIZER_STEP
    upcoming = next_step(stream, module, accum)
    scale = loss_scale(accelerator, agree(accelerator, upcoming=upcoming).loss_tokens)

    def features(batch):
        return run_target(target, batch["input_ids"], request=module.request, **causal_lm_inputs(batch))

    optimizer = torch.optim.SGD([p for p in drafter.parameters() if p.requires_grad], lr=LR)
    optimizer.zero_grad(set_to_none=True)
    counted, reported = 0, set()
    for _, _, batch in upcoming.batches:
        with accelerator.accumulate(drafter):
            _, _, (_, count, stats) = forward_backward(accelerator, drafter, batch, features, scale, False)
        counted += int(count)
        reported |= set(stats)
    assert counted == upcoming.loss_tokens > 0
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
    optimizer.step()
    weights = {name: p.detach().clone() for name, p in module.named_parameters() if name in grads}
    return {"grads": grads, "weights": weights, "reported": sorted(reported)}


def relative_errors(got: dict, expected: dict) -> dict[str, float]:
    """Per tensor ||got - expected|| / ||expected||, and under "all" the same over all tensors at once."""
    assert got.keys() == expected.keys() and expected
    errors = {
        name: float((got[name] - value).norm() / value.norm().clamp(min=1e-12)) for name, value in expected.items()
    }
    difference = torch.cat([(got[name] - value).flatten() for name, value in expected.items()])
    errors["all"] = float(difference.norm() / torch.cat([value.flatten() for value in expected.values()]).norm())
    return errors


def assert_same(result: dict, reference: dict, what) -> None:
    """Gradients and updated weights equal to float32 rounding: the step's whole gradient to
    `TOLERANCE`, each tensor to `PER_TENSOR` (a small gradient summed from many cancelling token terms
    has a larger relative rounding error)."""
    for kind in ("grads", "weights"):
        errors = relative_errors(result[kind], reference[kind])
        worst = {name: error for name, error in errors.items() if error >= PER_TENSOR}
        assert errors["all"] < TOLERANCE and not worst, (what, kind, errors["all"], worst)


# the fast tier: a training-time-test unroll, parallel heads and a target's own layer; the other kinds in the slow tier
@pytest.mark.parametrize("kind", fast_tier(KINDS, lambda kind: kind in ("eagle3", "medusa", "mtp")))
def test_one_step_is_the_same_however_the_step_is_split(kind):
    rows = conversations()
    target, drafter, start = fresh(kind)
    results = {}
    for name, (micro, accum, packed) in SPLITS.items():
        drafter.load_state_dict(start)
        results[name] = step(drafter, target, rows, micro, accum, packed)
    reference = results["1x8"]
    assert any(g.abs().sum() > 0 for g in reference["grads"].values())
    # what the trainer reads by the kind's declarations: its depth-1 top-1 and its FLOP profile's parameters
    depth_1 = drafter.DEPTH_TOP1.format(depth=1)
    assert depth_1 in reference["reported"], f"its loss reports no {depth_1} (DEPTH_TOP1): {reference['reported']}"
    once = type(drafter).flop_profile(drafter.config).once
    assert all(any(name.startswith(prefix) for name in reference["grads"]) for prefix in once)
    for name, result in results.items():
        assert_same(result, reference, name)


def test_a_micro_batch_mean_would_not_be_split_invariant():
    """The comparison above is sharp enough to see the old semantics (a micro-batch mean, averaged
    over accumulation steps) differ for Medusa."""
    rows = conversations()
    grads = []
    for micro, accum in ((8, 1), (2, 4)):
        target, drafter, _ = fresh("medusa")
        accelerator = Accelerator(gradient_accumulation_steps=accum, cpu=True)
        for start in range(0, len(rows), micro):
            batch = Collator(0)(rows[start : start + micro])
            with accelerator.accumulate(drafter):
                out = run_target(target, batch["input_ids"], batch["attention_mask"], drafter.request)
                loss, count, _ = drafter(batch, out)
                accelerator.backward(loss / count)
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None})
    worst = max(relative_errors(grads[1], grads[0]).values())
    print(f"micro-batch mean: 1x8 vs 2x4 gradients differ by up to {worst:.3g} relative")
    assert worst > 100 * TOLERANCE


# -- 2 ranks (gloo) ------------------------------------------------------------------------------------
GLOO_KINDS = ("medusa", "eagle3")


def _rank(out: str) -> int:
    """One rank of two (tests/forked.py's `forked_ranks`: the launcher's variables, one thread, accelerate unset)."""
    accelerator = Accelerator(gradient_accumulation_steps=1, cpu=True)
    assert accelerator.num_processes == 2
    rank, world = accelerator.process_index, accelerator.num_processes
    rows = conversations()[rank::world]  # every world-th conversation, as trainer/loop.py deals them
    results = {}
    for kind in GLOO_KINDS:
        target, drafter, start = fresh(kind)
        for packed in (False, True):
            drafter.load_state_dict(start)
            wrapped = accelerator.prepare(drafter)
            results[f"{kind}/{packed}"] = step(wrapped, target, rows, 4, 1, packed, accelerator)
    if rank == 0:
        torch.save(results, out)
    accelerator.wait_for_everyone()
    torch.distributed.destroy_process_group()
    return 0


@pytest.mark.slow
def test_two_gloo_ranks_of_four_give_the_one_rank_step(tmp_path):
    out = tmp_path / "ranks.pt"
    # forked from this process, whose imports they share: spawned, each rank imported torch, transformers, accelerate
    # and this module again (about 6 s of CPU a rank); a rank still running after 180 s is killed
    launched = forked_ranks(functools.partial(_rank, str(out)), world=2)
    assert [rank.wait() for rank in launched] == [0, 0], [rank.output()[1][-2000:] for rank in launched]
    ranks = torch.load(out)
    rows = conversations()
    for kind in GLOO_KINDS:
        target, drafter, _ = fresh(kind)
        reference = step(drafter, target, rows, 8, 1, False)
        for packed in (False, True):
            assert_same(ranks[f"{kind}/{packed}"], reference, (kind, packed))


def test_conversations_differ_in_length_and_pack_into_shared_rows():
    rows = conversations()
    lengths = [len(row["input_ids"]) for row in rows]
    assert len(set(lengths)) > 4 and max(lengths) <= PACK
    packed = PackingCollator(0, PACK)(rows)
    assert packed["input_ids"].shape[0] < len(rows)
