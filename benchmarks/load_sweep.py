"""The load sweep of several drafters side by side, as docs/serving-load.md measured it: `draftsmith sweep`'s
measurement (export/sweep.py: the rows, their format; export/sweep_results.py: the summary) on MT-bench,
plus what only this comparison needs: several drafters, the schedules served and repeated rounds.

    python benchmarks/load_sweep.py --vllm-python <venv>/bin/python --drafter eagle3.1=runs/load/eagle3
        [--drafter NAME=RUN_DIR ...] [--out docs/results/load_sweep] [--concurrency 1,2,4,8,16,32]
        [--gammas 1,2,3,4,5] [--new-tokens 64] [--requests-per-slot 2] [--min-requests 8] [--threads 2]
        [--repeats 3] [--stages sweep,schedule,repeat,report]

The target is the drafters' (each RUN_DIR holds the recipe.yaml train.py saved and a checkpoint in
best/ or final/; relative paths are read from the current directory); the prompts are MT-bench's 80
first turns in order, reused round-robin; float32. Unlike `draftsmith sweep`, each method at one γ is
served by an engine process of its own (vLLM alone on the machine, OMP threads --threads). Methods:
plain decoding, vLLM's n-gram proposer at every γ, vLLM's suffix decoding once (its own length per
step, up to 24; the prompt's tree only, as in `draftsmith sweep`: the prompts repeat; the --vllm-python
must have arctic-inference) and each drafter (its export, written to RUN_DIR/export_load first, and
again when the checkpoint there changed) at every γ, and at γ 0 (loaded with a schedule that drafts at
no batch size).

Stages, each resumable (a row already in <out>/sweep.jsonl is not measured again; a drafter's rows only for
the checkpoint its RUN_DIR holds now, their source_sha256: rows of another are refused in one line, exit 2,
before anything is measured, as `draftsmith sweep` refuses them; give such a drafter another --out or NAME; and
rows that record another load, --new-tokens or --threads say, are refused alike):
1. sweep: the rows for every (method, γ, concurrency), then plain once more (`plain-rerun`);
2. schedule: per drafter, `python -m export ... export.batch_sweep=<out>/sweep.jsonl` into
   RUN_DIR/export_scheduled (export/schedule.py chooses K per batch-size range), then that export served
   with its schedule at every concurrency (method `<name>+schedule`); the same rule applied to the
   n-gram rows, served as `ngram+schedule`; a schedule refused because speculation pays nowhere is
   noted in <out>/schedule_notes.json;
3. repeat: --repeats rounds, each serving in turn plain, then per drafter the drafter at γ 0 and the
   drafter with its schedule, every concurrency, into <out>/repeats.jsonl (rows as in sweep.jsonl plus
   `round`; speedup over the same round's plain). A shared machine's speed drifts by more than the few
   percent at stake between γ 0, the schedule and plain; measured side by side and repeated, their
   ratios can be told from that drift;
4. report: <out>/summary.json (export/sweep_results.py's summary; the schedule against every fixed γ; `repeated`:
   per method and concurrency the median, lowest and highest ratio over the same round's plain) and
   <out>/speedup.png.

A row is export/sweep.py's (its docstring lists the fields).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from names import names_of
from provenance import provenance  # benchmarks/, first on sys.path
from vllm_probe import add_vllm_python

from draftsmith.engines import NGRAM, SUFFIX, require_suffix_decoding
from draftsmith.errors import UserError
from draftsmith.export.free_methods import ngram_config, suffix_config
from draftsmith.export.sweep import Load, read_rows, round_robin, served_at
from draftsmith.export.sweep_results import PLAIN, PLAIN_AGAIN, plot, summarize
from draftsmith.export.verify import EngineSession
from draftsmith.files import checkpoint_digest

REPO = Path(__file__).resolve().parent.parent
STAGES = ("sweep", "schedule", "repeat", "report")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_vllm_python(parser)
    parser.add_argument("--drafter", action="append", default=[], help="NAME=RUN_DIR (repeatable)")
    parser.add_argument("--out", default="docs/results/load_sweep")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--gammas", default="1,2,3,4,5")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", type=names_of(STAGES), default=",".join(STAGES))
    args = parser.parse_args()
    began = time.perf_counter()
    try:  # before anything is written
        stages = args.stages
        if "sweep" in stages:  # the sweep serves suffix decoding
            require_suffix_decoding(args.vllm_python, "--vllm-python")
        out, drafters = paths(args.out, args.drafter)
        digests = {name: checkpoint_digest(checkpoint_of(run_dir)) for name, run_dir in drafters.items()}
        sweep, repeats = out / "sweep.jsonl", out / "repeats.jsonl"
        require_same_checkpoints([sweep, repeats], digests)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    out.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    target = recipe_of(next(iter(drafters.values())))["target"]
    load = Load(
        python=args.vllm_python,
        target=target,
        prompts=mt_bench_prompts(target),
        new_tokens=args.new_tokens,
        requests_per_slot=args.requests_per_slot,
        min_requests=args.min_requests,
        threads=args.threads,
        dtype="float32",
        max_model_len=2048,
        drafter={},  # each drafter is served with its checkpoint's own settings
    )
    try:
        require_same_load([sweep, repeats], load.settings())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)

    def measure(method: str, gamma: int, speculative_config, source: str | None = None, round_: int | None = None):
        """Rows of one method at one γ at every concurrency not yet measured: in sweep.jsonl, or with
        `round_` in repeats.jsonl (speed-up over that round's plain, outputs checked against the sweep's)."""
        path = sweep if round_ is None else repeats
        done = {(r["method"], r["gamma"], r["concurrency"], r.get("round")) for r in read_rows(path)}
        missing = [c for c in levels if (method, gamma, c, round_) not in done]
        if not missing:
            return
        print(f"{method} γ={gamma}{f' round {round_}' if round_ else ''}: concurrency {missing}", file=sys.stderr)
        plain = {r["concurrency"]: r for r in read_rows(sweep) if r["method"] == PLAIN}
        with EngineSession({"OMP_NUM_THREADS": str(args.threads)}) as session:  # an engine process per method
            rows = load.rows(session, method, gamma, speculative_config, source, missing, plain)
        if round_ is not None:  # speed-up over this round's plain (1 for plain), outputs against the sweep's
            same_round = {r["concurrency"]: r["tok_s"] for r in read_rows(repeats)
                          if (r["method"], r["round"]) == (PLAIN, round_)}  # fmt: skip
            for row in rows:
                row |= {
                    "round": round_,
                    "speedup": round(row["tok_s"] / same_round.get(row["concurrency"], row["tok_s"]), 4),
                }
        with path.open("a") as out_rows:
            out_rows.writelines(json.dumps(row) + "\n" for row in rows)

    if "sweep" in stages:
        measure(PLAIN, 0, None)
        for gamma in gammas:
            measure(NGRAM, gamma, ngram_config(gamma))
        prompt_trees = suffix_config(cached_answers=0)
        measure(SUFFIX, prompt_trees["num_speculative_tokens"], prompt_trees)
        for name, run_dir in drafters.items():
            at_gamma, source = fixed_configs(run_dir, digests[name], levels)
            measure(name, 0, at_gamma(0), source)
            for gamma in gammas:
                measure(name, gamma, at_gamma(gamma), source)
        measure(PLAIN_AGAIN, 0, None)  # plain once more, last: the schedule's margin is at least this noise
    notes_path = out / "schedule_notes.json"
    if "schedule" in stages:
        from draftsmith.errors import ExportCheckFailed
        from draftsmith.export.schedule import batch_schedule

        notes = {}
        try:  # vLLM's n-gram proposer takes a schedule too: the same rule, applied to its rows
            ngram = batch_schedule(read_rows(sweep), NGRAM)
            notes[NGRAM] = {"schedule": ngram["num_speculative_tokens_per_batch_size"]}
            config = {
                **ngram_config(ngram["num_speculative_tokens"]),
                "num_speculative_tokens_per_batch_size": ngram["num_speculative_tokens_per_batch_size"],
            }
            measure("ngram+schedule", ngram["num_speculative_tokens"], config)
        except ExportCheckFailed as refused:
            notes[NGRAM] = {"refused": str(refused)}
        for name, run_dir in drafters.items():
            folder, refused = export(run_dir, digests[name], "export_scheduled", sweep, refusable=True)
            if folder is None:
                notes[name] = {"refused": refused}
                continue
            gamma, config, source = scheduled_config(folder)
            notes[name] = {"schedule": config["num_speculative_tokens_per_batch_size"]}
            measure(f"{name}+schedule", gamma, config, source)
        notes_path.write_text(json.dumps(notes, indent=2) + "\n")
    if "repeat" in stages:  # side by side, in rounds: what a drafter loaded at γ 0 and its schedule cost against plain
        served = []  # (method, γ, config, source), each drafter at γ 0, then with its schedule where one was exported
        for name, run_dir in drafters.items():
            at_gamma, source = fixed_configs(run_dir, digests[name], levels)
            served.append((name, 0, at_gamma(0), source))
            folder = run_dir / "export_scheduled" / "vllm"
            if made_from(folder, digests[name], sweep):  # none where the schedule was refused
                gamma, config, source = scheduled_config(folder)
                served.append((f"{name}+schedule", gamma, config, source))
        for round_ in range(1, args.repeats + 1):
            measure(PLAIN, 0, None, round_=round_)
            for method, gamma, config, source in served:
                measure(method, gamma, config, source, round_)
    if "report" in stages:
        rows = read_rows(sweep)
        summary = summarize(rows, [NGRAM, SUFFIX, *drafters])
        summary["schedules"] = schedules_against_fixed(rows, [NGRAM, *drafters])
        dashed = {f"{name} with its γ schedule": {c: v["vs_plain"] for c, v in schedule["per_concurrency"].items()}
                  for name, schedule in summary["schedules"].items()}  # fmt: skip
        plot(summary["best_per_concurrency"], dashed, out / "speedup.png")
        if repeats.is_file():
            summary["repeated"] = repeated(read_rows(repeats))
        summary["schedule_notes"] = json.loads(notes_path.read_text()) if notes_path.is_file() else {}
        summary |= {
            "settings": {
                k: getattr(args, k)
                for k in ("concurrency", "gammas", "new_tokens", "requests_per_slot", "min_requests")
            },
            "prompts": "MT-bench first turns (80), in order, reused round-robin",
            **provenance(args.threads, began),  # threads: the engine's (OMP_NUM_THREADS); wall_s: this invocation's
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))


def paths(out: str, specs: list[str]) -> tuple[Path, dict[str, Path]]:
    """--out and each --drafter's RUN_DIR by NAME, relative ones read from the current directory."""
    drafters = {}
    for spec in specs:
        name, _, run_dir = spec.partition("=")
        if not name or not run_dir:
            raise UserError(f"--drafter {spec!r}: give NAME=RUN_DIR")
        drafters[name] = Path(run_dir).resolve()
    if not drafters:
        raise UserError("give at least one --drafter NAME=RUN_DIR")
    return Path(out).resolve(), drafters


def require_same_checkpoints(files: list[Path], digests: dict[str, str]) -> None:
    """Rows resume only for the checkpoint they measured: a drafter's rows (NAME and NAME+schedule) in
    `files` recorded under another sha256 than its RUN_DIR's checkpoint has now are refused, as `draftsmith
    sweep` refuses a sweep of another checkpoint; they would be kept as this checkpoint's otherwise."""
    for path in files:
        for row in read_rows(path):
            name = row["method"].removesuffix("+schedule")
            if name in digests and row.get("source_sha256") != digests[name]:
                raise UserError(
                    f"{path} holds rows of {name} from another checkpoint (sha256 {str(row.get('source_sha256'))[:12]}"
                    f", its RUN_DIR's is {digests[name][:12]} now); give another --out, or another NAME"
                )


# Load.settings' names -> the flag that sets them here; the others (target, dtype, prompts) follow the drafters
LOAD_FLAGS = {
    "new_tokens": "--new-tokens",
    "requests_per_slot": "--requests-per-slot",
    "min_requests": "--min-requests",
    "threads": "--threads",
}


def require_same_load(files: list[Path], settings: dict) -> None:
    """Rows resume only for the load they measured (as `draftsmith sweep` refuses, export/sweep_checks.py): a row
    that records other settings would be summarized as this run's. Rows from before the settings were recorded
    are taken as they are."""
    for path in files:
        for row in read_rows(path):
            differing = [name for name, value in row.get("load", settings).items() if settings.get(name) != value]
            if differing:
                name = differing[0]
                fix = f"{LOAD_FLAGS[name]} {row['load'][name]}" if name in LOAD_FLAGS else f"the same {name}"
                raise UserError(
                    f"{path} holds rows measured with {name}={row['load'][name]}, this run's is {settings.get(name)}: "
                    f"give {fix} to resume them, or another --out"
                )


def made_from(folder: Path, digest: str, sweep: Path | None = None) -> bool:
    """Whether `folder` holds an export of the checkpoint `digest` (with `sweep`: scheduled from its rows)."""
    record = folder / "draftsmith_export.json"
    if not record.is_file():
        return False
    info = json.loads(record.read_text())
    return info["source"]["sha256"] == digest and (
        sweep is None or (info.get("batch_schedule") or {}).get("sweep") == str(sweep)
    )


def fixed_configs(run_dir: Path, digest: str, levels: list[int]) -> tuple[Callable[[int], dict], str]:
    """The drafter's export (RUN_DIR/export_load) as a served config at a given γ (export/sweep.py's
    served_at: γ 0 loaded with a schedule that drafts nowhere), and its checkpoint's sha256."""
    folder, _ = export(run_dir, digest, "export_load")
    info = json.loads((folder / "draftsmith_export.json").read_text())
    return (lambda gamma: served_at(folder, gamma, levels)), info["source"]["sha256"]


def scheduled_config(folder: Path) -> tuple[int, dict, str]:
    """An export written with a schedule: its largest γ, its served config, its checkpoint's sha256."""
    info = json.loads((folder / "draftsmith_export.json").read_text())
    return (
        int(info["num_speculative_tokens"]),
        {**info["speculative_config"], "model": str(folder)},
        info["source"]["sha256"],
    )


def recipe_of(run_dir: Path) -> dict:
    from draftsmith.recipe import load_recipe

    cfg = load_recipe([f"recipe={run_dir / 'recipe.yaml'}", f"output_dir={run_dir}"])
    return {"target": str(cfg.target.name_or_path)}


def checkpoint_of(run_dir: Path) -> Path:
    for name in ("best", "final"):
        if (run_dir / name / "model.safetensors").is_file():
            return run_dir / name
    raise UserError(f"{run_dir} holds no checkpoint (best/ or final/)")


def export(
    run_dir: Path, digest: str, folder: str, sweep: Path | None = None, refusable: bool = False
) -> tuple[Path | None, str]:
    """RUN_DIR/<folder>/vllm, exported (`python -m export` under the run's own recipe; with `sweep`, its
    γ per batch size from those rows) unless it holds this checkpoint's export already (of those rows):
    one of another is moved aside by the export (export.overwrite) and written again. With `refusable`,
    a failed check (exit 3: the schedule found speculation paying nowhere) is returned as (None, its
    message) instead of ending the benchmark."""
    output = run_dir / folder
    if not made_from(output / "vllm", digest, sweep):
        command = [sys.executable, "-m", "export", f"recipe={run_dir / 'recipe.yaml'}",
                   f"checkpoint={checkpoint_of(run_dir)}", f"export.output={output}", f"output_dir={run_dir}",
                   "export.overwrite=true", *([f"export.batch_sweep={sweep}"] if sweep else [])]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if refusable and done.returncode == 3:
            return None, done.stderr.strip().splitlines()[-1]
        if done.returncode != 0:
            sys.exit(f"export into {output} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    return output / "vllm", ""


def mt_bench_prompts(target: str) -> list[list[int]]:
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.target import load_tokenizer

    return round_robin(load_prompts(["named:mt_bench"], load_tokenizer(target), 10, 1024))


def schedules_against_fixed(rows: list[dict], methods: list[str]) -> dict:
    """Per method served with its schedule (`<name>+schedule` rows): against every fixed γ and plain, per
    concurrency and summed over them."""
    levels = sorted({r["concurrency"] for r in rows})
    schedules = {}
    for name in methods:
        scheduled = {r["concurrency"]: r for r in rows if r["method"] == f"{name}+schedule"}
        if not scheduled:
            continue
        fixed = {  # γ 0 is plain decoding, without the drafter; its γ-0 rows (loaded, drafting nowhere) apart
            gamma: {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == name and r["gamma"] == gamma}
            for gamma in sorted({r["gamma"] for r in rows if r["method"] == name and r["gamma"] > 0})
        }
        fixed[0] = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == PLAIN}
        loaded_off = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == name and r["gamma"] == 0}
        per_level = {}
        for c in levels:
            if c not in scheduled:
                continue
            best_fixed = max(fixed, key=lambda g: fixed[g].get(c, 0.0))
            per_level[c] = {
                "schedule_tok_s": scheduled[c]["tok_s"],
                "best_fixed_gamma": best_fixed,
                "best_fixed_tok_s": fixed[best_fixed][c],
                "vs_best_fixed": round(scheduled[c]["tok_s"] / fixed[best_fixed][c], 4),
                "vs_plain": scheduled[c]["speedup"],
                "lossless": scheduled[c]["lossless"],
            }
        totals = {g: sum(fixed[g].get(c, 0.0) for c in per_level) for g in fixed}
        schedules[name] = {
            "per_concurrency": per_level,
            "summed_tok_s": {
                "schedule": round(sum(v["schedule_tok_s"] for v in per_level.values()), 2),
                **{f"gamma_{g}": round(t, 2) for g, t in totals.items()},
                **(
                    {"gamma_0_drafter_loaded": round(sum(loaded_off.get(c, 0.0) for c in per_level), 2)}
                    if loaded_off
                    else {}
                ),
            },  # fmt: skip
            "within_3pct_of_best_fixed_everywhere": all(v["vs_best_fixed"] >= 0.97 for v in per_level.values()),
            "never_3pct_below_plain": all(v["vs_plain"] >= 0.97 for v in per_level.values()),
        }
    return schedules


def repeated(rows: list[dict]) -> dict:
    """The repeat stage's rounds: per method (and γ) and concurrency, the ratio of its tok/s over the
    same round's plain, as median, lowest and highest over the rounds; plain's own spread is its rounds
    over their median. `never_3pct_below_plain` reads the medians."""
    plain = {(r["round"], r["concurrency"]): r["tok_s"] for r in rows if r["method"] == PLAIN}
    levels = sorted({c for _, c in plain})
    speeds = {c: [v for (_, level), v in plain.items() if level == c] for c in levels}
    result: dict = {
        "rounds": len({r for r, _ in plain}),
        "plain_spread": {c: [round(min(v) / statistics.median(v), 4), round(max(v) / statistics.median(v), 4)]
                         for c, v in speeds.items()},
    }  # fmt: skip
    for method, gamma in sorted({(r["method"], r["gamma"]) for r in rows if r["method"] != PLAIN}):
        name = method if method.endswith("+schedule") else f"{method} at gamma {gamma}"
        per_level = {}
        for c in levels:
            ratios = [r["tok_s"] / plain[r["round"], c] for r in rows
                      if (r["method"], r["gamma"], r["concurrency"]) == (method, gamma, c)
                      and (r["round"], c) in plain]  # fmt: skip
            if ratios:
                per_level[c] = {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                                "max": round(max(ratios), 4)}  # fmt: skip
        lossless = all(r["lossless"] for r in rows if (r["method"], r["gamma"]) == (method, gamma))
        result[name] = {"over_plain": per_level, "lossless": lossless,
                        "never_3pct_below_plain": all(v["median"] >= 0.97 for v in per_level.values())}  # fmt: skip
    return result


if __name__ == "__main__":
    main()
