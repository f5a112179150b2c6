"""The GPU tier, `python -m pytest -m gpu`: what only a CUDA device exercises. Every test here is
skipped without one; where a GPU is lent, one device call runs the tier (docs/tests.md).

Ran 2026-11-27 on a lent H100 (torch 2.11.0+cu130, transformers 5.24.0, accelerate 1.15.0, DeepSpeed
0.19.8): all 12 pass, after two fixes only a GPU could show (docs/tests.md, "The GPU tier").

- every drafter kind trains two bf16 steps on CUDA (the target in bfloat16, mixed precision bf16);
- a drafter trained on CUDA decodes losslessly there (greedy speculative = plain greedy);
- the frozen target sharded with FSDP2 (`target.shard=fsdp`) and the drafter under DeepSpeed ZeRO-2 and
  ZeRO-3, each launched by `accelerate launch` with one process.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from draftsmith.heads import REGISTRY
from tests.helpers import REPO, demo_recipe, read_log, run_entry, train_in_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def quick(kind: str, output_dir, small_data, token_cache, *extra: str) -> list[str]:
    return [
        f"recipe={demo_recipe(kind)}", f"data.train=[{small_data['train']}]", f"data.eval=[{small_data['eval']}]", f"data.cache_dir={token_cache}",
        "data.max_conversations=16", "data.max_length=128", "data.draft_vocab=null", "train.micro_batch_size=2", "train.warmup_steps=0",
        "train.log_every=1", "eval.max_prompts=1", "eval.max_new_tokens=16", f"output_dir={output_dir}", *extra,
    ]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_every_kind_trains_bf16_steps_on_cuda(kind, tmp_path, small_data, token_cache):
    args = quick(
        kind,
        tmp_path / "run",
        small_data,
        token_cache,
        "train.max_steps=2",
        "train.mixed_precision=bf16",
        "target.dtype=bfloat16",
    )
    final, target = train_in_process([*args, "eval.enabled=false"])
    assert next(target.parameters()).is_cuda and next(target.parameters()).dtype == torch.bfloat16
    assert all(not p.requires_grad for p in target.parameters())
    losses = [row["train/loss"] for row in read_log(tmp_path / "run").values() if "train/loss" in row]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert (final / "model.safetensors").is_file()


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "dflash"])
def test_a_drafter_trained_on_cuda_decodes_losslessly_there(kind, tmp_path, small_data, token_cache):
    args = quick(
        kind, tmp_path / "run", small_data, token_cache, "train.max_steps=20", "eval.device=cuda", "eval.enabled=true"
    )
    train_in_process(args)
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    rows = report["domains"]["all"]
    assert rows and all(row["lossless"] is True for row in rows.values()), {
        name: row["lossless"] for name, row in rows.items()
    }


@pytest.mark.parametrize(
    "config, extra",
    [("fsdp_target.yaml", ["target.shard=fsdp"]), ("deepspeed_zero2.yaml", []), ("deepspeed_zero3.yaml", [])],
    ids=["fsdp2-target", "zero2", "zero3"],
)
def test_distributed_configs_train_with_one_rank(config, extra, tmp_path, small_data, token_cache):
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    args = quick("eagle3", tmp_path / "run", small_data, token_cache, "train.max_steps=3", "eval.enabled=false", *extra)
    launch = [
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "recipes" / "accelerate" / config),
        "--num_processes",
        "1",
    ]
    result = run_entry([*launch, "train.py", *args], timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [row["train/loss"] for row in read_log(tmp_path / "run").values() if "train/loss" in row]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
