"""train.optimizer=muon (trainer/optim.py): Muon takes the hidden layers' weight matrices of every
kind, AdamW the rest (norms, biases, embeddings, output heads), both stepping under one learning-rate
schedule; a restored state continues exactly. DeepSpeed is refused in one line. A killed Muon run
resumes into the same weights: tests/test_faults.py. train.optimizer=adamw runs torch's fused AdamW on a CPU
too, stepping as the unfused one does to float32 rounding."""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import get_cosine_schedule_with_warmup

from draftsmith.errors import UserError
from draftsmith.heads import drafter_class, drafters
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from draftsmith.trainer.optim import MuonWithAdamW, build_optimizer, is_hidden_matrix
from tests.helpers import KINDS

MUON = SimpleNamespace(optimizer="muon", lr=1e-2, adam_betas=[0.9, 0.95], weight_decay=0.01)
ADAMW = SimpleNamespace(optimizer="adamw", lr=1e-2, adam_betas=[0.9, 0.95], weight_decay=0.01)


@functools.cache
def target_named(name: str):
    return load_target(name)


def drafter_for(kind: str):
    """A fresh `kind` drafter for its demo recipe's target (loaded once per target)."""
    recipe = load_recipe([f"recipe={KINDS[kind]}"])
    name = recipe.target.name_or_path
    return drafter_class(kind).from_target(OmegaConf.to_object(recipe.drafter), target_named(name), name)


@pytest.mark.parametrize("kind", sorted(drafters()))
def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(kind):
    """Every trainable parameter once: Muon the hidden layers' weight matrices, AdamW the rest (the kind's embeddings
    and output heads by Drafter.NOT_HIDDEN); a kind with no hidden matrix is refused Muon in one line."""
    drafter = drafter_for(kind)
    if not any(is_hidden_matrix(n, p, drafter.NOT_HIDDEN) for n, p in drafter.named_parameters() if p.requires_grad):
        with pytest.raises(UserError, match="this drafter has no hidden weight matrix for Muon"):
            build_optimizer(MUON, drafter, deepspeed=False)
        return
    optimizer = build_optimizer(MUON, drafter, deepspeed=False)
    muon = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    # an embedding or an output head over the vocabulary is AdamW's, whatever the kind names it (Drafter.NOT_HIDDEN)
    vocabulary = target_named(load_recipe([f"recipe={KINDS[kind]}"]).target.name_or_path).config.vocab_size
    over_vocabulary = [n for n, p in drafter.named_parameters() if id(p) in muon and vocabulary in p.shape]
    assert not over_vocabulary, f"{over_vocabulary}: declare them in {type(drafter).__name__}.NOT_HIDDEN"
    adamw = {id(p) for group in optimizer.adamw_groups() for p in group["params"]}
    trainable = {id(p): name for name, p in drafter.named_parameters() if p.requires_grad}
    assert muon | adamw == set(trainable) and not muon & adamw  # every trainable parameter, once
    assert muon and all(dict(drafter.named_parameters())[trainable[i]].ndim == 2 for i in muon)
    for index in adamw:
        name = trainable[index]
        assert not is_hidden_matrix(name, dict(drafter.named_parameters())[name], drafter.NOT_HIDDEN), name


def test_both_follow_the_schedule_and_a_restored_state_continues_exactly():
    def steps(drafter, optimizer, count):
        for _ in range(count):
            loss = sum((p * p).sum() for p in drafter.parameters() if p.requires_grad)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

    torch.manual_seed(0)
    drafter = drafter_for("medusa")
    start = {k: v.clone() for k, v in drafter.state_dict().items()}
    optimizer = build_optimizer(MUON, drafter, deepspeed=False)
    schedule = get_cosine_schedule_with_warmup(optimizer, 2, 10)
    optimizer.load_state_dict(optimizer.state_dict())  # as accelerate's prepare does, after the schedule
    steps(drafter, optimizer, 1)  # Medusa's small matrices: Muon's bfloat16 Newton-Schulz is slow on a CPU
    schedule.step()
    assert (
        {group["lr"] for group in optimizer.muon.param_groups + optimizer.adamw.param_groups}
        == {schedule.get_last_lr()[0]}
        != {0.0}
    )
    # (state_dict holds the live state tensors: a checkpoint is a copy of them)
    saved, middle = copy.deepcopy(optimizer.state_dict()), {k: v.clone() for k, v in drafter.state_dict().items()}
    steps(drafter, optimizer, 1)
    uninterrupted = drafter.state_dict()

    restored_drafter = drafter_for("medusa")
    restored_drafter.load_state_dict(middle)
    restored = build_optimizer(MUON, restored_drafter, deepspeed=False)
    restored.load_state_dict(saved)
    steps(restored_drafter, restored, 1)
    assert all(torch.equal(restored_drafter.state_dict()[k], uninterrupted[k]) for k in uninterrupted)
    assert any(not torch.equal(start[k], uninterrupted[k]) for k in start)
    assert isinstance(optimizer, MuonWithAdamW)


def test_muon_under_deepspeed_is_refused_in_one_line():
    with pytest.raises(UserError, match="DeepSpeed builds its own optimizer") as info:
        build_optimizer(MUON, drafter_for("medusa"), deepspeed=True)
    assert "\n" not in str(info.value)


def test_adamw_is_fused_on_a_cpu_and_steps_as_the_unfused_one_does():
    """A CPU run's AdamW is torch's fused kernel (several times faster on Medusa's few large tensors): over a few
    steps its weights and moments stay the unfused AdamW's to float32 rounding; a restored state continues
    exactly."""
    torch.manual_seed(0)
    drafter = drafter_for("medusa")
    unfused_drafter = copy.deepcopy(drafter)
    fused = build_optimizer(ADAMW, drafter, deepspeed=False)
    groups = [{"params": params, "lr": ADAMW.lr * scale} for params, scale in unfused_drafter.param_groups()]
    unfused = torch.optim.AdamW(groups, lr=ADAMW.lr, betas=ADAMW.adam_betas, weight_decay=ADAMW.weight_decay)
    assert all(group["fused"] for group in fused.param_groups) and not unfused.param_groups[0]["fused"]

    def steps(module, optimizer, count, seed):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(count):
            for parameter in module.parameters():
                parameter.grad = torch.randn(parameter.shape, generator=generator) if parameter.requires_grad else None
            optimizer.step()

    steps(drafter, fused, 3, seed=1)
    steps(unfused_drafter, unfused, 3, seed=1)
    for (name, got), expected in zip(drafter.named_parameters(), unfused_drafter.parameters()):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=name)
    for got, expected in zip(fused.state.values(), unfused.state.values()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-9)

    saved, middle = copy.deepcopy(fused.state_dict()), copy.deepcopy(drafter.state_dict())
    steps(drafter, fused, 2, seed=2)
    restored_drafter = drafter_for("medusa")
    restored_drafter.load_state_dict(middle)
    restored = build_optimizer(ADAMW, restored_drafter, deepspeed=False)
    restored.load_state_dict(saved)
    steps(restored_drafter, restored, 2, seed=2)
    assert all(torch.equal(restored_drafter.state_dict()[k], v) for k, v in drafter.state_dict().items())


class TwoMatrices(torch.nn.Module):
    """A kind's shape at its least: a hidden matrix and an output head named as the kind likes (`head`), declared by
    NOT_HIDDEN; `with_head=False`: the hidden matrix alone."""

    NOT_HIDDEN = ("head",)

    def __init__(self, with_head: bool = True):
        super().__init__()
        self.block = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.Linear(8, 16, bias=False) if with_head else None

    def param_groups(self):
        return [([p for p in self.parameters()], 1.0)]


def test_a_kind_names_its_output_head_as_it_likes_and_a_drafter_of_hidden_matrices_alone_steps():
    """Muon took a head named `head` (the name match knew `lm_head` only) and left AdamW no parameter: torch's
    `ValueError: optimizer got an empty parameter list`, exit 70. The kind declares its heads (Drafter.NOT_HIDDEN);
    and a drafter whose every parameter is a hidden matrix steps with Muon alone."""
    drafter = TwoMatrices()
    optimizer = build_optimizer(MUON, drafter, deepspeed=False)
    assert [p for group in optimizer.muon.param_groups for p in group["params"]] == [drafter.block.weight]
    assert [p for group in optimizer.adamw_groups() for p in group["params"]] == [drafter.head.weight]
    alone = TwoMatrices(with_head=False)
    optimizer = build_optimizer(MUON, alone, deepspeed=False)
    assert optimizer.adamw is None and len(optimizer.param_groups) == 1
    before = alone.block.weight.detach().clone()
    alone.block.weight.sum().backward()
    optimizer.step()
    assert not torch.equal(before, alone.block.weight)
    again = build_optimizer(MUON, TwoMatrices(with_head=False), deepspeed=False)
    again.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert again.state_dict()["adamw"] is None
