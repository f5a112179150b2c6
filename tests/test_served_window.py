"""The target draftsmith runs is the target vLLM serves: where a release states its sliding window in a field of its
own (`sliding_window_size`) and transformers' class derives another `sliding_window` from it (MiMo-V2-Flash's one
key more), draftsmith's target attends the release's count, as vLLM 0.32's layers do, and the release's config.json
stays as written (docs/targets-mtp.md, MiMo-V2-Flash); where vLLM's class attends one key more than `sliding_window`
(Cohere2's), draftsmith's target and draft models do too, and a draft model's exported config.json states the
release's window, which vLLM widens itself (draftsmith.vllm_window)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.random_target import write_random_target
from draftsmith.target import load_target
from draftsmith.vllm_window import served_window

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 8  # the keys vLLM attends: shorter than the prompt below, so every sliding layer cuts keys off
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 32, "v_head_dim": 32}


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_a_mimo_v2_flash_target_attends_the_releases_sliding_window_size_keys(tmp_path, caplog):
    """The loaded target's logits over 24 positions equal transformers' model built with a window of exactly
    `sliding_window_size` keys and differ from transformers' own reading (one key more), past the window only; the
    load says so in one line."""
    folder = write_random_target("mimo_v2_flash", tmp_path / "target", sliding_window=WINDOW + 1, **SHAPE)
    written = (folder / "config.json").read_text()
    release = json.loads(written)
    assert release["sliding_window_size"] == WINDOW and "sliding_attention" in release["layer_types"]
    with caplog.at_level(logging.INFO, logger="draftsmith.target"):
        model = load_target(str(folder))
    said = [record.getMessage() for record in caplog.records if "as vLLM serves it" in record.getMessage()]
    assert len(said) == 1 and f"attend {WINDOW} keys" in said[0], said
    assert model.config.sliding_window == WINDOW
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(0))
    served = AutoConfig.from_pretrained(folder)
    assert served.sliding_window == WINDOW + 1  # transformers' own reading
    served.sliding_window = WINDOW
    reference = AutoModelForCausalLM.from_pretrained(folder, config=served, dtype=torch.float32).eval()
    wider = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, ref, more = logits(model, ids), logits(reference, ids), logits(wider, ids)
    assert torch.equal(ours, ref)
    # within the window the two agree up to rounding: the masks differ past it, and how a CPU's matmul kernels
    # block the masked scores moves the last bits (5e-7 on one AVX-512 Xeon box of 2026-12-02, exact on others)
    assert (ours[:, :WINDOW] - more[:, :WINDOW]).abs().max() < 1e-5
    assert (ours[0, WINDOW:] - more[0, WINDOW:]).abs().amax(-1).min() > 1e-4  # past it, every position differs
    assert (folder / "config.json").read_text() == written  # the release as written: vLLM reads its window there


@pytest.mark.parametrize(
    "fields, window",
    [
        ({"sliding_window": 9, "sliding_window_size": 8}, 8),  # a class deriving one key more (MiMo-V2's)
        ({"sliding_window": 8, "sliding_window_size": 8}, None),  # a class reading it as its window (Inkling's)
        ({"sliding_window": 9}, None),  # no release field: transformers' window is vLLM's
        ({"sliding_window": 9, "sliding_window_size": 8, "layer_types": ["full_attention"] * 2}, None),  # none slides
        ({"model_type": "cohere2", "sliding_window": 8}, 9),  # vLLM's class attends one key more
        ({"model_type": "cohere2", "sliding_window": 9, "sliding_window_size": 9}, None),  # stated: served already
        ({"model_type": "cohere2", "sliding_window": 8, "layer_types": ["full_attention"] * 2}, None),
    ],
)
def test_the_served_window_is_the_releases_field_where_transformers_reads_another(fields, window):
    config = {"num_hidden_layers": 2, "layer_types": ["full_attention", "sliding_attention"], **fields}
    assert served_window(config) == window


def test_a_draft_model_of_a_mimo_v2_flash_targets_layers_attends_the_served_window_built_and_reloaded(tmp_path):
    """A draft of the target's first layers, and a small model of the family named as the draft, attend the
    release's `sliding_window_size` keys as vLLM serves a draft model, when built and when reloaded from its
    checkpoint: the config's class, rebuilding from a dict, would derive one key more each time."""
    from draftsmith.heads import drafter_class
    from draftsmith.heads.base import load_drafter

    folder = write_random_target("mimo_v2_flash", tmp_path / "target", sliding_window=WINDOW + 1, **SHAPE)
    target = load_target(str(folder))
    cls = drafter_class("draft_model")
    for config in (cls.Config(num_layers=2), cls.Config(name_or_path=str(folder))):  # layers 0 (full) and 1 (sliding)
        drafter = cls.from_target(config, target, str(folder))
        assert "sliding_attention" in drafter.model.config.layer_types
        assert drafter.model.config.sliding_window == WINDOW
        drafter.save_pretrained(tmp_path / "draft")
        assert load_drafter(tmp_path / "draft", target_model=target).model.config.sliding_window == WINDOW


@pytest.mark.parametrize("family", ["cohere2", "cohere2_moe"])
def test_a_cohere2_target_attends_one_key_more_than_its_sliding_window_as_vllm_serves_it(family, tmp_path, caplog):
    """The loaded target's logits over 24 positions equal transformers' model built with `sliding_window + 1` keys
    and differ from transformers' own reading past the window; the load says so in one line; config.json stays."""
    folder = write_random_target(family, tmp_path / "target", sliding_window=WINDOW)
    written = (folder / "config.json").read_text()
    with caplog.at_level(logging.INFO, logger="draftsmith.target"):
        model = load_target(str(folder))
    said = [record.getMessage() for record in caplog.records if "as vLLM serves it" in record.getMessage()]
    assert len(said) == 1 and f"attend {WINDOW + 1} keys" in said[0], said
    assert model.config.sliding_window == WINDOW + 1
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(0))
    served = AutoConfig.from_pretrained(folder)
    served.sliding_window = WINDOW + 1
    reference = AutoModelForCausalLM.from_pretrained(folder, config=served, dtype=torch.float32).eval()
    narrower = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours, ref, fewer = logits(model, ids), logits(reference, ids), logits(narrower, ids)
    assert torch.equal(ours, ref)
    assert (ours[0, WINDOW + 1 :] - fewer[0, WINDOW + 1 :]).abs().amax(-1).min() > 1e-4  # past it, every position
    assert (folder / "config.json").read_text() == written


def test_a_draft_model_of_a_cohere2_target_is_widened_once_and_exported_as_its_release_states_it(tmp_path, capsys):
    """A draft of a Cohere2 target's first layers, and a small Cohere2 model named as the draft, attend one key more
    than the release's window when built and when reloaded from its checkpoint (not one more each time). The export
    writes a config.json stating the release's window, which vLLM widens itself, and serves it with vLLM's hybrid KV
    cache manager off (formats/draft_model.py's `widened_window_arguments`), in its record and its serving command;
    a draft with no sliding layer is served without that flag."""
    from draftsmith.heads import drafter_class
    from draftsmith.heads.base import load_drafter
    from tests.helpers import run_entry_in_process

    folder = write_random_target("cohere2", tmp_path / "target", sliding_window=WINDOW)
    target = load_target(str(folder))
    cls = drafter_class("draft_model")
    for config in (cls.Config(num_layers=2), cls.Config(name_or_path=str(folder))):
        drafter = cls.from_target(config, target, str(folder))
        assert drafter.model.config.sliding_window == WINDOW + 1
        drafter.save_pretrained(tmp_path / "draft")
        assert load_drafter(tmp_path / "draft", target_model=target).model.config.sliding_window == WINDOW + 1
    export = ["-m", "export", "recipe=draft", f"target.name_or_path={folder}", f"checkpoint={tmp_path / 'draft'}",
              "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
              f"export.output={tmp_path / 'export'}"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    served = tmp_path / "export" / "vllm"
    released = json.loads((served / "config.json").read_text())
    assert released["sliding_window"] == WINDOW and "sliding_window_size" not in released
    info = json.loads((served / "draftsmith_export.json").read_text())
    assert info["engine_arguments"] == {"disable_hybrid_kv_cache_manager": True}
    assert "--disable-hybrid-kv-cache-manager" in (served / "README.md").read_text()


def test_only_a_draft_model_with_sliding_layers_vllm_widens_is_served_with_the_hybrid_kv_cache_manager_off():
    from draftsmith.formats.draft_model import widened_window_arguments

    sliding = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8, "num_hidden_layers": 2}
    assert widened_window_arguments({"model_type": "cohere2", **sliding}) == {"disable_hybrid_kv_cache_manager": True}
    assert widened_window_arguments({"model_type": "cohere2", **sliding, "layer_types": ["full_attention"] * 2}) == {}
    assert widened_window_arguments({"model_type": "gemma3_text", **sliding}) == {}


@pytest.mark.slow
def test_medusa2s_merged_cohere2_target_states_the_releases_window(tmp_path, capsys):
    """Medusa-2's folder ships the target with its adapters merged, saved from the loaded target, which attends one key
    more than the release's window: its config.json states the release's window, which vLLM widens itself."""
    from tests.helpers import run_entry_in_process, save_drafter

    folder = write_random_target("cohere2", tmp_path / "target", sliding_window=WINDOW)
    checkpoint = save_drafter("medusa2", load_target(str(folder)), tmp_path / "ckpt", target_name=str(folder))
    export = ["-m", "export", "recipe=medusa2", f"target.name_or_path={folder}", f"checkpoint={checkpoint}",
              "export.engines=[vllm]", f"output_dir={tmp_path / 'run'}",
              f"export.output={tmp_path / 'export'}"]  # fmt: skip
    assert run_entry_in_process(export, capsys).returncode == 0
    merged = json.loads((tmp_path / "export" / "vllm" / "target" / "config.json").read_text())
    assert merged["sliding_window"] == WINDOW and "sliding_window_size" not in merged
