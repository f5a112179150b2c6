"""The package as a user installs it: a wheel built from this checkout holds every package, recipe,
engine script and the demo bundle (fast tier); installed into a fresh venv and run from a directory
outside the checkout, the console script trains the default recipe on the bundled demo and evaluates
the result, and `accelerate launch -m draftsmith train` trains on two processes (slow tier)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from this checkout."""
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
    (built,) = (root / "dist").glob("draftsmith-*.whl")
    return built


@pytest.mark.slow  # builds the wheel
def test_the_wheel_holds_every_package_its_data_and_the_console_script(wheel):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    names = set(zipfile.ZipFile(wheel).namelist())
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = settings["package-dir"]
    for package in settings["packages"]:  # every module of every package
        parent, _, last = package.rpartition(".")
        folder = REPO / folders[package] if package in folders else REPO / folders[parent] / last
        for module in folder.glob("*.py"):
            assert f"{package.replace('.', '/')}/{module.name}" in names, module
    for package, patterns in settings["package-data"].items():
        for pattern in patterns:
            found = list((REPO / folders[package]).glob(pattern))
            assert found and all(
                f"{package.replace('.', '/')}/{path.relative_to(REPO / folders[package])}" in names for path in found
            ), pattern
    assert {"draftsmith/engine_scripts/vllm_worker.py", "draftsmith/demo/target/model.safetensors"} <= names
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "draftsmith = draftsmith.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A venv holding only the built wheel; the heavy dependencies (torch, transformers, ...) come from
    this interpreter's site-packages through a plain path entry, which Python adds to sys.path without
    running the .pth files there, so the checkout's editable install is not visible inside. Without a pip of its
    own (ensurepip: 4 s of CPU): this interpreter's pip installs the wheel into it."""
    root = wheel.parent.parent
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index", str(wheel)],
        check=True,
    )
    return venv


def run_in(venv: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_the_wheel_runs_from_outside_the_checkout(installed, tmp_path):
    where = run_in(
        installed,
        [
            "python",
            "-c",
            "import draftsmith.heads, draftsmith.resources as r; print(draftsmith.heads.__file__); "
            "print(r.bundled('demo/target'))",
        ],
        tmp_path,
    )
    assert where.returncode == 0, where.stderr
    heads, demo = where.stdout.split()
    assert heads.startswith(str(installed)) and demo.startswith(str(installed)), where.stdout  # not the checkout
    bad = run_in(
        installed,
        ["draftsmith", "train", "recipe=medusa", "train.micro_batch_size=0", f"output_dir={tmp_path / 'bad'}"],
        tmp_path,
    )
    assert bad.returncode == 2 and bad.stderr.strip() == "error: train.micro_batch_size=0 must be >= 1"
    assert run_in(installed, ["draftsmith", "nope"], tmp_path).returncode == 2
    helped = run_in(installed, ["draftsmith", "export", "recipe=eagle3", "--help"], tmp_path)
    assert helped.returncode == 0 and "drafter.ttt_steps" in helped.stdout and "export.engines" in helped.stdout


@pytest.mark.slow
def test_the_wheel_trains_on_two_processes_then_evaluates(installed, tmp_path):
    """Multi-process training needs no checkout (`accelerate launch -m draftsmith train ...`), and its
    eval stage runs from the wheel too (the `draftsmith` command itself: the test above)."""
    launch = ["python", "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", "29517"]  # fmt: skip
    # the report's prompts from the bundled eval file, without the eval split's accuracy that nothing here reads
    quick = ["train.micro_batch_size=2", "data.max_conversations=8", "data.max_length=128", "eval.max_prompts=1",
             "eval.max_new_tokens=8", "data.eval=[]", "eval.data=[${bundled:demo/data/eval.jsonl.gz}]",
             f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    trained = run_in(
        installed,
        [*launch, "-m", "draftsmith", "train", "recipe=medusa", "train.max_steps=3", *quick,
         f"output_dir={tmp_path / 'ddp'}"],
        tmp_path,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "ddp" / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    report = json.loads((tmp_path / "ddp" / "eval" / "report.json").read_text())
    assert report["domains"]["all"]["chain"]["lossless"] is True and report["drafter"]["type"] == "medusa"
