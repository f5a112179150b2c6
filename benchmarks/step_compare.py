"""Training throughput of this tree against an earlier commit's, side by side in one run, as JSON.

    python benchmarks/step_compare.py [--baseline 624d976 | --baseline-dir DIR] [--rounds 2]
                                      [--current-extra "ARGS"] -- ARGS...

ARGS go to `benchmarks/train_throughput.py` of both trees unchanged, `--current-extra` (one string) to this
tree's alone (options the baseline's script lacks, e.g. "--profile-steps 2") (e.g. `--shape smollm2-135m --seq 256
--batch 2 --kinds eagle3 --threads 1`). The baseline is the commit's package laid out as a wheel installs it
(`draftsmith/` with `heads/`, `trainer/`, ... inside) in a temporary folder that goes first on PYTHONPATH,
with that commit's own benchmark script: each tree times its own step with its own harness. `--baseline-dir`
takes such a folder made earlier (`--make-baseline DIR` writes one and exits: a device machine has no git).

The trees run alternately, `--rounds` times each (baseline first), each in its own process; every run's JSON
lines are printed as they come, tagged `"tree": "baseline"` or `"current"`, then one summary line per kind:
the median tokens/s of each tree, the speed-up (current / baseline), the peak memory of each and each tree's
losses. The losses are not compared: the two harnesses may draw the synthetic rows in different orders (the
trainer's seeded shuffle, the earlier copy's file order); equal numerics are the tests' to prove
(tests/test_eagle3.py against the straightforward reference). Alternating and taking medians is what makes
a shared machine's figures comparable; say the machine's load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The installed package's layout (pyproject.toml [tool.setuptools.package-dir]): folder -> subpackage. The
# demo bundle (12 MiB) stays out: a --shape run builds its own target, and a device call carries 64 MiB.
STAGES = ("data_prep", "heads", "trainer", "eval", "export", "monitor", "recipes")
# The benchmark and the module it imports (commits before the shared provenance fields have no provenance.py)
SCRIPTS = ("benchmarks/train_throughput.py", "benchmarks/provenance.py")


def has_file(commit: str, path: str) -> bool:
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}:{path}"], capture_output=True)
    return found.returncode == 0


def make_baseline(commit: str, destination: Path) -> Path:
    """`commit`'s package and throughput benchmark under `destination`, laid out as installed."""
    scripts = [script for script in SCRIPTS if has_file(commit, script)]
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", commit, "draftsmith", *STAGES, *scripts],
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        shutil.copytree(Path(tmp) / "draftsmith", destination / "draftsmith")
        for stage in STAGES:
            shutil.copytree(Path(tmp) / stage, destination / "draftsmith" / stage)
        (destination / "benchmarks").mkdir()
        for script in scripts:
            shutil.copy(Path(tmp) / script, destination / "benchmarks")
    (destination / "COMMIT").write_text(commit + "\n")
    return destination


def run_tree(tree: str, script: Path, pythonpath: str | None, args: list[str]) -> list[dict]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-3000:])
        raise SystemExit(f"{tree}: {script} exited {result.returncode}")
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    for row in rows:
        row["tree"] = tree
        print(json.dumps(row), flush=True)
    return rows


def peak(row: dict):
    return row.get("peak_memory_mb", row.get("peak_rss_mb"))


def summary(kind: str, baseline: list[dict], current: list[dict], commit: str) -> dict:
    trees = {"baseline": baseline, "current": current}
    rates = {tree: statistics.median(row["tokens_per_s"] for row in rows) for tree, rows in trees.items()}
    return {
        "summary": kind,
        "baseline_commit": commit,
        "tokens_per_s": rates,
        "speedup": round(rates["current"] / rates["baseline"], 3),
        "peak_memory_mb": {tree: max(peak(row) or 0 for row in rows) for tree, rows in trees.items()},
        "losses": {"baseline": baseline[0].get("losses"), "current": current[0].get("losses")},
        "runs_each": len(current),
        "device": current[0].get("device"),
        "threads": current[0].get("threads"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="624d976", help="the commit to compare with (needs git)")
    parser.add_argument("--baseline-dir", type=Path, help="a folder --make-baseline wrote")
    parser.add_argument("--make-baseline", type=Path, metavar="DIR", help="write the baseline folder and exit")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating")
    parser.add_argument("--current-extra", default="", help="arguments for this tree's script only, one string")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then train_throughput.py's arguments")
    options = parser.parse_args()
    if options.rounds < 1:
        parser.error(f"--rounds {options.rounds}: at least 1 run of each tree")
    script = options.baseline_dir / "benchmarks" / "train_throughput.py" if options.baseline_dir else None
    if script and not script.is_file():
        parser.error(
            f"--baseline-dir {options.baseline_dir}: no {script.relative_to(options.baseline_dir)} there "
            "(--make-baseline DIR writes one)"
        )
    if options.make_baseline:
        print(make_baseline(options.baseline, options.make_baseline))
        return
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    with tempfile.TemporaryDirectory() as tmp:
        folder = options.baseline_dir or make_baseline(options.baseline, Path(tmp) / "baseline")
        commit = (folder / "COMMIT").read_text().strip() if (folder / "COMMIT").is_file() else str(folder)
        runs = {"baseline": [], "current": []}
        for _ in range(options.rounds):
            runs["baseline"] += run_tree("baseline", folder / "benchmarks" / "train_throughput.py", str(folder), args)
            current = [*args, *shlex.split(options.current_extra)]
            runs["current"] += run_tree("current", REPO / "benchmarks" / "train_throughput.py", None, current)
    for kind in dict.fromkeys(row["kind"] for row in runs["current"]):
        pick = {tree: [r for r in rows if r["kind"] == kind] for tree, rows in runs.items()}
        if pick["baseline"]:
            print(json.dumps(summary(kind, pick["baseline"], pick["current"], commit)), flush=True)


if __name__ == "__main__":
    main()
