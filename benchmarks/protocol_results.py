"""What the standard protocol (benchmarks/standard_protocol.py) and the head-to-head with speculators
(benchmarks/peer_speculators.py) make of their measurements: each stage's JSON, written atomically and read back
on a resumed run, and its wall time; a vLLM timing's rows summed over prompts (`summarize`); the held-out curve's
extrapolation (`log_linear_fit`); the speed-up chart (`plot_timing`)."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path


def load_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def save_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def stage_timer(walls_path: Path):
    """`timed(name, stage, *args)`: run a stage, adding its wall time to `walls_path` under `name`
    (kept across resumed runs)."""
    walls = load_json(walls_path)

    def timed(name: str, stage, *stage_args):
        start = time.perf_counter()
        value = stage(*stage_args)
        walls[name] = round(walls.get(name, 0) + time.perf_counter() - start, 1)
        save_json(walls_path, walls)
        return value

    return timed


def summarize(per_prompt: list[dict], indices: list[int]) -> dict:
    seconds = sum(per_prompt[i]["seconds"] for i in indices)
    tokens = sum(per_prompt[i]["tokens"] for i in indices)
    drafts = sum(per_prompt[i]["metrics"]["num_drafts"] for i in indices)
    accepted = sum(per_prompt[i]["metrics"]["num_accepted_tokens"] for i in indices)
    positions = [per_prompt[i]["metrics"]["accepted_per_position"] for i in indices]
    width = max(map(len, positions), default=0)
    per_position = [sum(p[k] for p in positions if k < len(p)) for k in range(width)]
    return {
        "tok_s": round(tokens / seconds, 3),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tau": round(1 + accepted / drafts, 4) if drafts else None,
        # vLLM's τ counts only the steps that drafted, and n-gram lookup drafts only where it finds a
        # match; tokens per target forward (each decoding step's forward gives 1 + its accepted tokens,
        # the prefill gives each prompt's first token) compares every method on the same footing
        "tokens_per_forward": round((tokens - len(indices)) / (tokens - len(indices) - accepted), 4),
        "drafts": drafts,
        "acceptance_per_position": [round(a / drafts, 4) for a in per_position] if drafts else [],
    }


def log_linear_fit(rows: list[dict], goals: tuple[float, ...] = (2.30, 2.8)) -> dict:
    """tau_est = a + b ln(tokens) through the held-out evaluations after warm-up (all but the first),
    and the training tokens at which the line reaches each goal (n-gram's τ in vLLM on MT-bench, and
    the issue's target). A guide to the budget, not a measurement: acceptance curves flatten, and one
    cosine schedule's decay bends the last points."""
    if len(rows) < 4:
        return {}
    slope, intercept = statistics.linear_regression(
        [math.log(row["tokens"]) for row in rows[1:]], [row["tau_est"] for row in rows[1:]]
    )
    return {
        "fit": "tau_est = a + b ln(tokens), held-out evaluations after the first",
        "a": round(intercept, 4),
        "b": round(slope, 4),
        "tokens_to_reach": {
            str(goal): round(math.exp((goal - intercept) / slope)) if slope > 0 else None for goal in goals
        },
    }


def plot_timing(rows: list[dict], path: Path, drafters: dict[str, str]) -> None:
    """Speed-up over plain decoding per MT-bench category, one bar per method (timing.png); an imported
    drafter's name in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(row["category"] for row in rows))
    methods = [m for m in dict.fromkeys(row["method"] for row in rows) if m != "plain"]
    speedup = {(row["method"], row["category"]): row["speedup"] for row in rows}
    width = 0.8 / max(len(methods), 1)
    figure, axes = plt.subplots(figsize=(10, 4))
    for index, method in enumerate(methods):
        xs = [i + index * width for i in range(len(categories))]
        axes.bar(xs, [speedup[(method, c)] for c in categories], width, label=method)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([i + width * (len(methods) - 1) / 2 for i in range(len(categories))], categories)
    axes.set_ylabel("tokens/s over plain (same run)")
    named = "".join(f", {kind} = {name}" for kind, name in drafters.items())
    axes.set_title(f"vLLM-CPU, SmolLM2-135M, MT-bench first turns, batch size 1, greedy{named}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
