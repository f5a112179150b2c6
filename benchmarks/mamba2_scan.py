"""The eval loop on a Mamba-2 hybrid target whose scan runs in transformers' PyTorch code (a CPU, or a GPU without
mamba_ssm), as it ran before and as it runs now, side by side in one process, as JSON.

    python benchmarks/mamba2_scan.py [--prompts 4] [--new-tokens 32] [--gamma 3] [--threads 1] [--out FILE]

The target: a random Bamba (4 layers, attention at layers 1 and 3, hidden 256, Mamba-2 heads of 4 with the
class's 256-wide state and its 256-token chunk, as Bamba's and Falcon-H1's releases scan); the drafter: an untrained
Medusa built from it, whose drafts are nearly all rejected, the case where the recurrent states are put back every
cycle. Each prompt (random tokens, 40 long) is decoded plainly and with a chain of --gamma tokens under four loops,
one after the other per prompt:
- `before`: every forward scans in the config's chunk, the states are put back from a copy and the accepted tokens
  fed again, carried whatever their number (the loop before draftsmith/scans.py and REFEED_LIMIT: no mixer narrowed,
  the limit unreachable);
- `narrow chunks`: chunks of at most SCAN_CHUNK, the tokens carried without limit;
- `fed again`: both;
- `now`: narrow chunks, and transformers keeps the states at every position of a verify forward, so the rejected
  positions' states are dropped and nothing is fed again (eval/target_checks.py::keeps_each_position), as the eval
  command runs.
Reports each loop's tokens/s plainly and with the drafter, the widest target forward after the prefill, and whether
every output equals the `now` loop's plain decoding (float32: the chunk moves rounding only).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from provenance import emit, provenance  # benchmarks/, first on sys.path
from transformers import BambaConfig

from draftsmith import scans
from draftsmith.eval import loop
from draftsmith.eval.loop import generate
from draftsmith.heads import drafter_class
from draftsmith.random_target import build_model

NARROWED = scans.reference_scan_mixers
KEEPS_EACH_POSITION = loop.keeps_each_position
# loop: (narrow chunks, REFEED_LIMIT, states kept per position)
LOOPS = {
    "before": (False, 10**9, False),
    "narrow chunks": (True, 10**9, False),
    "fed again": (True, loop.REFEED_LIMIT, False),
    "now": (True, loop.REFEED_LIMIT, True),
}


def bamba_target():
    config = BambaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=128, mamba_d_head=4,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    return build_model(config).eval().requires_grad_(False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = bamba_target()
    medusa = drafter_class("medusa")
    drafter = medusa.from_target(medusa.Config(), target, "random bamba").eval()
    prompts = [torch.randint(3, 4096, (40,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(4)]
    prompts = (prompts * args.prompts)[: args.prompts]
    KEEPS_EACH_POSITION(target)  # proven once per model: before any forward is counted
    widths = []
    target.register_forward_pre_hook(lambda _, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)

    totals = {name: {"plain_s": 0.0, "chain_s": 0.0, "tokens": 0, "widest": 0, "equal": True} for name in LOOPS}
    for prompt in prompts:
        reference = None
        for name, (narrow, refeed_limit, kept) in reversed(LOOPS.items()):  # `now` first: the reference tokens
            scans.reference_scan_mixers = NARROWED if narrow else lambda model: []
            loop.REFEED_LIMIT = refeed_limit
            loop.keeps_each_position = KEEPS_EACH_POSITION if kept else lambda model: False
            plain = generate(target, prompt, args.new_tokens)
            widths.clear()
            chain = generate(target, prompt, args.new_tokens, drafter=drafter.proposer(), gamma=args.gamma)
            reference = reference or plain.tokens
            row = totals[name]
            row["plain_s"] += plain.counts.wall_s
            row["chain_s"] += chain.counts.wall_s
            row["tokens"] += len(plain.tokens)
            row["widest"] = max(row["widest"], *widths[1:])  # the first: the prefill
            row["equal"] &= plain.tokens == reference and chain.tokens == reference
    rows = [
        {
            "loop": name,
            "plain_tok_s": round(row["tokens"] / row["plain_s"], 1),
            "chain_tok_s": round(row["tokens"] / row["chain_s"], 1),
            "widest_forward": row["widest"],
            "outputs_equal": row["equal"],
        }
        for name, row in totals.items()
    ]
    report = {
        "benchmark": "mamba2_scan",
        "target": "random Bamba, 4 layers (2 Mamba-2), mamba_chunk_size 256",
        "drafter": "untrained Medusa",
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "gamma": args.gamma,
        "engine": "draftsmith's eval loop (transformers' PyTorch Mamba-2 scan)",
        "rows": rows,
        **provenance(args.threads, began),
    }
    emit(report, args.out)


if __name__ == "__main__":
    main()
