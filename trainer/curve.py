"""Acceptance against training tokens: the held-out evaluations of a run (train.heldout,
train.eval_every; trainer/loop.py) as `curve.json` and `curve.png` in its output directory.

A row is one evaluation: `step`, `tokens` (training tokens consumed so far, all ranks), `tau_est` and
`top1` (the drafter's teacher-forced top-1 per depth, metric name -> value, depth 1 first). curve.json
also holds `best`, the evaluation kept in best/. `plot_curves` draws one run or several (a benchmark
comparing drafters or data) from rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

from draftsmith.errors import InternalError
from draftsmith.files import save_figure_atomic, write_text_atomic

CURVE_JSON = "curve.json"
CURVE_PNG = "curve.png"


def depth_top1(metrics: Mapping[str, float], max_depth: int, template: str) -> list[tuple[str, float]]:
    """(name, value) of the per-depth top-1 metrics in `metrics`, named by `template` as the run's kind
    reports them (its `Drafter.DEPTH_TOP1`), depth 1 first: consecutive depths from 1, at most `max_depth`
    (the chain length evaluated), fewer when the drafter reports fewer. A kind whose loss reports no depth 1 under
    its template is a bug of the kind's: its held-out τ estimate would be 1 at every evaluation, and best/ and
    train.patience would follow that constant."""
    found = []
    for depth in range(1, max_depth + 1):
        name = template.format(depth=depth)
        if name not in metrics:
            break
        found.append((name, float(metrics[name])))
    if not found:
        raise InternalError(
            f"the drafter's loss reports no {template.format(depth=1)} (its Drafter.DEPTH_TOP1, {template!r}), only "
            f"{', '.join(sorted(metrics))}: name its per-depth top-1 statistics by DEPTH_TOP1"
        )
    return found


def chain_tau(top1: Sequence[float]) -> float:
    """Tokens per target forward of a greedy chain whose depth-i draft is accepted with probability
    top1[i-1] given depths < i were: 1 + sum_k prod_{i<=k} a_i (the target's own token always counts)."""
    tau, accepted = 1.0, 1.0
    for rate in top1:
        accepted *= rate
        tau += accepted
    return tau


def write_curve(
    output_dir: Path, rows: Sequence[Mapping[str, Any]], best: Optional[Mapping] = None, png: bool = True
) -> None:
    """`curve.json` (and with `png`, `curve.png`) in `output_dir`, each replaced atomically."""
    payload = {"best": best, "rows": [dict(row) for row in rows]}
    write_text_atomic(output_dir / CURVE_JSON, json.dumps(payload, indent=2) + "\n")
    if png and rows:
        plot_curves({output_dir.name: rows}, output_dir / CURVE_PNG)


def plot_curves(runs: Mapping[str, Sequence[Mapping[str, Any]]], path: Path, title: Optional[str] = None) -> None:
    """Left: tau_est against training tokens, one line per run, a star on its best evaluation;
    right: teacher-forced top-1 per depth against training tokens (a colour per run, a line style
    per depth). `runs`: label -> rows (curve.json's `rows`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    styles = ["-", "--", ":", "-."]
    several = len(runs) > 1
    for color, (label, rows) in enumerate(runs.items()):
        tokens = [row["tokens"] for row in rows]
        left.plot(tokens, [row["tau_est"] for row in rows], color=f"C{color}", marker="o", label=label)
        if rows:  # the evaluation best/ keeps (the first of equals, as train keeps it)
            best = max(rows, key=lambda row: row["tau_est"])
            left.plot([best["tokens"]], [best["tau_est"]], "*", color=f"C{color}", markersize=14)
        top1 = [list(row["top1"].values()) for row in rows]
        for k in range(max(map(len, top1), default=0)):
            values = [rates[k] if k < len(rates) else float("nan") for rates in top1]
            name = f"{label} depth {k + 1}" if several else f"depth {k + 1}"
            right.plot(
                tokens,
                values,
                styles[k % len(styles)],
                color=f"C{color if several else k}",
                marker="o",
                markersize=3,
                label=name,
            )
    left.set_xlabel("training tokens")
    left.set_ylabel("τ estimate (tokens per target forward)")
    left.set_title("teacher-forced acceptance estimate")
    left.legend(fontsize="small")
    right.set_ylim(0, 1)
    right.set_xlabel("training tokens")
    right.set_ylabel("teacher-forced top-1")
    right.set_title("held-out top-1 per depth")
    right.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    save_figure_atomic(fig, path)
