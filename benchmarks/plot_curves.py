"""Acceptance against training tokens for several runs on one plot: each run's held-out τ estimate
(`curve.json`, written by training with `train.heldout` and `train.eval_every`) over log training tokens,
with a horizontal line for a baseline τ (vLLM's n-gram, say).

    python benchmarks/plot_curves.py OUT.png "LABEL=path/to/curve.json" ... [--baseline "LABEL=TAU"]

Prints the plotted points as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402


def labelled(text: str) -> tuple[str, str]:
    label, sep, value = text.partition("=")
    if not sep or not label or not value:
        raise argparse.ArgumentTypeError(f"expected LABEL=VALUE, got {text!r}")
    return label, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output", type=Path)
    parser.add_argument("curves", nargs="+", type=labelled, help="LABEL=curve.json")
    parser.add_argument("--baseline", action="append", default=[], type=labelled, help="LABEL=TAU (a dashed line)")
    args = parser.parse_args()

    points = {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, path in args.curves:
        rows = json.loads(Path(path).read_text())["rows"]
        points[label] = [(row["tokens"], round(row["tau_est"], 4)) for row in rows]
        ax.plot(*zip(*points[label]), marker="o", label=label)
    for label, tau in args.baseline:
        ax.axhline(float(tau), linestyle="--", color="grey", label=label)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # the 2x10^5, 3x10^5, ... labels overlap
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out τ estimate (chain, γ 3, teacher-forced)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
