"""What the eval loop needs of a target (eval/target_checks.py), on tiny random targets: a target that biases attention
by a key's index (ALiBi: MPT, Bloom) is refused trees and batches in one line, where its tree parted from plain
decoding (MPT: the run exited 0 with `lossless: false` rows) or its forward raised (Bloom: exit 70), and a training
run that would end in such an eval stage is refused before it trains."""

from __future__ import annotations

import re

import pytest
import torch

from draftsmith.errors import UserError
from draftsmith.eval.target_checks import check_explicit_masks, check_target
from draftsmith.families import DRAFT_LAYER_FAMILIES
from draftsmith.random_target import build_model, write_random_target
from draftsmith.target import run_target
from draftsmith.tiny_config import build_config
from tests.helpers import VOCAB, assert_one_line_error, run_entry_in_process


@pytest.mark.parametrize(
    "family, said",
    [
        ("mpt", "a tree's second sibling differs from its logits alone by"),
        ("bloom", "its forward refuses them (ValueError: too many values to unpack"),
    ],
)
def test_a_target_biasing_attention_by_key_index_is_refused_trees_and_batches(family, said):
    model = build_model(build_config(family, VOCAB), std=0.2)
    with pytest.raises(UserError, match=rf"does not compute a token by the explicit mask .*\({re.escape(said)}"):
        check_explicit_masks(model)
    check_target(model)  # a single chain gets no explicit mask: decoded as plain decoding is
    with pytest.raises(UserError, match="set eval.tree=0 eval.batch_size=1 eval.batch_sizes=\\[\\]$"):
        check_target(model, batch=True)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "deepseek_v3"])
def test_targets_that_compute_by_positions_and_masks_pass(family):
    """Rotary, learned absolute positions, sliding windows, latent attention with routed experts."""
    check_explicit_masks(build_model(build_config(family, VOCAB), std=0.2))


def test_a_run_whose_eval_stage_could_not_decode_trees_is_refused_before_it_trains(tmp_path, capsys):
    target = write_random_target("mpt", tmp_path / "target")
    args = ["train.py", "recipe=medusa", f"target.name_or_path={target}", f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1", "eval.tree=6"]  # fmt: skip
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, "MptForCausalLM does not compute a token by the explicit mask")
    assert not (tmp_path / "run" / "final").exists() and "it/s, loss=" not in result.stderr


def test_a_target_whose_hidden_states_stack_streams_before_the_batch_is_one_line():
    """Gemma-3n's hidden states are its AltUp streams, [4, B, T, H]: a drafter's loss indexed them as [B, T, H]
    (IndexError, exit 70). Its first forward says so in one line. Its MLP width, one per layer, gives draft layers
    the last layer's (int() of the list was exit 70 before the target loaded)."""
    config = build_config("gemma3n_text", VOCAB)
    with pytest.raises(UserError, match=r"its hidden states are \(4, 1, 5, \d+\) for \(1, 5\) tokens \(streams"):
        run_target(build_model(config, std=0.2), torch.arange(1, 6)[None])
    widths = config.intermediate_size
    assert isinstance(widths, list) and len(set(widths)) >= 1
    assert next(iter(DRAFT_LAYER_FAMILIES.values())).config(config, 1)["intermediate_size"] == widths[-1]
