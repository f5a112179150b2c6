"""Compare drafters trained with the same budget on the same data, at T=0 and T=1, as JSON.

    python benchmarks/drafters.py [--steps 200] [--runs runs/bench_drafters] [--only medusa,eagle]
                                  [--train-data demo/data/train.regenerated.jsonl.gz]

Each drafter trains with `python train.py recipe=R train.max_steps=STEPS data.train=[DATA]` on the
bundled demo target (same data, steps, micro-batch, seed and eval settings; the T=0 eval runs at the
end of training), then `python -m eval` runs again on its final checkpoint at temperature 1. The
default data are the target's own answers (`python -m data_prep.regenerate`), which Medusa-2 needs
and every drafter benefits from; `medusa_corpus` trains Medusa-1 on the original corpus answers to
show what that is worth. Prints tau per domain for every drafter and method (chain, tree) plus the
n-gram baseline, the drafter's forward passes per target forward (a DFlash block or Medusa's heads:
one; an EAGLE chain of γ: γ), the share of lossless rows at T=0, and the wall time of training plus its
greedy eval; then the machine, the threads the runs train with, the versions and the whole wall time
(benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from draftsmith_commands import run_python  # benchmarks/ is the script's directory, first on sys.path
from names import names_of
from provenance import provenance

# name -> recipe overrides; every run also gets train.max_steps and its own output_dir.
DRAFTERS = {
    "medusa": ["recipe=medusa"],
    "medusa2": ["recipe=medusa2"],
    "eagle": ["recipe=eagle"],
    "eagle3": ["recipe=eagle3"],
    "dflash": ["recipe=dflash"],
    "draft_fkl": ["recipe=draft", "drafter.loss=fkl"],
    "draft_tvd": ["recipe=draft", "drafter.loss=tvd"],
    "draft_mix": ["recipe=draft", "drafter.loss=mix"],
    "medusa_corpus": ["recipe=medusa", "data.train=[demo/data/train.jsonl.gz]"],  # after data.train=[DATA]: wins
}
BASELINE_ONLY = {"plain", "original"}  # not drafting: tau is 1 by construction


def taus(report: dict) -> dict:
    rows = {d: {**report["domains"][d], **report["baselines"][d]} for d in report["domains"]}
    return {d: {m: row["tau"] for m, row in methods.items() if m not in BASELINE_ONLY} for d, methods in rows.items()}


def draft_forwards(report: dict) -> dict:
    """The drafter's forward passes per target forward, per method, over all domains."""
    return {m: row["draft_forwards_per_cycle"] for m, row in report["domains"]["all"].items()}


def training_threads() -> int:
    """The CPU threads `python train.py` runs with here (draftsmith/threads.py's rule, train.cpu_threads unset)."""
    import torch

    from draftsmith.threads import available_cores, choose_cpu_threads

    choice = choose_cpu_threads(None, os.environ, available_cores(), torch.cuda.is_available())
    return choice.threads or torch.get_num_threads()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--runs", default="runs/bench_drafters")
    parser.add_argument("--only", type=names_of(DRAFTERS), default=list(DRAFTERS))
    parser.add_argument("--train-data", default="demo/data/train.regenerated.jsonl.gz")
    args = parser.parse_args()
    names = args.only
    runs = Path(args.runs).resolve()
    began = time.perf_counter()

    results = {}
    for name in names:
        out = runs / name
        overrides = [DRAFTERS[name][0], f"data.train=[{args.train_data}]", *DRAFTERS[name][1:]]
        train_s = run_python(["train.py", *overrides, f"train.max_steps={args.steps}", f"output_dir={out}"])
        greedy = json.loads((out / "eval" / "report.json").read_text())
        run_python(
            [
                "-m",
                "eval",
                f"recipe={out / 'recipe.yaml'}",
                f"checkpoint={out / 'final'}",
                "eval.temperature=1.0",
                f"output_dir={out / 'sampled'}",
            ]
        )
        sampled = json.loads((out / "sampled" / "eval" / "report.json").read_text())
        lossless = [row["lossless"] for d in greedy["domains"] for row in greedy["domains"][d].values()]
        results[name] = {
            "verifier": greedy.get("verifier", "target"),
            "train_and_greedy_eval_wall_s": round(train_s, 1),
            "tau_T0": taus(greedy),
            "tau_T1": taus(sampled),
            "draft_forwards_per_cycle_T0": draft_forwards(greedy),
            "lossless_T0": f"{sum(map(bool, lossless))}/{len(lossless)}",
            # adapted verifiers (Medusa-2): share of prompts where plain greedy decoding still gives the original
            # target's tokens
            "original_same_output_T0": greedy["baselines"]["all"].get("original", {}).get("same_output"),
        }
    report = {"steps": args.steps, "train_data": args.train_data, "drafters": results}
    print(json.dumps(report | provenance(training_threads(), began), indent=2))
    print(markdown(results), file=sys.stderr)


def markdown(results: dict) -> str:
    """One tau table per temperature: a column per drafter and method, then the n-gram baseline."""
    tables = []
    for key, title in (("tau_T0", "T = 0 (greedy)"), ("tau_T1", "T = 1 (exact speculative sampling)")):
        columns = [
            (name, method) for name, r in results.items() for method in ("chain", "tree") if method in r[key]["all"]
        ]
        first = next(iter(results.values()))[key]
        header = [f"{name} {method}" for name, method in columns] + ["n-gram"]
        lines = [title, "", "| domain | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
        for domain in first:
            cells = [results[name][key][domain][method] for name, method in columns] + [first[domain]["ngram"]]
            lines.append(f"| {domain} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


if __name__ == "__main__":
    main()
