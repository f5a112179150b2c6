"""vLLM's acceptance next to draftsmith's for every exportable drafter, as JSON.

    python benchmarks/export_vllm.py --vllm-python /path/to/venv/bin/python [--runs runs/bench_drafters]
                                     [--only medusa,eagle3] [--prompts 8] [--new-tokens 64]

For each kind it takes the trained checkpoint `<runs>/<kind>/final` (benchmarks/drafters.py writes
them; a missing one is trained with the kind's recipe first), exports it for vLLM with
`export.vllm_python` under the recipe that trained it (`<runs>/<kind>/recipe.yaml`, so runs of another
benchmark export as they were trained: `--runs runs/bench_smollm2 --prompts 4` checks the SmolLM2
drafters of benchmarks/real_target.py against vLLM serving SmolLM2), and reports what the export
check measured on the eval prompts (4 domains x --prompts, greedy, γ of the recipe): vLLM's τ and
P(accepted >= k) next to draftsmith's on the same prompts and schedule, whether vLLM's output with the
drafter equals its output without it and draftsmith's, and the wall time of the check; then the machine, the
versions and the whole wall time (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from draftsmith_commands import REPO, run_python  # benchmarks/ is the script's directory, first on sys.path
from provenance import provenance
from vllm_probe import add_vllm_python

RECIPES = {
    "medusa": "medusa",
    "medusa2": "medusa2",
    "eagle": "eagle",
    "eagle3": "eagle3",
    "draft_tvd": "draft",
    "dflash": "dflash",
}
TRAIN_DATA = "demo/data/train.regenerated.jsonl.gz"  # what benchmarks/drafters.py trains on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/bench_drafters")
    parser.add_argument(
        "--only", type=lambda text: [name for name in text.split(",") if name], default=",".join(RECIPES)
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    # a run of another benchmark is exported under any name; one to train first, only under a recipe's
    untrained = [name for name in args.only if not (args.runs / name / "final" / "model.safetensors").is_file()]
    if unknown := [name for name in untrained if name not in RECIPES]:
        parser.error(
            f"--only: {', '.join(unknown)}: no trained run in {args.runs}, nor a recipe to train one "
            f"(one of {', '.join(RECIPES)})"
        )
    began = time.perf_counter()
    results = {}
    for name in args.only:
        run_dir = (args.runs / name).resolve()
        eval_settings = [
            f"output_dir={run_dir}",
            f"eval.max_prompts={args.prompts}",
            f"eval.max_new_tokens={args.new_tokens}",
        ]
        if not (run_dir / "final" / "model.safetensors").is_file():
            run_python(["train.py", f"recipe={RECIPES[name]}", f"data.train=[{TRAIN_DATA}]", *eval_settings])
        output = run_dir / "export"  # no 'eagle-'/'eagle3' in the run names: vLLM picks methods from paths
        wall = run_python(
            [
                "-m",
                "export",
                f"recipe={run_dir / 'recipe.yaml'}",  # the resolved recipe the checkpoint was trained with
                *eval_settings,
                f"checkpoint={run_dir / 'final'}",
                f"export.output={output}",
                f"export.vllm_python={args.vllm_python}",
                "export.overwrite=true",
            ]
        )
        verified = json.loads((output / "vllm" / "draftsmith_export.json").read_text())["verified"]
        results[name] = {key: verified[key] for key in ("engine_version", "prompts", "max_new_tokens",
                                                        "num_speculative_tokens", "tau_engine", "tau_draftsmith",
                                                        "relative_difference", "at_least_engine", "at_least_draftsmith",
                                                        "lossless", "equals_draftsmith_plain", "counters")}  # fmt: skip
        results[name]["export_and_check_wall_s"] = round(wall, 1)
    print(json.dumps({"drafters": results} | provenance(None, began), indent=2))  # threads: vLLM's own choice


if __name__ == "__main__":
    main()
