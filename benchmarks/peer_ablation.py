"""Why speculators' EAGLE-3 led the demo-scale head-to-head (#38): draftsmith's EAGLE-3.1 trained again
with one of speculators' defaults at a time, on the same conversations for the same training tokens,
each scored by draftsmith's own eval on MT-bench (chain, γ = --depth, T = 0), and speculators'
checkpoint scored by the same eval, with speculators' own trainer run again with one of its flags
changed (`--speculators-variants`: AdamW instead of Muon). JSON rows, one per variant, resumable (a
variant whose eval report exists is not run again); the committed result and what it says:
docs/comparing.md.

    python benchmarks/peer_ablation.py [--variants base,steps,...] [--speculators-variants speculators-adamw] [--seed N]
        [--runs runs/peer_ablation] [--speculators runs/peer_speculators/speculators/1]
        [--out docs/results/peer_speculators/ablation.jsonl]

--speculators is the checkpoint benchmarks/peer_speculators.py's speculators run wrote (<its --runs>/speculators/
<epochs - 1>; the default is where docs/comparing.md's command writes it) beside its train_command.txt, which the
speculators variants run again; it is scored with the recipe of this ablation's `base` run. A checkpoint that is
not there is one line, exit 2, before anything trains; --speculators "" scores draftsmith's variants only.

The shared settings are benchmarks/peer_speculators.py's demo pair: recipe eagle3 with EAGLE-3.1's
norms, the demo target's own answers (1,000 conversations, 2 epochs), taps [0, 1, 2] (vLLM 1, 2, 3),
draft vocabulary 2,048, 3 training-time-test steps. A variant adds recipe overrides; its row says
which speculators default it copies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from peer_results import own_eval, own_eval_taus  # benchmarks/, first on sys.path
from peer_speculators import SPECULATORS_PYTHON, run
from provenance import provenance

REPO = Path(__file__).resolve().parent.parent
SHARED = [
    "recipe=eagle3", "drafter.fc_norm=true", "drafter.norm_output=true", "drafter.ttt_steps=3",
    "drafter.draft_vocab_size=2048", f"data.train=[{REPO / 'demo/data/train.regenerated.jsonl.gz'}]",
    "data.max_conversations=1000", "train.epochs=2", "train.max_steps=-1", "train.heldout=0",
    "train.eval_every=0", "eval.enabled=false", "data.eval=[]",
]  # fmt: skip
# speculators 0.9.0 packs conversations into rows of --total-seq-len tokens, one row per optimizer
# step: 1,814 steps for these 2 epochs, against draftsmith's 250 at 8 conversations per step.
ONE_PER_STEP = ["train.micro_batch_size=1"]
VARIANTS = {
    "base": ([], "the head-to-head's draftsmith run: 8 conversations per step (250 steps)"),
    "steps": (ONE_PER_STEP, "one conversation per step (2,000 steps), near speculators' 1,814"),
    "residual": (
        ["drafter.norm_before_residual=true"],
        "the residual taken after hidden_norm (speculators' norm_before_residual true), at 8 conversations per step",
    ),
    "steps+decay1": (
        [*ONE_PER_STEP, "drafter.ttt_decay=1.0"],
        "and every training-time-test step weighted equally (speculators' ttt_step_loss_decay 1.0)",
    ),
    "steps+residual": (
        [*ONE_PER_STEP, "drafter.norm_before_residual=true"],
        "and the residual taken after hidden_norm (speculators' norm_before_residual true)",
    ),
    "steps+norm_fc": (
        [*ONE_PER_STEP, "drafter.fc_norm=false", "drafter.norm_before_fc=true"],
        "and one RMSNorm over the concatenated taps instead of one per tap (speculators' norm_before_fc)",
    ),
    "steps+wd": (
        [*ONE_PER_STEP, "train.weight_decay=0.01"],
        "and AdamW weight decay 0.01 (speculators' AdamW group)",
    ),
    "steps+residual+muon": (
        [*ONE_PER_STEP, "drafter.norm_before_residual=true", "train.optimizer=muon"],
        "and the residual after hidden_norm, and Muon on the hidden matrices (speculators' optimizer)",
    ),
    "residual+muon": (
        ["drafter.norm_before_residual=true", "train.optimizer=muon"],
        "the residual after hidden_norm and Muon, at 8 conversations per step",
    ),
    "speculators-defaults": (
        [
            *ONE_PER_STEP,
            "drafter.fc_norm=false",
            "drafter.norm_before_fc=true",
            "drafter.norm_before_residual=true",
            "drafter.ttt_decay=1.0",
            "train.weight_decay=0.01",
        ],
        "every speculators default draftsmith has but Muon: its architecture, loss weights and weight decay",
    ),
    # speculators' draft layer attends to a sliding window (2,048 positions, longer than these
    # conversations); narrower windows, on top of the best variant above
    **{
        f"steps+residual+muon+window{window}": (
            [
                *ONE_PER_STEP,
                "drafter.norm_before_residual=true",
                "train.optimizer=muon",
                f"drafter.sliding_window={window}",
            ],
            f"and a draft layer attending to the last {window} positions only (speculators' layer type, narrower)",
        )
        for window in (4, 32)
    },
}


# speculators' trainer again on the head-to-head's data with one of its defaults changed (its own
# flags), to test a default draftsmith does not have: its Muon optimizer.
SPECULATORS_VARIANTS = {
    "speculators-adamw": (
        ["--optimizer", "adamw"],
        "speculators with AdamW (lr 1e-3, weight decay 0.01) instead of Muon",
    ),
}


def speculators_missing(speculators: Path | None, args, runs: Path) -> str | None:
    """Why the speculators rows asked for cannot be scored (None when they can, or none were asked for)."""
    if speculators is None:
        return None
    if not (speculators / "model.safetensors").is_file():
        return (
            f"--speculators {args.speculators}: no speculators checkpoint there (model.safetensors); run "
            "benchmarks/peer_speculators.py first (it writes <its --runs>/speculators/<epochs - 1>), pass the "
            "checkpoint it wrote, or --speculators '' to score draftsmith's variants only"
        )
    if args.speculators_variants and not (speculators.parent / "train_command.txt").is_file():
        return (
            f"--speculators {args.speculators}: no train_command.txt beside it to run speculators' variants "
            f"({args.speculators_variants}) again; pass --speculators-variants ''"
        )
    trains_base = "base" in args.variants.split(",") and not args.seed  # into runs/base
    if not trains_base and not (runs / "base" / "recipe.yaml").is_file():
        return (
            f"--speculators is scored with the recipe of the base variant, and {runs / 'base'} holds none: add base "
            "to --variants (at --seed 0)"
        )
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--runs", type=Path, default=REPO / "runs/peer_ablation")
    parser.add_argument(
        "--speculators",
        default=REPO / "runs/peer_speculators/speculators/1",
        help="speculators' checkpoint of the head-to-head, scored by the same eval ('': none)",
    )
    parser.add_argument("--speculators-variants", default=",".join(SPECULATORS_VARIANTS))
    parser.add_argument("--out", type=Path, default=REPO / "runs/peer_speculators/ablation.jsonl")
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=10, help="MT-bench first turns per category (10 = all 80)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--seed", type=int, default=0, help="train.seed of draftsmith's runs (not 0: runs/<variant>@seed<N>)"
    )
    args = parser.parse_args()
    began = time.perf_counter()
    runs = args.runs.resolve()
    speculators = Path(args.speculators).resolve() if args.speculators else None  # not type=Path: '' would be '.'
    missing = speculators_missing(speculators, args, runs)
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        sys.exit(2)
    runs.mkdir(parents=True, exist_ok=True)
    log, rows, threads = runs / "ablation.log", [], {"OMP_NUM_THREADS": str(args.threads)}
    for name in args.variants.split(","):
        overrides, why = VARIANTS[name]
        if args.seed:  # another draw of the same variant: its initialization and data order
            overrides = [*overrides, f"train.seed={args.seed}"]
        out = runs / (f"{name}@seed{args.seed}" if args.seed else name)
        train = out / "train.json"
        if not train.is_file():
            seconds = run([sys.executable, "train.py", *SHARED, *overrides, f"output_dir={out}"], log, threads)
            train.write_text(json.dumps({"train_s": round(seconds, 1)}))
        steps = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
        last = [row for row in steps if "train/tokens" in row][-1]
        own_eval(args, out / "recipe.yaml", out / "final", out / "mtbench", log)
        tau = own_eval_taus(out / "mtbench")
        rows.append({"variant": name, "seed": args.seed, "overrides": overrides, "copies": why, "steps": last["step"],
                     "train_tokens": last["train/tokens"], **json.loads(train.read_text()),
                     "own_eval_tau": tau})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    if speculators is not None:
        own_eval(args, runs / "base" / "recipe.yaml", speculators, runs / "speculators" / "mtbench", log)
        tau = own_eval_taus(runs / "speculators" / "mtbench")
        rows.append({"variant": "speculators", "checkpoint": str(speculators), "own_eval_tau": tau})
        print(json.dumps(rows[-1]), flush=True)
        # its trainer's command, as the head-to-head ran it (benchmarks/peer_speculators.py)
        command = (speculators.parent / "train_command.txt").read_text().splitlines()[-1].split()
        for name, (flags, why) in SPECULATORS_VARIANTS.items():
            if name not in args.speculators_variants.split(","):
                continue
            out = runs / name
            final = out / str(int(command[command.index("--epochs") + 1]) - 1)  # named by 0-based epoch
            if not (final / "model.safetensors").is_file():
                moved = list(command)
                moved[command.index("--save-path") + 1] = str(out)
                moved[command.index("--log-dir") + 1] = str(out / "logs")
                seconds = run([str(SPECULATORS_PYTHON), *moved, *flags], log, threads)
                (out / "train.json").write_text(json.dumps({"train_s": round(seconds, 1)}))
            own_eval(args, runs / "base" / "recipe.yaml", final, out / "mtbench", log)
            tau = own_eval_taus(out / "mtbench")
            rows.append({"variant": name, "flags": flags, "copies": why, **json.loads((out / "train.json").read_text()),
                         "own_eval_tau": tau})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    out = args.out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    where = provenance(args.threads, began)  # the same for every row; wall_s: this invocation's
    out.write_text("".join(json.dumps(row | where) + "\n" for row in rows))


if __name__ == "__main__":
    main()
