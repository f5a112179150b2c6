"""The tiny releases of the vision-language wrappers vLLM 0.32 serves past the import in an environment whose
torchvision loads (Muse Glimmer, Gemma-4 Unified, Exaone-4.5): each carries the fields vLLM reads that transformers'
config classes have none for, in its written config.json, at sizes consistent with the tiny tower; and a wrapper
whose folder ships no image processor config is checked and served as its language model only, which vLLM builds
without one (docs/targets-matrix.md, the rows and the commands that measured them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.tiny_config import TINY, build_config
from draftsmith.tiny_wrapper import TINY_VISION, tiny_wrapper_config

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
VOCAB = 512
GEMMA4_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # vLLM 0.32's gemma4_mm._SUPPORTED_SOFT_TOKENS


def write_config(folder: Path, config: dict) -> None:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))


def written_config(model_type: str) -> dict:
    """The tiny release's config.json as write_random_target writes it (transformers' own serialisation)."""
    text = build_config(model_type, VOCAB, SPECIAL)
    return json.loads(tiny_wrapper_config(model_type, text, released=True).to_json_string())


def test_muse_glimmers_tower_sizes_are_where_vllm_reads_them_and_match_its_pixel_shuffle():
    """vLLM's MuseGlimmerVisionEncoder refuses a tower whose `vision_config.output_dim` is not its width times the
    merge kernel squared ("output_dim=6144 does not match pixel-shuffle output 128": transformers' class keeps the
    merged width at the wrapper's top as `out_hidden_size`, so vLLM read its own default), and builds the adapter
    from `vision_config.adapter_dim`: both are the tiny tower's, as the wrapper's weights are shaped."""
    config = written_config("muse_glimmer")
    vision = config["vision_config"]
    merge = vision.get("merge_kernel_size", 2)  # vLLM's default, transformers' merge_size
    assert vision["merge_size"] == merge
    assert vision["output_dim"] == vision["hidden_size"] * merge**2 == config["out_hidden_size"]
    assert vision["adapter_dim"] == config["projector_hidden_size"] == TINY["hidden_size"]


def test_gemma4_unifieds_vision_config_carries_its_tokens_per_image():
    """vLLM's Gemma-4 Unified reads `vision_config.num_soft_tokens` at start (`AttributeError` on the config
    transformers 5.24 writes): the release's budget, its processor class's default, one vLLM supports."""
    vision = written_config("gemma4_unified")["vision_config"]
    assert vision["num_soft_tokens"] == 280 and vision["num_soft_tokens"] in GEMMA4_SOFT_TOKENS


def test_exaone4_5s_tower_heads_group_and_the_wrapper_names_its_vocabulary_at_the_top():
    """vLLM's Exaone-4.5 tower divides its heads into key-value groups ("num_heads (2) is not divisible by
    num_kv_heads (8)": the class's 8 beside the tiny 2 heads), and its MTP model reads the vocabulary at the wrapper's
    top, where transformers' config has none ("'Exaone4_5_Config' object has no attribute 'vocab_size'")."""
    config = written_config("exaone4_5")
    vision = config["vision_config"]
    assert vision["num_heads"] == TINY_VISION["num_heads"]
    assert vision["num_heads"] % vision["num_key_value_heads"] == 0
    assert config["vocab_size"] == config["text_config"]["vocab_size"] == VOCAB


def test_a_wrapper_without_an_image_processor_is_served_as_its_language_model_only(tmp_path):
    """vLLM builds a wrapper's multimodal processor at start, text prompts or not, and a tiny release ships no
    image processor config (Exaone-4.5's: `OSError: Can't load image processor`): such a target is checked and served
    with `language_model_only`; a wrapper that ships one, or a text model, is served as it is."""
    from draftsmith.engines import serves_language_model_only
    from draftsmith.export.card import served_note
    from draftsmith.formats.repo import vllm_serve_flags

    wrapper, text = tmp_path / "wrapper", tmp_path / "text"
    write_config(wrapper, {"model_type": "wrapper", "vision_config": {}, "text_config": {}})
    write_config(text, {"model_type": "text"})
    assert serves_language_model_only(wrapper) and serves_language_model_only(str(wrapper))
    assert not serves_language_model_only(text)
    assert not serves_language_model_only("acme/a-release-on-the-hub")
    (wrapper / "preprocessor_config.json").write_text("{}")
    assert not serves_language_model_only(wrapper)
    arguments = {"dtype": "float32", "max_model_len": 64, "language_model_only": True}
    assert vllm_serve_flags(arguments) == " --language-model-only"
    assert vllm_serve_flags({**arguments, "language_model_only": False}) == ""
    verified = {
        "engine_version": "0.32.0", "prompts": 2, "max_new_tokens": 8, "num_speculative_tokens": 3,
        "lossless": True, "equals_draftsmith_plain": True, "engine_arguments": arguments,
    }  # fmt: skip
    assert "and text only, as the command serves it (`--language-model-only`)" in served_note("vllm", verified, "")


@pytest.mark.parametrize("text_only", [True, False])
def test_the_check_and_the_serve_command_run_a_text_only_wrapper_alike(text_only, tmp_path, monkeypatch):
    """The check sends vLLM `language_model_only` where the target is served so, records it among its engine
    arguments, and the card's `vllm serve` line carries `--language-model-only`."""
    import draftsmith.export.verify as verify
    import draftsmith.formats.repo as repo
    from draftsmith.target import load_target
    from tests.helpers import REFERENCE_TARGET
    from tests.test_export import CHECKED, checked_medusa_export

    monkeypatch.setattr(
        verify, "compare", lambda *args, **kwargs: {k: v for k, v in CHECKED.items() if k != "engine_arguments"}
    )
    monkeypatch.setattr(repo, "serves_language_model_only", lambda target: text_only)
    request, folder = checked_medusa_export(load_target(str(REFERENCE_TARGET)), tmp_path)
    card = (folder / "README.md").read_text()
    assert request.get("language_model_only", False) is text_only
    assert ("--dtype float32 --language-model-only --speculative-config" in card) is text_only
    info = json.loads((folder / "draftsmith_export.json").read_text())
    assert info["verified"]["engine_arguments"].get("language_model_only", False) is text_only


@pytest.mark.parametrize("kind, told", [("eagle3", True), ("mtp", True), ("medusa", False)])
def test_every_proposer_but_medusas_is_told_a_wrappers_image_token_under_the_name_it_reads(
    kind, told, tmp_path, monkeypatch
):
    """vLLM 0.32's proposers read a multimodal target's image token as `image_token_index` save for the architectures
    they list (Muse Glimmer's EAGLE-3 stopped at start: `'MuseGlimmerConfig' object has no attribute
    'image_token_index'`), Medusa's reads none: a vLLM folder of a wrapper whose config names it `image_token_id` only
    tells vLLM the same id under that name (`target_overrides`: the check's `hf_overrides`, the command's flag), beside
    the format's own; a text target's is told nothing."""
    from types import SimpleNamespace

    from draftsmith.formats import exporter_for
    from draftsmith.formats.repo import EngineRepo

    exporter = exporter_for(kind)
    own = {"architectures": ["Native"]}
    monkeypatch.setattr(exporter, "refuse", lambda *args: None)
    monkeypatch.setattr(exporter, "vllm", lambda *args: EngineRepo("vllm", {}, {}, {}, "", target_overrides=dict(own)))
    write_config(tmp_path / "wrapper", {"model_type": "wrapper", "vision_config": {}, "image_token_id": 7})
    write_config(tmp_path / "text", {"model_type": "text", "image_token_id": 7})
    told_wrapper = {"image_token_index": 7} if told else {}
    for folder, expected in ((tmp_path / "wrapper", told_wrapper), (tmp_path / "text", {})):
        target = SimpleNamespace(shape=SimpleNamespace(name_or_path=str(folder)), config={})
        source = SimpleNamespace(
            drafter=SimpleNamespace(TITLE=kind), target=target, target_model=None, vllm_format=None
        )
        assert exporter.build("vllm", source, 3, tmp_path / "export" / "vllm").target_overrides == {**expected, **own}


def test_a_load_sweep_serves_the_target_as_the_check_and_the_serving_command_do(small_data, tmp_path):
    """`draftsmith sweep` measures the folder as it is served: a wrapper folder without an image processor config as
    its language model only, with the folder's `target_overrides` (its record's) as vLLM's hf_overrides, the same
    arguments the export's check ran it with (formats/repo.py target_arguments); else vLLM stops at start, or serves
    another model than the check measured."""
    from transformers import AutoConfig

    from draftsmith.export.sweep import sweep_load, sweep_prompts
    from draftsmith.formats.repo import EXPORT_INFO
    from draftsmith.recipe import load_recipe
    from tests.helpers import KINDS, REFERENCE_TARGET

    cfg = load_recipe([f"recipe={KINDS['medusa']}", f"target.name_or_path={REFERENCE_TARGET}",
                       f"output_dir={tmp_path / 'run'}", f"eval.data=[{small_data['eval']}]",
                       "eval.max_prompts=1"])  # fmt: skip
    folder = tmp_path / "export"
    write_config(folder, {})
    overrides = {"image_token_index": 7}
    (folder / EXPORT_INFO).write_text(json.dumps({"target_overrides": overrides}))
    reference = AutoConfig.from_pretrained(REFERENCE_TARGET)  # a target read out of order: caching stays on
    plain = sweep_load(cfg, "python", folder, {}, reference, 1, sweep_prompts(cfg))
    assert plain.engine_arguments == {"hf_overrides": overrides}
    write_config(folder / "target", {"model_type": "wrapper", "vision_config": {}})  # served from the folder
    wrapper = sweep_load(cfg, "python", folder, {}, reference, 1, sweep_prompts(cfg))
    assert wrapper.engine_arguments == {"language_model_only": True, "hf_overrides": overrides}
    assert wrapper.request([1], None)["language_model_only"] is True
