"""Training from captured shards (`data.features=<dir>`) sees the same batches as training online."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.data_prep.capture import capture
from draftsmith.data_prep.collate import Collator
from draftsmith.data_prep.dataset import load_tokenized
from draftsmith.data_prep.features import open_features
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target, load_tokenizer, run_target
from draftsmith.trainer.checkpoint import TrainerState
from draftsmith.trainer.loop import micro_batches
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, train_args

pytestmark = pytest.mark.slow
SIX_STEPS = ("train.max_steps=6", "data.eval=[]")  # the runs' losses are compared, not their eval stage (0.5-2 s)


@pytest.fixture(scope="module")
def captured(tmp_path_factory, small_data, token_cache):
    root = tmp_path_factory.mktemp("offline")
    features = root / "features"
    args = train_args(
        root / "run", small_data, token_cache, "data.capture.dtype=float16", f"data.capture.output={features}"
    )
    capture(load_recipe(args))
    return features


def test_offline_and_online_batches_match(captured, small_data, token_cache, tmp_path):
    cfg = load_recipe(train_args(tmp_path, small_data, token_cache))
    tokenizer = load_tokenizer(str(REFERENCE_TARGET))
    target = load_target(str(REFERENCE_TARGET))
    online = micro_batches(
        load_tokenized(cfg, cfg.data.train, tokenizer, "data.train"),
        Collator(tokenizer.pad_token_id),
        cfg,
        1,
        0,
        TrainerState(),
    )
    store = open_features(captured)
    offline = micro_batches(store, Collator(tokenizer.pad_token_id), cfg, 1, 0, TrainerState())
    for _ in range(3):
        (_, index_a, a), (_, index_b, b) = next(online), next(offline)
        assert index_a == index_b and a["domain"] == b["domain"]
        for key in ("input_ids", "attention_mask", "loss_mask"):
            assert torch.equal(a[key], b[key]), key
        fresh = run_target(target, a["input_ids"], a["attention_mask"])
        stored = store.to_target_output(b)
        mask = a["attention_mask"].bool()
        torch.testing.assert_close(stored.final[mask], fresh.final[mask], rtol=2e-3, atol=2e-3)  # float16 storage


def test_train_py_from_features(captured, small_data, token_cache, tmp_path, capsys):
    out = tmp_path / "offline_run"
    result = run_entry_in_process(
        ["train.py", *train_args(out, small_data, token_cache, *SIX_STEPS, f"data.features={captured}")],
        capsys,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    online_out = tmp_path / "online_run"
    online = run_entry_in_process(["train.py", *train_args(online_out, small_data, token_cache, *SIX_STEPS)], capsys)
    assert online.returncode == 0, online.stderr[-2000:]
    # into a file (pytest's capture) the bar is a line at most every 30 s (draftsmith/progress.py), its first and its
    # last here: the loss shown at each logged step (train.log_every=1) wrote one more line a step, two for some
    bars = [line for line in online.stderr.splitlines() if line.startswith("train:")]
    assert len(bars) <= 3 and "6/6" in bars[-1] and "loss=" in bars[-1], bars
    offline_loss = [
        json.loads(line)["train/loss"]
        for line in (out / "log.jsonl").read_text().splitlines()
        if '"train/loss"' in line
    ]
    online_loss = [
        json.loads(line)["train/loss"]
        for line in (online_out / "log.jsonl").read_text().splitlines()
        if '"train/loss"' in line
    ]
    assert offline_loss == pytest.approx(online_loss, rel=1e-3)  # same batches, features within float16


def test_train_py_refuses_data_settings_the_capture_was_not_made_with(
    captured, small_data, token_cache, tmp_path, capsys
):
    """data.max_length=64 against a capture made at 128: one line naming both, before any model loads or
    anything of the run is written (its recipe.yaml would name 64 for rows of up to 128 tokens)."""
    out = tmp_path / "refused"
    args = train_args(out, small_data, token_cache, "data.max_length=64", f"data.features={captured}")
    line = assert_one_line_error(run_entry_in_process(["train.py", *args], capsys), 2)
    assert line.startswith("error: the recipe resolves to data.max_length=64, but the features in") and line.endswith(
        "were captured with data.max_length=128: set the capture's values, or capture again with the recipe's"
    )
    assert not (out / "recipe.yaml").exists() and not (out / "checkpoints").exists()


def test_a_shard_damaged_on_disk_found_in_training_says_how_to_run_the_command_again(
    captured, small_data, token_cache, tmp_path, capsys
):
    """A shard's checksum is checked as training reads it (hashing a capture of terabytes up front would cost
    minutes), after the run wrote its start: the line says that the rerun starts over (the same command alone is
    refused as an earlier run), and that rerun trains once the shard is whole again."""
    import shutil

    features = tmp_path / "features"
    shutil.copytree(captured, features)
    victim = features / "shard_00_00000.safetensors"
    whole = victim.read_bytes()
    victim.write_bytes(whole[:-10] + bytes(b ^ 0xFF for b in whole[-10:]))  # same size: found when read
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, "train.max_steps=2", "data.eval=[]", f"data.features={features}")
    line = assert_one_line_error(run_entry_in_process(["train.py", *args], capsys), 2)
    assert "shard_00_00000.safetensors is corrupt (sha256 differs from manifest.json)" in line
    assert line.endswith("(the run saved no checkpoint: once that is fixed, start it over with train.overwrite=true)")
    victim.write_bytes(whole)
    again = run_entry_in_process(["train.py", *args, "train.overwrite=true"], capsys)
    assert again.returncode == 0, again.stderr[-2000:]
