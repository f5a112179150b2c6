"""Features in speculators' format (data_prep/speculators_features.py): the files hold what vLLM's
`extract_hidden_states` would (speculators' layer ids = transformers' `hidden_states` indices, the last
slot the final layer's output before the final norm) and line up with draftsmith's tokenization;
speculators 0.9.0's own offline dataset class reads them in tests/test_speculators_interop.py (in its venv, in the
one speculators process of that module)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
from datasets import load_from_disk
from safetensors.torch import load_file

from draftsmith.data_prep.speculators_features import (
    INFO,
    TOKEN_FREQ,
    UNFINISHED,
    speculators_states,
    tap_layer_ids,
)
from draftsmith.outputs import DirectoryLock
from draftsmith.recipe import load_recipe
from draftsmith.target import load_target
from tests.helpers import REFERENCE_TARGET, assert_one_line_error, run_entry_in_process, speculators_features

ROWS = 3


@pytest.fixture(scope="module")
def written(tmp_path_factory, token_cache):
    output = tmp_path_factory.mktemp("speculators") / "data"
    umask = os.umask(0o022)  # test_files_have_the_umasks_mode's
    try:
        return output, speculators_features(output, token_cache, ROWS)
    finally:
        os.umask(umask)


@pytest.mark.slow
def test_states_follow_vllm_layer_ids(written):
    output, info = written
    assert info["draftsmith_layer_ids"] == [0, 1, 2] and info["speculators_layer_ids"] == [1, 2, 3]
    model = load_target(load_recipe(["recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}"]).target)
    rows = load_from_disk(str(output))
    assert len(rows) == ROWS and rows[0]["seq_len"] == len(rows[0]["input_ids"])
    saved = load_file(output / "hidden_states" / "hs_0.safetensors")
    assert torch.equal(saved["token_ids"], rows[0]["input_ids"])
    with torch.no_grad():
        reference = model(saved["token_ids"][None], output_hidden_states=True).hidden_states
        # the final layer's output before the norm: the last layer run on its input by hand
        layer = model.model.layers[-1]
        positions = torch.arange(len(saved["token_ids"]))[None]
        rotary = model.model.rotary_emb(reference[-2], positions)
        mask = torch.full((len(positions[0]),) * 2, float("-inf")).triu(1)[None, None]
        out = layer(reference[-2], attention_mask=mask, position_ids=positions, position_embeddings=rotary)
        pre_norm = out[0] if isinstance(out, tuple) else out
    states = saved["hidden_states"]
    assert states.shape == (len(saved["token_ids"]), 4, model.config.hidden_size)
    for slot, layer_id in enumerate(info["speculators_layer_ids"]):
        assert torch.equal(states[:, slot], reference[layer_id][0])
    torch.testing.assert_close(states[:, -1], pre_norm[0], atol=1e-4, rtol=1e-4)
    assert torch.allclose(model.model.norm(states[:, -1]), reference[-1][0], atol=1e-5)  # it is what the norm reads
    assert not torch.allclose(states[:, -1], reference[-1][0])  # and not transformers' normed last state
    frequency = torch.load(output / TOKEN_FREQ)
    assert sum(frequency.values()) == info["masked_tokens"] == int(sum(r.sum() for r in rows["loss_mask"]))


def test_files_have_the_umasks_mode(written):
    """safetensors writes through a private temporary file (mode 0600): every file of the folder gets the
    umask's mode (0644 under umask 022), so that speculators run by another user can read it."""
    output, _ = written
    files = [path for path in output.rglob("*") if path.is_file()]
    modes = {path.relative_to(output).as_posix(): oct(path.stat().st_mode & 0o777) for path in files}
    assert {path: mode for path, mode in modes.items() if mode != oct(0o644)} == {}
    assert len([path for path in modes if path.startswith("hidden_states/")]) == ROWS


def test_speculators_states_refuses_ids_past_the_layers():
    model = load_target(load_recipe(["recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}"]).target)
    with pytest.raises(Exception, match="layer ids"):
        speculators_states(model, torch.tensor([1, 2, 3]), [1, 4])


def test_a_multi_stream_targets_states_are_the_mean_of_each_layers_streams_as_vllm_reads_them():
    """DeepSeek-V4 passes hc_mult residual streams between layers: each vLLM layer id's slot is their mean
    (`draftsmith.target.layer_output`), the last slot the lm_head's input before the final norm, one state a
    position like every other family's."""
    from transformers import AutoModelForCausalLM

    from draftsmith.tiny_config import build_config

    torch.manual_seed(0)
    config = build_config("deepseek_v4", 96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, head_dim=16)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([1, 5, 9, 4, 7, 3])
    states = speculators_states(model, ids, [0, 1, 2])
    with torch.no_grad():
        hidden = model(input_ids=ids[None], output_hidden_states=True).hidden_states
    assert hidden[1].shape == (1, 6, config.hc_mult, 64)  # the streams the slots average
    assert states.shape == (6, 4, 64)
    for slot, layer_id in enumerate([0, 1, 2]):
        torch.testing.assert_close(states[:, slot], hidden[layer_id][0].mean(dim=-2))


def write_features(output, capsys, token_cache, *settings):
    """The entry point (`python -m data_prep.speculators_features`) in-process on 4 short rows."""
    tiny = ["data.max_conversations=4", "data.max_length=64", f"data.cache_dir={token_cache}"]
    return run_entry_in_process(["-m", "data_prep.speculators_features", str(output), *tiny, *settings], capsys)


@pytest.mark.slow
def test_a_folder_made_with_other_settings_is_refused_and_the_same_settings_resume(tmp_path, capsys, token_cache):
    """Resuming skips the finished rows' files: with other rows or layers they would hold the old states."""
    output = tmp_path / "features"
    assert write_features(output, capsys, token_cache, "recipe=eagle3").returncode == 0
    first = sorted((output / "hidden_states").iterdir())
    stamps = [path.stat().st_mtime_ns for path in first]
    info = (output / INFO).read_text()
    for setting, named in [
        ("data.max_length=32", "max_length: 64 -> 32"),
        ("drafter.aux_layers=[-1,0,2]", "draftsmith_layer_ids: [0, 1, 2] -> [-1, 0, 2]"),
        ("data.max_conversations=3", "rows: 4 -> 3"),
    ]:
        refused = write_features(output, capsys, token_cache, "recipe=eagle3", setting)
        line = assert_one_line_error(refused, 2, named)
        assert "other settings" in line and "another OUTPUT folder" in line
        assert (output / INFO).read_text() == info and sorted((output / "hidden_states").iterdir()) == first
    assert write_features(output, capsys, token_cache, "recipe=eagle3").returncode == 0  # complete: left as it is
    assert [path.stat().st_mtime_ns for path in first] == stamps
    # a run killed before its last row (its record not yet renamed): the same settings finish it, keeping the others
    (output / INFO).rename(output / UNFINISHED)
    first[-1].unlink()
    refused = write_features(output, capsys, token_cache, "recipe=eagle3", "data.max_length=32")
    assert_one_line_error(refused, 2, "max_length: 64 -> 32")
    assert write_features(output, capsys, token_cache, "recipe=eagle3").returncode == 0
    assert [path.stat().st_mtime_ns for path in first[:-1]] == stamps[:-1] and first[-1].is_file()
    assert (output / INFO).read_text() == info and not (output / UNFINISHED).exists()


def test_a_folder_holding_files_but_no_info_is_refused(tmp_path, capsys, token_cache):
    output = tmp_path / "features"
    (output / "hidden_states").mkdir(parents=True)
    (output / "hidden_states" / "hs_0.safetensors").write_bytes(b"from some other run")
    refused = write_features(output, capsys, token_cache, "recipe=eagle3")
    assert_one_line_error(refused, 2, f"holds files but no {INFO}")
    assert not (output / INFO).exists() and not (output / UNFINISHED).exists()


def test_a_run_stopped_before_its_first_state_is_no_folder_to_keep(tmp_path, capsys, token_cache):
    """A target that did not load leaves the record and no state: the fixed command starts the folder afresh."""
    output = tmp_path / "features"
    broken = tmp_path / "target"
    shutil.copytree(REFERENCE_TARGET, broken, ignore=shutil.ignore_patterns("*.safetensors"))  # weights missing
    stopped = write_features(output, capsys, token_cache, "recipe=eagle3", f"target.name_or_path={broken}")
    assert_one_line_error(stopped, 2, "cannot load target")
    assert (output / UNFINISHED).is_file()
    assert write_features(output, capsys, token_cache, "recipe=eagle3").returncode == 0
    assert json.loads((output / INFO).read_text())["target"] == str(REFERENCE_TARGET)


@pytest.mark.parametrize(
    "settings, named",
    [
        (["recipe=medusa"], "features are a drafter kind's taps of the target's inner layers, and drafter.type=medusa"),
        (["recipe=eagle3", "drafter.aux_layers=null"], "= [1, 1, 0] for this 4-layer target: ids must be distinct"),
        (["recipe=eagle3", "drafter.aux_layers=[0,1,3]"], "drafter.type=eagle3 taps layers [0, 1, 3]: layer 3 is the"),
        (["recipe=eagle3", "drafter.aux_layers=[0,4]"], "drafter.aux_layers=[0, 4]: layer id(s) [4] out of range"),
    ],
)
def test_unusable_tap_layers_are_refused_as_train_refuses_them_and_nothing_is_created(
    tmp_path, capsys, token_cache, settings, named
):
    output = tmp_path / "features"
    assert_one_line_error(write_features(output, capsys, token_cache, *settings), 2, named)
    assert not output.exists()


def test_a_folder_in_use_by_another_run_is_refused_and_left_as_it_is(tmp_path, capsys, token_cache, monkeypatch):
    output = tmp_path / "features"
    monkeypatch.setattr(sys, "argv", ["another speculators_features run"])  # the command the holder's lock names
    with DirectoryLock(output):
        refused = write_features(output, capsys, token_cache, "recipe=eagle3")
        assert_one_line_error(refused, 2, "is in use by another job (pid")
        assert [path.name for path in output.iterdir()] == [".draftsmith.lock"]


def test_a_hybrid_targets_default_taps_are_the_attention_layers_train_taps(tmp_path):
    """With drafter.aux_layers unset, the states are those `draftsmith train` reads on this target: on a hybrid
    linear-attention one, EAGLE-3's default moved onto attention layers (draftsmith.families.tap_layers)."""
    from transformers import AutoConfig

    from draftsmith.heads import drafter_class
    from draftsmith.random_target import write_random_target
    from draftsmith.target import TargetShape

    folder = write_random_target("qwen3_next", tmp_path / "hybrid", num_hidden_layers=8)
    cfg = load_recipe(["recipe=eagle3", f"target.name_or_path={folder}", "drafter.aux_layers=null"])
    config = AutoConfig.from_pretrained(folder)
    trained = drafter_class("eagle3").from_target(drafter_class("eagle3").Config(), load_target(str(folder)), "t")
    taps = tap_layer_ids(cfg, config, TargetShape.from_config(config, str(folder)))
    assert taps == trained.config.aux_layers != [1, 3, 4]


def test_the_taps_are_the_recipe_kinds_own_as_train_resolves_them(tmp_path):
    """The layers are asked of the recipe's drafter kind through the registry: DFlash's own drafter.target_layers,
    and its default when unset, moved onto a hybrid target's attention layers as `draftsmith train` moves them."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig

    from draftsmith.heads import drafter_class
    from draftsmith.random_target import write_random_target
    from draftsmith.target import TargetShape

    folder = write_random_target("qwen3_next", tmp_path / "hybrid", num_hidden_layers=8)
    cfg = load_recipe(["recipe=dflash", f"target.name_or_path={folder}", "drafter.target_layers=null"])
    config, kind = AutoConfig.from_pretrained(folder), drafter_class("dflash")
    trained = kind.from_target(OmegaConf.to_object(cfg.drafter), load_target(str(folder)), "t")  # as train builds it
    unmoved = kind.features(OmegaConf.to_object(cfg.drafter), TargetShape.from_config(config, str(folder))).layers
    assert tap_layer_ids(cfg, config, TargetShape.from_config(config, str(folder))) == trained.config.target_layers
    assert trained.config.target_layers != list(unmoved)
    chosen = load_recipe(["recipe=dflash", f"target.name_or_path={folder}", "drafter.target_layers=[0,2]"])
    assert tap_layer_ids(chosen, config, TargetShape.from_config(config, str(folder))) == [0, 2]
