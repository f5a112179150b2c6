"""The head-to-head's results (benchmarks/peer_speculators.py): draftsmith's own eval of each trainer's drafter
(`own_eval`, also benchmarks/peer_ablation.py's), the rows per trainer and MT-bench category (`report`), and,
with --own-defaults, what each trainer's defaults came to (`defaults_as_run`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from protocol_results import load_json, summarize  # benchmarks/, first on sys.path

REPO = Path(__file__).resolve().parent.parent


def own_eval(args, recipe: Path, checkpoint, out: Path, log: Path) -> None:
    """draftsmith's eval of `checkpoint` on MT-bench (chain, γ --depth, T = 0) -> <out>/eval/report.json;
    a failure is recorded in <out>/failed.txt, not raised: the eval may have no reader for a
    checkpoint another trainer saved."""
    if (out / "eval" / "report.json").is_file() or (out / "failed.txt").is_file():
        return
    command = [
        sys.executable, "-m", "eval", f"recipe={recipe}", f"output_dir={out}",
        f"checkpoint={checkpoint}", "eval.data=[named:mt_bench]", f"eval.max_prompts={args.prompts}",
        f"eval.max_new_tokens={args.new_tokens}", f"eval.num_speculative_tokens={args.depth}", "eval.tree=0",
        "eval.temperature=0",
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    )
    with open(log, "a") as written:
        written.write(f"\n$ {' '.join(command)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        cause = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        (out / "failed.txt").write_text(f"draftsmith's eval could not read {checkpoint}: {cause}")


def own_eval_taus(out: Path) -> dict:
    """τ per MT-bench category (and `all`) of `own_eval`'s report in `out`, or why it did not run."""
    if (out / "failed.txt").is_file():
        return {"not_run": (out / "failed.txt").read_text()}
    if not (out / "eval" / "report.json").is_file():
        return {"not_run": "the own-eval stage was not run"}
    report = json.loads((out / "eval" / "report.json").read_text())
    return {category: rows["chain"]["tau"] for category, rows in report["domains"].items()}


def report(args, runs: Path, trained: dict, timing: dict, by_category: dict) -> tuple[list[dict], dict]:
    """A row per trainer and MT-bench category (and `all`) of the prompts `by_category` the measure stage timed,
    and draftsmith's own eval of each trainer's drafter (`own_eval_taus`)."""
    rows, offset, ranges = [], 0, {}
    for category, prompts in by_category.items():
        ranges[category] = list(range(offset, offset + len(prompts)))
        offset += len(prompts)
    ranges["all"] = list(range(offset))
    own = {trainer: own_eval_taus(runs / trainer / "mtbench") for trainer in ("draftsmith", "speculators")}
    for category, indices in ranges.items():
        plain = [summarize(timing[name]["per_prompt"], indices)["tok_s"] for name in ("plain", "plain_rerun")]
        for trainer in ("speculators", "draftsmith"):
            measured = summarize(timing[trainer]["per_prompt"], indices)
            rows.append(
                {
                    "trainer": trainer,
                    "settings": trained[trainer]["settings"],
                    "category": category,
                    "train_tokens": trained[trainer]["train_tokens"],
                    "train_s": trained[trainer]["train_s"],
                    # on `threads` cores; the load average beside it in train.json says whether they were its own
                    "train_tokens_per_s_per_core": round(
                        trained[trainer]["train_tokens"] / trained[trainer]["train_s"] / args.threads, 1
                    ),
                    "tau": measured["tau"],
                    "acceptance_per_position": measured["acceptance_per_position"],
                    "tokens_per_forward": measured["tokens_per_forward"],
                    "tok_s": measured["tok_s"],
                    "plain_tok_s": plain,
                    "speedup": round(2 * measured["tok_s"] / sum(plain), 4),
                    "lossless": all(timing[trainer]["outputs"][i] == timing["plain"]["outputs"][i] for i in indices),
                    "own_eval_tau": own[trainer].get(category, own[trainer].get("not_run")),
                    "load_avg": {name: timing[name]["load_avg"] for name in ("plain", trainer, "plain_rerun")},
                }
            )
    return rows, own


def defaults_as_run(trained: dict) -> dict:
    """With --own-defaults, what each trainer's defaults came to, read from what it saved: the draft
    vocabulary, the depth, the draft layer's window and the optimizer steps."""
    from omegaconf import OmegaConf

    speculators, draftsmith = (
        Path(trained["speculators"]["checkpoint"]),
        Path(trained["draftsmith"]["checkpoint"]).parent,
    )
    folder = load_json(speculators / "config.json")
    layer = folder["transformer_layer_config"]
    windowed = "sliding_attention" in layer.get("layer_types", [])
    recipe = OmegaConf.load(draftsmith / "recipe.yaml")
    return {
        "speculators": {
            "draft_vocab_size": folder["draft_vocab_size"],
            "depth": folder["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
            "sliding_window": layer.get("sliding_window") if windowed else None,
            "steps": load_json(speculators / "training_state.json")["global_step"],
            "rows": "conversations packed into rows of 8,192 tokens (--total-seq-len), one row a step",
        },
        "draftsmith": {
            "draft_vocab_size": recipe.drafter.draft_vocab_size,
            "depth": recipe.drafter.ttt_steps,
            "sliding_window": recipe.drafter.sliding_window,
            "micro_batch_size": recipe.train.micro_batch_size,
            "optimizer": recipe.train.optimizer,
            "steps": load_json(draftsmith / "run_summary.json")["steps"],
        },
    }
