"""How far one bfloat16 rounding of a target's input travels to its routers and its logits.

Two vLLM engines computing the same target in bfloat16 differ by a rounding here and there (vLLM-CPU's Gated
DeltaNet layer computes one prefill a unit apart with and without a speculative config); the export check excuses a
parting of their outputs where the target's logits near-tie there (eval/partings.py). A target that grows such a
difference layer by layer, and whose routers then choose other experts, parts beyond any near tie, whatever the
drafter: the seeded, untrained tiny Qwen3.5-MoE did (docs/targets-matrix.md, "Why the seeded Qwen3.5-MoE parted").

Measured here in float32, so that the growth is the target's and not this machine's rounding: the export check's
prompts (the demo's eval prompts, 3 a domain, as target_matrix.py's rows run them) go through the target as written,
then again with every embedding value multiplied by 1 ± `--units` bfloat16 rounding units (2^-8; a fixed random sign
per value). Per router (a `gate` or `router` module with a weight row per expert): how far its logits moved, in
bfloat16 units at their magnitude (median and 99th percentile over the tokens), and on how many tokens the chosen
experts changed; the same for the final logits. Prints one JSON object per target:

    python benchmarks/rounding_growth.py TARGET [TARGET ...] [--units 1] [--prompts 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.provenance import provenance  # noqa: E402
from draftsmith.eval.partings import BF16_UNIT  # noqa: E402
from draftsmith.eval.prompts import load_prompts  # noqa: E402
from draftsmith.families import text_config  # noqa: E402
from draftsmith.resources import bundled  # noqa: E402
from draftsmith.target import load_target, load_tokenizer  # noqa: E402
from draftsmith.tiny_config import EXPERT_COUNTS  # noqa: E402

EVAL_PROMPTS = "demo/data/eval.jsonl.gz"  # target_matrix.py's EVAL_DATA, as its export checks read it
MAX_LENGTH = 192  # target_matrix.py's MAX_LENGTH


def routers(model) -> dict[str, torch.nn.Module]:
    """The model's routers by name: `gate` or `router` modules whose weight has a row per expert."""
    config = text_config(model.config)
    experts = next((getattr(config, key) for key in EXPERT_COUNTS if getattr(config, key, None)), None)
    return {
        name: module
        for name, module in model.named_modules()
        if experts
        and name.rsplit(".", 1)[-1] in ("gate", "router")
        and getattr(module, "weight", None) is not None
        and module.weight.dim() == 2
        and module.weight.shape[0] == experts
    }


def router_logits(out) -> torch.Tensor:
    """A router's logits, a row per token (a router module returns them alone or first, before its choices)."""
    logits = out[0] if isinstance(out, tuple) else out
    return logits.float().reshape(-1, logits.shape[-1])


def relative_change(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Per row, the largest change in bfloat16 units at the row's largest magnitude (the near-tie rule's measure)."""
    return (after - before).abs().amax(-1) / (BF16_UNIT * before.abs().amax(-1).clamp_min(1e-30))


def summary(units: torch.Tensor) -> dict[str, float]:
    return {"median": round(units.median().item(), 2), "p99": round(units.quantile(0.99).item(), 1)}


@torch.no_grad()
def growth(target: str, units: float, prompts_per_domain: int) -> dict:
    """`target`'s routers and logits moved by `units` bfloat16 units at its embeddings, on the first
    `prompts_per_domain` eval prompts of each domain (the module docstring's measure)."""
    model = load_target(SimpleNamespace(name_or_path=target, revision=None, dtype="float32", trust_remote_code=False))
    tokenizer = load_tokenizer(target)
    by_domain = load_prompts([str(bundled(EVAL_PROMPTS))], tokenizer, prompts_per_domain, MAX_LENGTH)
    prompts = [prompt for domain in by_domain.values() for prompt in domain]
    chosen = routers(model)
    k = int(getattr(text_config(model.config), "num_experts_per_tok", 1))
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        module.register_forward_hook(lambda _m, _a, out, key=name: seen.setdefault(key, []).append(router_logits(out)))
        for name, module in chosen.items()
    ]
    signs = torch.Generator().manual_seed(0)
    scale: dict[str, float] = {"units": 0.0}

    def perturbed(_module, _args, out):
        sign = torch.randint(0, 2, out.shape, generator=signs, dtype=out.dtype) * 2 - 1
        return out * (1 + sign * scale["units"] * BF16_UNIT)

    hooks.append(model.get_input_embeddings().register_forward_hook(perturbed))

    def forward(step: float) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        seen.clear()
        scale["units"] = step
        logits = torch.cat([model(torch.tensor([prompt])).logits[0].float() for prompt in prompts])
        return {name: torch.cat(rows) for name, rows in seen.items()}, logits

    (plain, logits), (moved, moved_logits) = forward(0.0), forward(units)
    for hook in hooks:
        hook.remove()
    rows = {}
    for name, before in plain.items():
        picks = before.topk(k, -1).indices.sort(-1).values != moved[name].topk(k, -1).indices.sort(-1).values
        rows[name] = summary(relative_change(before, moved[name])) | {"flips": int(picks.any(-1).sum())}
    logit_units = relative_change(logits, moved_logits)
    return {
        "target": target,
        "perturbation_units": units,
        "tokens": len(logits),
        "routers": rows,
        "logits": summary(logit_units) | {"max": round(logit_units.max().item(), 1)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("targets", nargs="+", type=Path)
    parser.add_argument("--units", type=float, default=1.0, help="the perturbation, in bfloat16 rounding units")
    parser.add_argument("--prompts", type=int, default=3, help="eval prompts a domain (the matrix's rows: 3)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for target in args.targets:
        began = time.perf_counter()
        print(json.dumps(growth(str(target), args.units, args.prompts) | provenance(args.threads, began)))


if __name__ == "__main__":
    main()
