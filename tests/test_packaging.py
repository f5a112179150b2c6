"""The package as a user installs it: a wheel built from this checkout, installed into a fresh venv,
run from a directory outside the checkout — the console script trains the default recipe on the
bundled demo (recipes and demo data are package data) and evaluates the result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding only the built wheel; the heavy dependencies (torch, transformers, ...) come from
    this interpreter's site-packages through a plain path entry, which Python adds to sys.path without
    running the .pth files there, so the checkout's editable install is not visible inside."""
    root = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root / "dist"),
            str(REPO),
        ],
        check=True,
    )
    (wheel,) = (root / "dist").glob("draftsmith-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    return venv


def run_in(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


def test_the_wheel_trains_and_evaluates_from_outside_the_checkout(installed, tmp_path):
    where = run_in(
        installed,
        [
            "python",
            "-c",
            "import draftsmith.heads, draftsmith.resources as r; print(draftsmith.heads.__file__); print(r.bundled('demo/target'))",
        ],
        tmp_path,
    )
    assert where.returncode == 0, where.stderr
    heads, demo = where.stdout.split()
    assert heads.startswith(str(installed)) and demo.startswith(str(installed)), where.stdout  # not the checkout

    quick = ["train.max_steps=5", "train.micro_batch_size=2", "data.max_conversations=8", "data.max_length=128",
             "eval.max_prompts=1", "eval.max_new_tokens=8", f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    trained = run_in(
        installed, ["draftsmith", "train", "recipe=medusa", *quick, f"output_dir={tmp_path / 'run'}"], tmp_path
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    report = json.loads((tmp_path / "run" / "eval" / "report.json").read_text())
    assert report["domains"]["all"]["chain"]["lossless"] is True

    evaluated = run_in(
        installed,
        [
            "draftsmith",
            "eval",
            "recipe=medusa",
            f"drafter.path={tmp_path / 'run' / 'final'}",
            *quick,
            f"output_dir={tmp_path / 'eval'}",
        ],
        tmp_path,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "eval" / "report.json").read_text())["drafter"]["type"] == "medusa"

    bad = run_in(
        installed,
        ["draftsmith", "train", "recipe=medusa", "train.micro_batch_size=0", f"output_dir={tmp_path / 'bad'}"],
        tmp_path,
    )
    assert bad.returncode == 2 and bad.stderr.strip() == "error: train.micro_batch_size=0 must be >= 1"
    assert run_in(installed, ["draftsmith", "nope"], tmp_path).returncode == 2


def test_the_wheel_trains_on_two_processes_and_answers_help(installed, tmp_path):
    """Multi-process training needs no checkout: `accelerate launch -m draftsmith train ...`."""
    launch = ["python", "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
              "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517"]  # fmt: skip
    quick = [
        "train.max_steps=3",
        "train.micro_batch_size=2",
        "data.max_conversations=8",
        "data.max_length=128",
        "eval.enabled=false",
    ]
    trained = run_in(
        installed,
        [*launch, "-m", "draftsmith", "train", "recipe=medusa", *quick, f"output_dir={tmp_path / 'ddp'}"],
        tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    helped = run_in(installed, ["draftsmith", "export", "recipe=eagle3", "--help"], tmp_path)
    assert helped.returncode == 0 and "drafter.ttt_steps" in helped.stdout and "export.engines" in helped.stdout
