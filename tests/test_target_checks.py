"""What the eval loop needs of a target (eval/target_checks.py), on tiny random targets: a target that biases attention
by a key's index (ALiBi: MPT, Bloom) is refused trees and batches in one line, where its tree parted from plain
decoding (MPT: the run exited 0 with `lossless: false` rows) or its forward raised (Bloom: exit 70), and a training
run that would end in such an eval stage is refused before it trains."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import CONFIG_MAPPING
from transformers import __version__ as transformers_version

from draftsmith.errors import UserError
from draftsmith.eval.target_checks import check_explicit_masks, check_target
from draftsmith.families import DRAFT_LAYER_FAMILIES
from draftsmith.random_target import build_model, write_random_target
from draftsmith.target import load_target, run_target
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
    refused = rf"does not compute a token by the explicit mask .*\((after 2 tokens, )?{re.escape(said)}"
    with pytest.raises(UserError, match=refused):
        check_explicit_masks(model)
    check_target(model)  # a single chain gets no explicit mask: decoded as plain decoding is
    with pytest.raises(UserError, match="set eval.tree=0 eval.batch_size=1 eval.batch_sizes=\\[\\]$"):
        check_target(model, batch=True)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3_text", "deepseek_v3"])
def test_targets_that_compute_by_positions_and_masks_pass(family):
    """Rotary, learned absolute positions, sliding windows, latent attention with routed experts."""
    check_explicit_masks(build_model(build_config(family, VOCAB), std=0.2))


def test_a_target_picking_keys_by_index_past_a_budget_is_refused_where_the_run_decodes_past_it():
    """Kolibri-1.1's indexer (transformers 5.25) keeps a query's newest keys and scores blocks of keys by their index
    among the keys it sees, once it sees more than its budget (here a pool of 32 keys, 16 + 8 local + 2 sink picked):
    a tree's second sibling then loses itself, so its trees parted from plain decoding. Proven at the longest context
    the run decodes: below the budget it computes by the mask, past it it is refused."""
    if "kolibri1_1" not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers_version} has no kolibri1_1")
    kinds = ["sliding_attention", "indexed_attention"] * 2
    indexer = {"index_num_heads": 2, "index_topk": 16, "index_pool_size": 32, "index_num_local_tokens": 8}
    config = build_config("kolibri1_1", VOCAB, {}, layer_types=kinds, index_num_sink_tokens=2, **indexer)
    model = build_model(config, std=0.2).requires_grad_(False)
    check_explicit_masks(model, 20)
    with pytest.raises(UserError, match="after 68 tokens, a tree's second sibling differs from its logits alone"):
        check_explicit_masks(model, 70)
    with pytest.raises(UserError, match="set eval.tree=0 eval.batch_size=1"):
        check_target(model, tree=True, length=70)


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
    config = build_config("gemma3n_text", VOCAB, intermediate_size=[96, 112, 128, 144])  # one per layer, apart
    with pytest.raises(UserError, match=r"its hidden states are \(4, 1, 5, \d+\) for \(1, 5\) tokens \(streams"):
        run_target(build_model(config, std=0.2), torch.arange(1, 6)[None])
    widths = config.intermediate_size
    assert widths == [96, 112, 128, 144]
    assert next(iter(DRAFT_LAYER_FAMILIES.values())).config(config, 1)["intermediate_size"] == widths[-1]


@pytest.mark.slow  # a RecurrentGemma target written, a run started: about 5 s
def test_a_target_keeping_its_state_outside_the_cache_is_refused_before_a_run_trains(tmp_path, capsys):
    """RecurrentGemma keeps its recurrent and convolution states in its own modules and returns no cache: a run
    trained to its end, then its eval stage failed (`'CausalLMOutput' object has no attribute 'cache'`, exit 70). The
    eval's checks refuse it in one line, and a run whose eval stage would decode on it before it trains."""
    target = write_random_target("recurrent_gemma", tmp_path / "target")
    with pytest.raises(UserError, match="RecurrentGemmaForCausalLM's forward returns no cache"):
        check_target(load_target(str(target)))
    args = ["train.py", "recipe=medusa", f"target.name_or_path={target}", f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1", "eval.tree=0", "eval.batch_sizes=[]"]  # fmt: skip
    result = run_entry_in_process(args, capsys)
    assert_one_line_error(result, 2, "the eval loop, which rolls a rejected draft back in the cache, cannot verify")
    assert not (tmp_path / "run" / "final").exists() and "it/s, loss=" not in result.stderr
