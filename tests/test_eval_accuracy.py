"""eval/accuracy.py `metric_means`: the trained and the untrained drafter are measured on one target forward a
batch where they ask it for the same features, into the same means as measuring each on its own pass."""

from __future__ import annotations

import sys

import pytest
import torch

from draftsmith.data_prep.collate import Collator
from draftsmith.eval import accuracy
from draftsmith.eval.accuracy import metric_means
from tests.test_split_invariance import conversations, fresh

pytestmark = pytest.mark.usefixtures("one_thread")


def target_forwards(target) -> list:
    calls = []
    target.register_forward_hook(lambda module, args, output: calls.append(1))
    return calls


@pytest.mark.parametrize("kind", ["medusa", "dflash"])
def test_both_drafters_share_each_batchs_target_forward_into_the_same_means(kind):
    """DFlash: each drafter's own host fields and anchor draws on the shared forward."""
    target, trained, _ = fresh(kind)
    untrained = fresh(kind)[1]
    with torch.no_grad():
        for parameter in trained.parameters():
            if parameter.requires_grad:
                parameter.add_(0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    rows, collate = conversations(), Collator(0)
    forwards = target_forwards(target)
    shared = metric_means([trained, untrained], target, rows, collate, 3)
    assert len(forwards) == 3  # 8 rows, 3 a batch: one forward each
    alone = [metric_means([drafter], target, rows, collate, 3)[0] for drafter in (trained, untrained)]
    assert shared == alone and shared[0] != shared[1]


def test_drafters_asking_for_other_features_get_a_forward_each():
    target, medusa, _ = fresh("medusa")
    eagle3 = fresh("eagle3")[1]  # on its own copy of the same demo target
    assert eagle3.request != medusa.request
    forwards = target_forwards(target)
    metric_means([medusa, eagle3], target, conversations(), Collator(0), 8)
    assert len(forwards) == 2


def test_each_batch_moves_to_the_device_once_for_both_drafters(monkeypatch):
    """Each drafter moved the whole batch again (twice a batch for the trained and the untrained drafter); now the
    batch moves once and each drafter adds its own host fields (DFlash's counted blocks)."""
    target, trained, _ = fresh("dflash")
    untrained = fresh("dflash")[1]
    batches, moves, real_to = [], [], torch.Tensor.to

    def collate(rows):
        batches.append(Collator(0)(rows))
        return batches[-1]

    def counted_to(tensor, *args, **kwargs):  # the moves metric_means makes (on the CPU, .to returns the same tensor)
        if sys._getframe(1).f_code.co_filename == accuracy.__file__:
            moves.extend(1 for batch in batches for value in batch.values() if value is tensor)
        return real_to(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    metric_means([trained, untrained], target, conversations(), collate, 3)
    tensors = [value for batch in batches for value in batch.values() if torch.is_tensor(value)]
    assert len(batches) == 3 and len(moves) == len(tensors)
