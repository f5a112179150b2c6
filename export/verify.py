"""The proof of an export: load the folder in the real vLLM, as the speculative model for the target,
on the eval prompts, and compare with draftsmith's own decoding of the same prompts.

Passes when (a) vLLM's greedy output with the drafter equals its output without it, which equals draftsmith's
plain greedy output, token for token in float32; in bfloat16 the engines round differently and a near tie flips,
so there a prompt whose outputs part passes only where the parting is such a flip: the target's own logits (as
draftsmith runs it) at the common prefix put the two tokens within NEAR_TIE_UNITS (eval/partings.py) units of
bfloat16 at the logits' magnitude (`partings` in the summary for vLLM with against without the drafter,
`plain_partings` for vLLM's plain output against draftsmith's: a parting beyond a near tie there means vLLM serves
another target than the one draftsmith evaluated); the rest of such a prompt is not compared; (b) vLLM's counters
show accepted draft tokens (where draftsmith's own decoding accepted none either, the line says the drafter is
undertrained); (c) vLLM's τ (1 + accepted / drafts) is within `export.tolerance` (relative) of draftsmith's chain
τ at the same γ. A drafter the engine reads differently from how it was trained (a missing `norm_before_residual`,
layer ids off by one, dropped biases) stays lossless but accepts less, and fails (c).

vLLM runs in its own Python environment (`export.vllm_python`): its pinned torch and transformers
need not match draftsmith's. The engine side is draftsmith/engine_scripts/vllm_worker.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig

from draftsmith.engines import VllmWorker, vllm_context, vllm_distribution
from draftsmith.errors import ExportCheckFailed, UserError
from draftsmith.eval.counts import Counts
from draftsmith.eval.loop import generate_batch
from draftsmith.eval.partings import BF16_UNIT, parting
from draftsmith.eval.prompts import eos_ids_of, load_prompts, prompt_sources
from draftsmith.families import reads_in_order
from draftsmith.formats import Source
from draftsmith.formats.repo import EngineRepo, served_dtype, target_arguments
from draftsmith.formats.versions import VLLM_PYTHON_KEY
from draftsmith.heads.proposer import DraftState, DraftTree, Proposer, Tree
from draftsmith.hub_cache import hub_snapshot
from draftsmith.target import load_tokenizer

ENGINE_TIMEOUT_S = 1800


class EngineSession:
    """The vLLM work of one caller, explicitly: one VllmWorker per vLLM Python (vLLM is imported once
    for every check of the session; a worker that failed, or ended after an engine that left it unable to start
    another (vLLM's n-gram proposer), is replaced by a new one at the next request) and the target's plain greedy
    runs already made, in vLLM and in draftsmith's loop (checking several drafters of one target runs
    the target alone once in each).
    `export_checkpoint` opens one per export unless its caller passes one in to share (a benchmark or a
    test session exporting many drafters); nothing is kept between sessions. A context manager:
    leaving it ends the workers. `env` goes over the workers' environment (the load sweep's OpenMP threads)."""

    def __init__(self, env: Optional[dict[str, str]] = None):
        # One OpenMP thread unless the job sets its own: on a small CPU machine two spin against each other.
        self.env = env or {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        self.workers: dict[str, VllmWorker] = {}
        self.plain_runs: dict[str, dict[str, Any]] = {}
        self.draftsmith_plain: dict[str, list[list[int]]] = {}

    def run(self, python: str, request: dict[str, Any], doing: str = "serve the export") -> dict[str, Any]:
        """The reply to the "runs" request `request` (see draftsmith/engine_scripts/vllm_worker.py) under
        `python`: ExportCheckFailed when vLLM answers that it failed, EngineUnavailable when it gives no
        answer; `doing` says what the request is for in either's line."""
        return self.worker(python).ask({"runs": request}, doing)

    def served_as(self, python: str, config: dict[str, Any]) -> Optional[dict[str, Any]]:
        """How the vLLM of `python` reads a draft folder holding `config` as its config.json (the worker's
        "served_as" request), asked of the worker that then runs the check: vLLM imported once for both."""
        return self.worker(python).ask({"served_as": {"config": config}}, "read the draft config")["read"]

    def worker(self, python: str) -> VllmWorker:
        """The session's worker under `python`, a new one where it has none running."""
        worker = self.workers.get(python)
        if worker is None or not worker.running:
            worker = self.workers[python] = VllmWorker(
                python,
                VLLM_PYTHON_KEY,
                env=self.env,
                show_log=False,
                refusal=ExportCheckFailed,
                timeout_s=ENGINE_TIMEOUT_S,
            )
        return worker

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.workers.clear()

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def draftsmith_side(
    source: Source,
    prompts: list[list[int]],
    max_new_tokens: int,
    gamma: int,
    eos_ids: frozenset[int],
    plain: Optional[list[list[int]]] = None,
) -> dict[str, Any]:
    """Plain greedy decoding (unless `plain` holds its tokens already) and the drafter's greedy chain,
    in draftsmith's loop, on vLLM's schedule: vLLM takes the first new token from the prefill and
    drafts after it, so the chain here decodes each prompt with its first greedy token appended (the
    same draft positions, the same counts). The prompts are decoded together, as vLLM serves them
    (a batch decodes as each prompt alone: tests/test_batched_eval.py)."""
    proposer = source.drafter.proposer()
    verifier = proposer.verifier or source.target_model
    if plain is None:
        plain = [generation.tokens for generation in generate_batch(verifier, prompts, max_new_tokens, eos_ids=eos_ids)]
    drafted = [
        prompt + tokens[:1] for prompt, tokens in zip(prompts, plain) if len(tokens) > 1 and tokens[0] not in eos_ids
    ]
    proposers = [proposer] + [source.drafter.proposer() for _ in drafted[1:]]  # one a sequence: each holds its state
    scheduled = [
        VllmScheduled(proposer, len(prompt) + max_new_tokens - 1, len(prompt) - 1, eos_ids)
        for proposer, prompt in zip(proposers, drafted)
    ]
    counts = Counts()
    for generation in generate_batch(verifier, drafted, max_new_tokens - 1 + gamma, scheduled, gamma):
        counts.add(generation.counts)
    drafts = max(counts.reached[0] if counts.reached else 0, 1)  # cycles that drafted: vLLM's num_drafts
    return {
        "plain": plain,
        "tau": 1 + counts.accepted / drafts,  # vLLM's mean acceptance length
        # P(accepted >= k), vLLM's per-position rate, for k = 1..γ as vLLM counts it: the loop's counters end
        # at the deepest position a cycle reached (a chain stops at its first rejection), none accepted beyond
        "at_least": [accepted / drafts for accepted in counts.accepted_at] + [0.0] * (gamma - len(counts.accepted_at)),
    }


class VllmScheduled:
    """A sequence's proposer as vLLM drafts for it at the end of a request: a whole chain at every step that begins
    before the request has its max_tokens or an EOS (vLLM drafts no shorter one there), and none after (vLLM has
    finished it). vLLM counts what such a last step accepted past max_tokens or past the EOS before it cuts the
    output (`Scheduler.update_from_output`), so the loop runs up to γ tokens past its budget, with no EOS of its own
    (`eos_ids` end the drafting here), and its counters hold vLLM's. Cut at the loop's budget and EOS, they read
    less: a drafter that is the target had τ 3.75 at γ 3 on 16 tokens (vLLM: 4), and the Medusa-2 demo folder's
    check 1.454 against vLLM's 1.457 (1.457 now). `stop_at`: the sequence's length with max_tokens; `prompt`: its
    length before the request's first token."""

    def __init__(self, proposer: Proposer, stop_at: int, prompt: int, eos_ids: frozenset[int] = frozenset()):
        self.proposer, self.stop_at, self.prompt, self.eos_ids = proposer, stop_at, prompt, eos_ids

    def __getattr__(self, name: str) -> Any:  # everything but `propose` is the proposer's
        return getattr(self.proposer, name)

    def propose(self, state: DraftState, num_tokens: int, tree: Optional[Tree] = None) -> DraftTree:
        ended = bool(self.eos_ids) and not self.eos_ids.isdisjoint(state.tokens[self.prompt :].tolist())
        if len(state.tokens) >= self.stop_at or ended:
            return DraftTree.chain(state.tokens.new_empty(0))
        return self.proposer.propose(state, num_tokens, tree)


def verify_in_vllm(
    cfg: DictConfig,
    source: Source,
    repo: EngineRepo,
    folder: Path,
    served: dict[str, Any],
    session: EngineSession,
) -> dict[str, Any]:
    """Check the staged vLLM `folder` in the engine (see the module docstring) under `served`, the
    export's speculative config less `model`; the summary that goes into draftsmith_export.json and
    the model card; ExportCheckFailed (exit 3) saying what failed, or EngineUnavailable (exit 69) when
    the engine died before it answered. A γ per batch size in `served` is checked in a second run on
    the same prompts, all at once: the engine must take it as written and stay lossless; τ is compared
    at the fixed γ, since the schedule changes γ with the batch."""
    tokenizer = load_tokenizer(cfg.target)
    sources, per_file = prompt_sources(cfg)  # the eval report's prompts
    if not sources:
        raise UserError("export.vllm_python checks the export on the eval prompts: set eval.data or data.eval")
    by_domain = load_prompts(
        sources, tokenizer, int(cfg.eval.max_prompts), int(cfg.data.max_length), cfg.data.skip_invalid_utf8, per_file
    )
    prompts = [prompt for domain in by_domain.values() for prompt in domain]
    max_new = int(cfg.eval.max_new_tokens)
    gamma = int(served["num_speculative_tokens"])
    served_target_dir = folder / "target" if (folder / "target").is_dir() else served_target(cfg)
    limit = int(source.target.config.get("max_position_embeddings") or 4096)
    request = {
        "target": str(served_target_dir),
        "prompts": prompts,
        "max_tokens": max_new,
        "max_model_len": min(limit, vllm_context(prompts, max_new, gamma)),  # a schedule's γs are at most this one
        # both loops run the target in the dtype it was loaded in (target.dtype), the one the folder's serving
        # command names: vLLM's CPU kernels for some layers (Gated DeltaNet) take bfloat16 only
        "dtype": served_dtype(source.target_model),
        "trust_remote_code": source.target.trust_remote_code,  # the target's own code, as draftsmith ran it
    }
    # as the folder's serving command serves the target (formats/repo.py vllm_serve_flags): checked so too
    request |= target_arguments(reads_in_order(source.target_model.config), served_target_dir, repo.target_overrides)
    request |= repo.engine_arguments
    # the served target's files and the request: what both loops' plain runs depend on (a drafter that
    # verifies with a target of its own, Medusa-2's adapted one, serves that target from its folder)
    plain_key = json.dumps([cfg.export.vllm_python, stamp(Path(served_target_dir)), request])
    own_key = plain_key  # the request names the dtype draftsmith's loop runs the target in, as loaded
    eos_ids = eos_ids_of(source.target_model, tokenizer)
    ours = draftsmith_side(source, prompts, max_new, gamma, eos_ids, session.draftsmith_plain.get(own_key))
    session.draftsmith_plain.setdefault(own_key, ours["plain"])
    speculative = {**served, "model": str(folder / repo.weights_dir)}
    schedule = speculative.pop("num_speculative_tokens_per_batch_size", None)
    request["runs"] = [{"name": "speculative", "speculative_config": speculative}]
    if schedule is not None:
        request["runs"].append(
            {
                "name": "scheduled",
                "speculative_config": {**speculative, "num_speculative_tokens_per_batch_size": schedule},
            }
        )
    if plain_key not in session.plain_runs:
        request["runs"].insert(0, {"name": "plain", "speculative_config": None})
    engine = session.run(cfg.export.vllm_python, request)
    engine["runs"]["plain"] = session.plain_runs.setdefault(plain_key, engine["runs"].get("plain"))
    partings = plain_partings = None  # float32: every parting fails
    if source.target_model.dtype != torch.float32:
        verifier = source.drafter.proposer().verifier or source.target_model
        plain = engine["runs"]["plain"]["outputs"]
        partings = parting_gaps(verifier, prompts, engine["runs"]["speculative"]["outputs"], plain)
        # the target vLLM serves against the one draftsmith evaluated (Medusa-2's: merged from the adapters it ran)
        plain_partings = parting_gaps(verifier, prompts, plain, ours["plain"])
    summary = compare(engine, ours, gamma, float(cfg.export.tolerance), len(prompts), max_new, partings, plain_partings)
    resolved = engine["runs"]["scheduled" if schedule is not None else "speculative"]
    summary["engine_settings"] = {"vllm_version": engine["vllm_version"], **resolved["engine_settings"]}
    summary["engine_build"] = vllm_distribution(cfg.export.vllm_python, VLLM_PYTHON_KEY)  # the card's command
    # what the check ran vLLM with besides the speculative config, for the model card to state
    summary["engine_arguments"] = {
        key: request[key]
        for key in (
            "dtype",
            "max_model_len",
            "enable_prefix_caching",
            "language_model_only",
            "hf_overrides",
            "disable_hybrid_kv_cache_manager",
        )
        if key in request
    }
    if schedule is not None:
        summary["schedule"] = check_schedule(engine, schedule)
    return summary


def parting_gaps(
    model, prompts: list[list[int]], outputs: list[list[int]], reference: list[list[int]]
) -> list[dict[str, Any]]:
    """Each prompt whose greedy output in `outputs` parts from the one in `reference` (vLLM's with the drafter
    from its own without, or its plain output from draftsmith's), the gap in `model`'s logits (eval/partings.py, in
    bfloat16's units: the engine computes in it)."""
    return [
        {"prompt": index, **parting(model, prompt, ours, theirs, BF16_UNIT)}
        for index, (prompt, theirs, ours) in enumerate(zip(prompts, outputs, reference))
        if theirs != ours
    ]


def parting_problem(problem: str, partings: Optional[list[dict[str, Any]]]) -> list[str]:
    """The check's one rule for two greedy outputs that should agree: `problem` where they part, unless every
    parting is a bfloat16 near tie (`partings`, parting_gaps'; None in float32, where any parting fails)."""
    far = [parting for parting in partings or [] if not parting["near_tie"]]
    if partings is not None and not far:
        return []
    if far:
        where = f"{far[0]['units']} units" if "units" in far[0] else "one output ends there"
        problem += (
            f" on {len(far)} prompt(s) not at a bfloat16 near tie (prompt {far[0]['prompt']}, token "
            f"{far[0]['position']}: {where})"
        )
    return [problem]


def check_schedule(engine: dict[str, Any], schedule: list[list[int]]) -> dict[str, Any]:
    """The run with the γ per batch size: taken as written, and lossless."""
    run = engine["runs"]["scheduled"]
    taken = run["engine_settings"].get("num_speculative_tokens_per_batch_size")
    result = {
        "lossless": run["outputs"] == engine["runs"]["plain"]["outputs"],
        "taken_as": taken,
        "counters": run["metrics"],
    }
    if taken != schedule:
        raise ExportCheckFailed(f"vLLM {engine['vllm_version']} resolved the γ per batch size {schedule} as {taken}")
    if not result["lossless"]:
        raise ExportCheckFailed(
            f"export check in vLLM {engine['vllm_version']} failed: with the γ per batch size {schedule}, vLLM's "
            "greedy output differs from its output without the drafter"
        )
    return result


def stamp(directory: Path) -> list:
    """What identifies a target folder's contents cheaply: its files' names, sizes and mtimes."""
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir() if p.is_file())


def served_target(cfg: DictConfig) -> str:
    """The folder the check's engine loads the target from: a local target's, or a Hub id's snapshot in the Hub cache
    at the commit draftsmith read it at (the files its load fetched; the card names the id at that commit)."""
    name = cfg.target.name_or_path
    if Path(name).is_dir():
        return str(Path(name).resolve())
    snapshot = hub_snapshot(name, cfg.target.revision)
    if snapshot is None:
        raise UserError(f"the engine check reads the target's files, and the Hub cache holds none of {name!r}")
    return str(snapshot)


def compare(
    engine: dict[str, Any],
    ours: dict[str, Any],
    gamma: int,
    tolerance: float,
    prompts: int,
    max_new: int,
    partings: Optional[list[dict[str, Any]]] = None,
    plain_partings: Optional[list[dict[str, Any]]] = None,
) -> dict[str, Any]:
    """The check's verdict; in bfloat16 `partings`: where vLLM's outputs with and without the drafter part,
    `plain_partings`: where its plain outputs part from draftsmith's (parting_gaps); None: both loops ran in
    float32, where outputs must agree token for token."""
    plain, speculative = engine["runs"]["plain"], engine["runs"]["speculative"]
    counters = speculative["metrics"]
    drafts, accepted = counters["num_drafts"], counters["num_accepted_tokens"]
    tau = 1 + accepted / drafts if drafts else None
    summary = {
        "engine": "vllm",
        "engine_version": engine["vllm_version"],
        "prompts": prompts,
        "max_new_tokens": max_new,
        "num_speculative_tokens": gamma,
        "lossless": speculative["outputs"] == plain["outputs"],
        "equals_draftsmith_plain": plain["outputs"] == ours["plain"],
        "counters": counters,
        "tau_engine": None if tau is None else round(tau, 4),
        "tau_draftsmith": round(ours["tau"], 4),
        "relative_difference": None if tau is None else round(tau / ours["tau"] - 1, 4),
        "tolerance": tolerance,
        "at_least_engine": [round(n / drafts, 4) for n in counters["accepted_per_position"]] if drafts else [],
        "at_least_draftsmith": [round(p, 4) for p in ours["at_least"]],
    }
    summary |= {"partings": partings} if partings is not None else {}
    summary |= {"plain_partings": plain_partings} if plain_partings is not None else {}
    problems = []
    if not summary["lossless"]:
        problems += parting_problem(
            "vLLM's greedy output with the drafter differs from its output without it", partings
        )
    if not summary["equals_draftsmith_plain"]:
        problems += parting_problem("vLLM's plain greedy output differs from draftsmith's", plain_partings)
    if not accepted and ours["tau"] == 1:  # nothing to compare: the drafter, not its conversion, accepts nothing
        problems.append(
            f"vLLM accepted no draft token in {drafts} drafts, nor did draftsmith's own decoding of the same prompts "
            "(τ 1.00 in both): the drafter is undertrained, not misread; train it longer (train.max_steps, more data)"
        )
    elif not accepted:
        problems.append(f"vLLM accepted no draft token in {drafts} drafts")
    elif abs(summary["relative_difference"]) > tolerance:
        problems.append(
            f"vLLM's τ {tau:.3f} differs from draftsmith's {ours['tau']:.3f} by {summary['relative_difference']:+.1%} "
            f"(tolerance ±{tolerance:.0%})"
        )
    if problems:
        raise ExportCheckFailed(f"export check in vLLM {engine['vllm_version']} failed: {'; '.join(problems)}")
    return summary
