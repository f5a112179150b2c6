"""The eval loop's two ways of undoing a rejected draft on a target with recurrent layers, side by side in one
process, as JSON.

    python benchmarks/recurrent_rollback.py [--prompts 4] [--new-tokens 64] [--gamma 3] [--threads 1] [--out FILE]

- `kept per position`: transformers keeps each recurrent layer's state at every position of a verify forward and
  the loop drops the rejected positions' states (eval/target_checks.py::keeps_each_position), as an engine does:
  every verify forward is the root and the draft;
- `fed again`: the loop copies the states before a verify forward, puts them back after a rejected draft and
  feeds the accepted tokens again at the head of the next forward (at most REFEED_LIMIT of them), as it does on a
  family whose code keeps the last state alone.

Targets: random 4-layer models of 256 wide, attention at layers 1 and 3: Bamba (Mamba-2 at 0 and 2, chunk 256,
scanned in chunks of at most SCAN_CHUNK) and Qwen3-Next (Gated DeltaNet at 0 and 2); transformers' PyTorch kernels
(no mamba_ssm, no flash-linear-attention). Drafters, built from each target without training: an untrained Medusa
(nearly every draft rejected, the case that feeds the most again) and a draft model of the target's first 3 layers
(part of each draft accepted). Each prompt (random tokens, 40 long) is decoded plainly, then with a chain of
--gamma tokens under each rollback, one after the other. Reports per target, drafter and rollback: tokens/s, tokens
per target forward after the prefill, the target's forwards and the widest one after the prefill, and whether every
output equals plain decoding's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from provenance import emit, provenance  # benchmarks/, first on sys.path
from transformers import BambaConfig, Qwen3NextConfig

from draftsmith.eval import loop
from draftsmith.eval.loop import generate
from draftsmith.heads import drafter_class
from draftsmith.random_target import build_model

KEEPS_EACH_POSITION = loop.keeps_each_position
ROLLBACKS = {"kept per position": KEEPS_EACH_POSITION, "fed again": lambda model: False}
SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
TARGETS = {
    "bamba": lambda: BambaConfig(**SHAPE, attn_layer_indices=[1, 3], mamba_n_heads=128, mamba_d_head=4),
    "qwen3_next": lambda: Qwen3NextConfig(
        **SHAPE, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
        linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        shared_expert_intermediate_size=256, layer_types=["linear_attention", "full_attention"] * 2,
    ),
}  # fmt: skip


def drafters_of(target, name: str) -> dict:
    medusa, draft_model = drafter_class("medusa"), drafter_class("draft_model")
    return {
        "untrained Medusa": medusa.from_target(medusa.Config(), target, name).eval(),
        "draft of 3 layers": draft_model.from_target(draft_model.Config(num_layers=3), target, name).eval(),
    }


def measure(name: str, config, prompts: list[list[int]], args) -> list[dict]:
    """The target's plain decoding, then each drafter's chains under each rollback, prompt by prompt."""
    torch.manual_seed(0)
    target = build_model(config).eval().requires_grad_(False)
    assert KEEPS_EACH_POSITION(target), f"{name}: transformers keeps no state per position"  # proven once
    widths = []
    target.register_forward_pre_hook(lambda _, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    drafters = drafters_of(target, name)
    totals = {(d, r): {"s": 0.0, "tokens": 0, "forwards": 0, "widest": 0, "equal": True}
              for d in drafters for r in ROLLBACKS}  # fmt: skip
    plain_s = plain_tokens = 0
    for prompt in prompts:
        plain = generate(target, prompt, args.new_tokens)
        plain_s, plain_tokens = plain_s + plain.counts.wall_s, plain_tokens + len(plain.tokens)
        for drafter_name, drafter in drafters.items():
            for rollback, keeps in ROLLBACKS.items():
                loop.keeps_each_position = keeps
                widths.clear()
                chain = generate(target, prompt, args.new_tokens, drafter=drafter.proposer(), gamma=args.gamma)
                row = totals[drafter_name, rollback]
                row["s"] += chain.counts.wall_s
                row["tokens"] += len(chain.tokens)
                row["forwards"] += len(widths)
                row["widest"] = max(row["widest"], *widths[1:])  # the first: the prefill
                row["equal"] &= chain.tokens == plain.tokens
    loop.keeps_each_position = KEEPS_EACH_POSITION
    rows = [{"target": name, "drafter": None, "rollback": None, "tok_s": round(plain_tokens / plain_s, 1)}]
    for (drafter_name, rollback), row in totals.items():
        rows.append({
            "target": name,
            "drafter": drafter_name,
            "rollback": rollback,
            "tok_s": round(row["tokens"] / row["s"], 1),
            "target_forwards": row["forwards"],
            "tokens_per_forward": round(row["tokens"] / (row["forwards"] - len(prompts)), 2),
            "widest_forward": row["widest"],
            "outputs_equal": row["equal"],
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    prompts = [torch.randint(3, 4096, (40,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(args.prompts)]  # fmt: skip
    rows = [row for name, config in TARGETS.items() for row in measure(name, config(), prompts, args)]
    report = {
        "benchmark": "recurrent_rollback",
        "targets": "random Bamba and Qwen3-Next, 4 layers of 256 (transformers' PyTorch kernels)",
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "gamma": args.gamma,
        "engine": "draftsmith's eval loop",
        "rows": rows,
        **provenance(args.threads, began),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
