"""The learning-rate schedule (trainer/setup.py `optimization`): linear warm-up, then cosine to zero, written in
draftsmith rather than imported from transformers.optimization, whose import pulled in peft (seconds of every
start). It sets every step's rate as transformers' get_cosine_schedule_with_warmup did, and a resumed schedule
(its state saved as accelerate saves it, by this code or by the transformers one of earlier checkpoints)
continues exactly. The rates a real run logs across a resume: tests/test_reliability.py."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from transformers import get_cosine_schedule_with_warmup

from draftsmith.trainer.setup import optimization

ACCELERATOR = SimpleNamespace(num_processes=1, state=SimpleNamespace(deepspeed_plugin=None))


class TwoGroups(torch.nn.Module):
    """A drafter's parameter groups, the second at half the rate (as a drafter's scaled group)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

    def param_groups(self):
        return [(list(self.body.parameters()), 1.0), (list(self.head.parameters()), 0.5)]


def schedule(warmup_steps: int, max_steps: int):
    """`optimization`'s optimizer and schedule for a run of `max_steps` steps."""
    train = dict(lr=2e-3, optimizer="adamw", adam_betas=[0.9, 0.95], weight_decay=0.0, micro_batch_size=1)
    cfg = OmegaConf.create({"train": {**train, "grad_accum": 1, "max_steps": max_steps, "epochs": 1,
                                      "warmup_steps": warmup_steps}})  # fmt: skip
    optimizer, scheduler, steps = optimization(cfg, ACCELERATOR, TwoGroups(), conversations=max_steps)
    assert steps == max_steps
    return optimizer, scheduler


def rates(optimizer, scheduler, steps: int) -> list[list[float]]:
    """Each step's rate of every group, read as the loop reads it (before the schedule steps)."""
    out = []
    for _ in range(steps):
        out.append([group["lr"] for group in optimizer.param_groups])
        assert out[-1][0] == scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup_steps, max_steps", [(0, 7), (3, 12), (20, 200), (5, 5), (9, 4), (1, 1)])
def test_every_steps_rate_is_transformers_cosine_with_warmup(warmup_steps, max_steps):
    optimizer, scheduler = schedule(warmup_steps, max_steps)
    theirs = torch.optim.AdamW([{"params": [torch.zeros(1)], "lr": 2e-3}, {"params": [torch.zeros(1)], "lr": 1e-3}])
    reference = get_cosine_schedule_with_warmup(theirs, warmup_steps, max_steps)
    ours = rates(optimizer, scheduler, max_steps + 2)  # past the end too: 0, as theirs
    assert ours == rates(theirs, reference, max_steps + 2)
    assert ours[0] == [0.0, 0.0] if warmup_steps else ours[0] == [2e-3, 1e-3]


def saved(scheduler) -> dict:
    """The scheduler's state as a checkpoint holds it (accelerate: torch.save, read back with torch.load)."""
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("warmup_steps, max_steps, said", [(20, 5, True), (5, 5, True), (4, 5, False)])
def test_a_warm_up_the_run_never_finishes_is_said(warmup_steps, max_steps, said, caplog):
    """A short run of a recipe's 20-step warm-up (train.max_steps=5) trained at 20% of train.lr at most, unsaid."""
    with caplog.at_level("WARNING", logger="draftsmith.train"):
        schedule(warmup_steps, max_steps)
    lines = [record.getMessage() for record in caplog.records]
    assert bool(lines) == said
    if said:
        assert lines[0].startswith(f"train.warmup_steps={warmup_steps} is not shorter than the run's {max_steps} steps")


def test_a_resumed_schedule_continues_exactly_also_from_a_transformers_schedules_checkpoint():
    optimizer, scheduler = schedule(4, 15)
    rates(optimizer, scheduler, 6)
    state, optimizer_state = saved(scheduler), optimizer.state_dict()
    uninterrupted = rates(optimizer, scheduler, 9)

    resumed_optimizer, resumed = schedule(4, 15)  # a fresh run's, then the checkpoint's state (as load_state)
    resumed_optimizer.load_state_dict(optimizer_state)
    resumed.load_state_dict(state)
    assert rates(resumed_optimizer, resumed, 9) == uninterrupted

    theirs = torch.optim.AdamW([{"params": [torch.zeros(1)], "lr": 2e-3}, {"params": [torch.zeros(1)], "lr": 1e-3}])
    reference = get_cosine_schedule_with_warmup(theirs, 4, 15)
    rates(theirs, reference, 6)
    assert saved(reference).keys() == state.keys()  # the same state in a checkpoint, either way
    resumed_optimizer, resumed = schedule(4, 15)
    resumed_optimizer.load_state_dict(optimizer_state)
    resumed.load_state_dict(saved(reference))
    assert rates(resumed_optimizer, resumed, 9) == uninterrupted


@pytest.mark.slow
def test_a_training_start_imports_neither_peft_nor_transformers_optimization():
    """transformers.optimization imports transformers.trainer_utils, and that peft: about 5 of a 9 s start."""
    heavy = ("peft", "transformers.optimization", "transformers.trainer_utils")
    code = f"import sys, draftsmith.trainer.loop; print([m for m in {heavy} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr[-2000:]
