"""Medusa-1's heads as `from_target` starts them: each output layer a copy of the target's lm_head
(`drafter.init_lm_heads_from_target`, the default) or a fresh draw; the module builds them zeroed (not drawn), which
a load or `from_target` fills."""

from __future__ import annotations

import torch

from draftsmith.heads import drafter_class
from draftsmith.target import TargetShape
from tests.helpers import tiny_llama

MEDUSA = drafter_class("medusa")


def test_heads_start_as_the_targets_lm_head_or_a_fresh_draw_of_linears_init():
    built = MEDUSA(MEDUSA.Config(num_heads=2), TargetShape("tiny", "llama", 32, 512, 1))
    assert all(not head.weight.any() for head in built.lm_heads)  # defined memory, whatever fills it next
    target = tiny_llama(vocab=512, hidden=32, layers=1, seed=5)
    lm_head = target.get_output_embeddings().weight
    copied = MEDUSA.from_target(MEDUSA.Config(num_heads=3), target, "tiny")
    assert all(torch.equal(head.weight, lm_head) for head in copied.lm_heads)
    drawn = MEDUSA.from_target(MEDUSA.Config(num_heads=3, init_lm_heads_from_target=False), target, "tiny")
    bound = 32**-0.5  # nn.Linear's init: U(-1/sqrt(in), 1/sqrt(in)), std bound/sqrt(3)
    for j, head in enumerate(drawn.lm_heads):
        assert head.weight.abs().max() <= bound and abs(head.weight.std() - bound / 3**0.5) < 0.01
        assert not torch.equal(head.weight, drawn.lm_heads[j - 1].weight)  # each its own draw
