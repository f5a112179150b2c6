"""The eval loop's wall-clock speed-up with a draft model, next to transformers' assisted generation
with the same draft model: same prompts, greedy, batch size 1, as JSON.

    python benchmarks/assisted.py [--runs runs/bench_batch] [--prompts 8] [--new-tokens 64] [--gamma 3]

Trains `python train.py recipe=draft` (the target's first decoder layer, distilled) unless
`<runs>/draft/final` holds a checkpoint, then decodes every prompt (the first --prompts of each domain
of the demo eval data) four ways, one prompt after another, alternating so that machine noise hits
all four alike:
- draftsmith plain: the eval loop with no drafter;
- draftsmith draft model: the eval loop, chain of --gamma tokens;
- transformers plain: `target.generate(do_sample=False)`;
- transformers assisted: `target.generate(assistant_model=<the same draft LM>, do_sample=False)`,
  with `num_assistant_tokens=--gamma`, a constant schedule and no confidence cut-off (the same chain
  rule as ours), and once more with transformers' defaults (its dynamic heuristic).
Reports tokens/s, new tokens per target forward (the prefill counted for both loops, since
transformers' first token comes from it), the speed-up of each over its own plain decoding and over transformers' plain
decoding, and whether every output equals plain greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from draftsmith_commands import REPO, train_unless_trained  # benchmarks/ is the script's directory, first on sys.path
from provenance import provenance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/bench_batch")
    parser.add_argument("--prompts", type=int, default=8, help="per domain")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    began = time.perf_counter()
    torch.set_num_threads(args.threads)
    from draftsmith.eval.loop import generate
    from draftsmith.eval.prompts import eos_ids_of, load_prompts
    from draftsmith.heads.base import load_drafter
    from draftsmith.recipe import load_recipe
    from draftsmith.target import TargetShape, load_target, load_tokenizer

    output_dir = (args.runs / "draft").resolve()
    trained_s = train_unless_trained(["recipe=draft"], output_dir)

    cfg = load_recipe(["recipe=draft", f"output_dir={output_dir}"])
    target, tokenizer = load_target(cfg.target), load_tokenizer(cfg.target)
    drafter = load_drafter(output_dir / "final", TargetShape.of(target, cfg.target.name_or_path), target).eval()
    assistant = drafter.model.eval()
    prompts = [
        p
        for domain in load_prompts(list(cfg.data.eval), tokenizer, args.prompts, int(cfg.data.max_length)).values()
        for p in domain
    ]
    eos_ids = eos_ids_of(target, tokenizer)
    hf_settings = {
        "max_new_tokens": args.new_tokens,
        "do_sample": False,
        "eos_token_id": sorted(eos_ids),
        "pad_token_id": tokenizer.pad_token_id,
    }
    fixed = {
        "num_assistant_tokens": args.gamma,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }

    def ours(prompt, proposer=None):
        return generate(target, prompt, args.new_tokens, proposer, args.gamma, eos_ids=eos_ids).tokens

    def theirs(prompt, **extra):
        out = target.generate(torch.tensor([prompt]), **hf_settings, **extra)[0, len(prompt) :].tolist()
        while out and out[-1] == tokenizer.pad_token_id and out[-1] not in eos_ids:  # right padding after EOS
            out.pop()
        return out

    proposer = drafter.proposer()
    ways = {
        "draftsmith_plain": lambda p: ours(p),
        "draftsmith_draft_model": lambda p: ours(p, proposer),
        "transformers_plain": lambda p: theirs(p),
        "transformers_assisted_fixed": lambda p: theirs(p, assistant_model=assistant, **fixed),
        "transformers_assisted_default": lambda p: theirs(p, assistant_model=assistant),
    }
    for way in ways.values():  # warm-up
        way(prompts[0][:32] if len(prompts[0]) > 32 else prompts[0])
    forwards = [0]  # target forwards, the prefill included (transformers' first token comes from it)
    target.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    seconds = dict.fromkeys(ways, 0.0)
    tokens = dict.fromkeys(ways, 0)
    calls = dict.fromkeys(ways, 0)
    same = dict.fromkeys(ways, 0)
    start = time.perf_counter()
    with torch.no_grad():
        for prompt in prompts:
            reference = None
            for name, way in ways.items():
                forwards[0], began = 0, time.perf_counter()
                out = way(prompt)
                seconds[name] += time.perf_counter() - began
                calls[name] += forwards[0]
                tokens[name] += len(out)
                reference = out if reference is None else reference
                same[name] += int(out == reference)
    rates = {name: tokens[name] / seconds[name] for name in ways}
    summary = {
        "prompts": len(prompts),
        "new_tokens_per_prompt": args.new_tokens,
        "gamma": args.gamma,
        "train_s": trained_s,
        "decode_wall_s": round(time.perf_counter() - start, 1),
        "tokens_per_s": {name: round(rate, 2) for name, rate in rates.items()},
        "tokens_per_target_forward_incl_prefill": {name: round(tokens[name] / calls[name], 3) for name in ways},
        "speedup_over_own_plain": {
            "draftsmith_draft_model": round(rates["draftsmith_draft_model"] / rates["draftsmith_plain"], 3),
            "transformers_assisted_fixed": round(rates["transformers_assisted_fixed"] / rates["transformers_plain"], 3),
            "transformers_assisted_default": round(
                rates["transformers_assisted_default"] / rates["transformers_plain"], 3
            ),
        },
        "speedup_over_transformers_plain": {
            name: round(rate / rates["transformers_plain"], 3) for name, rate in rates.items()
        },
        "equal_to_plain_greedy": {name: f"{same[name]}/{len(prompts)}" for name in ways},
    }
    print(json.dumps(summary | provenance(args.threads, began), indent=2))


if __name__ == "__main__":
    main()
