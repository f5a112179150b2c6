#!/usr/bin/env bash
# The README's first command on a fresh machine, timed: a clean clone of this repository, a new virtual
# environment, pip with no cache (every package downloaded, and DeepSpeed, published only as a source
# distribution, built), then the main job. Prints one JSON object: install and run wall times, the threads
# the run used (from its eval report), the machine, and the load average before and after (time it alone).
#
#     bash benchmarks/fresh_install.sh [WORK_DIR]        (default: a new temporary directory, removed after)
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$work"' EXIT
load_before=$(cut -d' ' -f1 /proc/loadavg)
git clone -q "$repo" "$work/draftsmith"
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
cd "$work/draftsmith"
export PIP_NO_CACHE_DIR=1
start=$(date +%s.%N)
pip install -q "torch==2.13.0" -e ".[dev]" > "$work/install.log" 2>&1 || { tail -20 "$work/install.log"; exit 1; }
installed=$(date +%s.%N)
accelerate launch train.py recipe=medusa > "$work/run.log" 2>&1 || { tail -20 "$work/run.log"; exit 1; }
finished=$(date +%s.%N)
python3 - "$start" "$installed" "$finished" "$load_before" "$work/run.log" <<'PY'
import json, os, platform, subprocess, sys
from pathlib import Path

start, installed, finished, load_before = map(float, sys.argv[1:5])
run_log = Path(sys.argv[5]).read_text().splitlines()
report = json.loads(Path("runs/medusa/eval/report.json").read_text())
print(json.dumps({
    "command": 'pip install "torch==2.13.0" -e ".[dev]" && accelerate launch train.py recipe=medusa',
    "pip_cache": "none (PIP_NO_CACHE_DIR=1, new virtual environment, fresh clone)",
    # where pip may find packages besides PyPI (a machine's find-links can hold prebuilt wheels)
    "pip_config": subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout.splitlines(),
    "install_s": round(installed - start, 1),
    "run_s": round(finished - installed, 1),
    "cpu_threads": report.get("cpu_threads"),
    "cores": os.cpu_count(),
    "machine": platform.processor() or platform.machine(),
    "python": platform.python_version(),
    "load_average_before": load_before,
    "load_average_after": float(Path("/proc/loadavg").read_text().split()[0]),
    "result_line": next((line.strip() for line in reversed(run_log) if "Result:" in line), None),
}, indent=2))
PY
