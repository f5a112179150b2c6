"""trainer/loop.py's train_step on its own: what a step holds in memory between its micro-batches."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState

from draftsmith.trainer.checkpoint import TrainerState
from draftsmith.trainer.loop import Agreed, StepData, train_step


class Features:
    """A TargetOutput's stand-in: what a micro-batch's target forward returns (a draft model's or Medusa-2's hold
    the target's [B, T, V] logits)."""


class Drafter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, batch, target_out):
        return self.weight * 2, torch.tensor(1), {}


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """This module's Accelerator (3 micro-batches a step) neither meets nor leaves another's shared state."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_micro_batchs_target_features_are_freed_before_the_next_ones_target_forward():
    """The loop's variables held micro-batch k's features while micro-batch k+1's target ran: one [B, T, V] logits
    more at the peak under gradient accumulation, which is when memory is short (4.2 GB at 8 rows of 2,048 tokens
    and 128k tokens in bfloat16)."""
    accelerator = Accelerator(gradient_accumulation_steps=3, cpu=True)
    drafter = Drafter()
    alive_at_each_forward, features = [], []

    def target_features(batch):
        alive_at_each_forward.append(sum(feature() is not None for feature in features))
        made = Features()
        features.append(weakref.ref(made))
        return made

    train = SimpleNamespace(compile_vocab_loss=False, compile_drafter=False, max_grad_norm=1.0, grad_accum=3)
    run = SimpleNamespace(
        cfg=SimpleNamespace(train=train),
        accelerator=accelerator,
        drafter=drafter,
        module=drafter,
        state=TrainerState(),
        target_features=target_features,
        max_steps=1,
        optimizer=torch.optim.SGD(drafter.parameters(), lr=0.1),
        scheduler=SimpleNamespace(get_last_lr=lambda: [0.1], step=lambda: None),
        gradients_checked=False,
    )
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long)}
    step = StepData([(0, index, batch) for index in range(3)], 3, 12, 12, 3, 0)
    train_step(run, step, Agreed(False, False, 3, 12), iter(()), SimpleNamespace(requested=False))
    assert alive_at_each_forward == [0, 0, 0] and run.state.step == 1
