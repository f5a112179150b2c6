"""The load sweep: a drafter's export served in vLLM at several concurrencies, plain and at each γ, one
JSONL row per (method, γ, concurrency); `export.batch_sweep` reads these rows (export/sweep_results.py) to
write vLLM's γ per batch size (export/schedule.py).

    draftsmith sweep recipe=NAME [checkpoint=DIR] export.vllm_python=PYTHON [export.sweep.KEY=...]
    python -m export.sweep ...                                  (from a checkout)

Without `checkpoint` it is `<output_dir>/final`. The drafter is exported for vLLM into
`<export.sweep.output>/export` (no engine check: the sweep compares every output with plain's itself),
then served in the engine of `export.vllm_python`, one method at one γ at every concurrency c in turn:
a closed loop, c requests in flight and a new one entering as one finishes, until
max(`min_requests`, `requests_per_slot` x c) requests are done, every token's arrival timed. The
prompts are the eval prompts (eval.data, else data.eval; eval.max_prompts a domain), domains taken in
turn and reused round-robin; each answers eval.max_new_tokens tokens, greedy. The methods, in order:
plain decoding; vLLM's n-gram proposer at every γ (`export.sweep.ngram`); vLLM's suffix decoding once (its
own length per step, up to 24; `export.sweep.suffix`, where the vLLM has arctic-inference; from the prompt's
tree only, since the sweep serves each prompt more than once); the drafter loaded with a
schedule that drafts at no batch size (γ 0: in vLLM 0.32 that is not free, and the schedule prices K = 0
at it); the drafter at every γ; plain once more (`plain-rerun`: how far two runs of one setting differ
on this machine, which the schedule's margin never goes below).

Written into `export.sweep.output` (default `<output_dir>/sweep`; refused inside the checkpoint or an
export), resumable (a row already in sweep.jsonl is not measured again; a resume onto rows measured with
other load settings, `load` below, or another vLLM is refused in one line, export/sweep_checks.py):
- `sweep.jsonl`: the rows. A row: method, gamma, concurrency, requests, tokens, seconds, steps,
  mean_batch (requests served per engine step), tok_s, tpot_ms_p50, tpot_ms_p90 (per request: time
  between its first and last token over its tokens - 1), speedup (tok_s over plain's at the same
  concurrency), tau (vLLM: 1 + accepted / drafts), acceptance_per_position (P(accepted >= k)), drafts,
  accepted_per_position, tokens_per_step, lossless (every output equal to plain's for the same prompt at
  the same concurrency), outputs_sha256 (per request), source_sha256 (the drafter checkpoint's), engine
  (vLLM's version and what it resolved), load (what else decides the measurement: target, dtype,
  new_tokens, requests_per_slot, min_requests, the engine's threads, prompts_sha256, the drafter's SERVED
  settings, engine_arguments: prefix caching off for a target read in order), process_s;
- `summary.json`: per method the γs it was measured at and those it was not (`gammas`), per method and
  concurrency the best γ > 0 (of those measured) and whether it beats plain (`beats_plain`: false, serve
  plain there; γ 0, the drafter loaded drafting nothing, is never a best γ: `loaded_at_gamma_0` has it), the
  crossover where speculation stops paying, plain's second run over its first, the γ per batch size the
  export would write (or why it refuses), the settings (`not_measured`: a free method at a γ the engine
  failed to serve, and its line, the sweep going on without its rows; or one this engine cannot serve on
  this target, the drafter's γ 0 too, left out before anything is served: export/sweep_checks.py's
  varied_drafts);
  `speedup.png`: each method at its best γ against plain (a method measured at only some of its γs named
  with those it was measured at), and the schedule's prediction.

Prints the path of sweep.jsonl, alone on stdout (the log goes to stderr); `draftsmith export ...
export.batch_sweep=<that path>` then writes the schedule into the served config.
"""

from __future__ import annotations

if __name__ == "__main__":  # before the imports below (torch's: seconds): draftsmith.cli.run_module
    from draftsmith.cli import run_module

    run_module("draftsmith.export.sweep", __doc__, command="sweep")

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig

from draftsmith.engines import NGRAM, SUFFIX, vllm_context
from draftsmith.errors import EngineUnavailable, ExportCheckFailed, UserError
from draftsmith.export.free_methods import ngram_config, suffix_config
from draftsmith.export.sweep_checks import (
    require_own_output,
    require_proposes,
    require_same_checkpoint,
    require_same_load,
    varied_drafts,
)
from draftsmith.export.sweep_results import PLAIN, PLAIN_AGAIN, ROWS, findings_line, plot, read_sweep, summarize
from draftsmith.files import append_lines, read_json
from draftsmith.formats.repo import EXPORT_INFO, target_arguments

DEFAULT_LONGEST = 5  # export.sweep.gammas unset: 1 up to the drafter's longest chain, at most this
SUMMARY, PLOT = "summary.json", "speedup.png"
log = logging.getLogger("draftsmith.export")


@dataclass
class Load:
    """How a sweep loads the engine: the same target, prompts and lengths for every method."""

    python: str  # a Python with vLLM
    target: str  # the target as vLLM loads it
    prompts: list[list[int]]  # token ids, reused round-robin
    new_tokens: int
    requests_per_slot: int
    min_requests: int
    threads: int  # the engine's OpenMP threads
    dtype: str
    max_model_len: int
    drafter: dict[str, Any]  # the SERVED settings the drafter's export serves with (formats/folder.py)
    # LLM arguments every method is served with: prefix caching off for a target whose layers read tokens in order,
    # as the export check serves it (export/verify.py: with it on, a CPU build fails as soon as one speculates)
    engine_arguments: dict[str, Any] = field(default_factory=dict)

    def request(self, levels: Sequence[int], speculative_config: Optional[dict[str, Any]]) -> dict[str, Any]:
        """The worker's "runs" request for one method at one γ at every level (engine_scripts/vllm_worker.py)."""
        load = []
        for concurrency in levels:
            count = max(self.min_requests, self.requests_per_slot * concurrency)
            load.append(
                {"concurrency": concurrency, "prompts": [self.prompts[i % len(self.prompts)] for i in range(count)]}
            )
        return {
            "target": self.target,
            "load": load,
            "max_tokens": self.new_tokens,
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "gpu_memory_utilization": 0.3,
            "warmup": 1,
            "runs": [{"name": "run", "speculative_config": speculative_config}],
            **self.engine_arguments,
        }

    def settings(self) -> dict[str, Any]:
        """What besides the method and γ decides a row's measurement, recorded in every row: a sweep resumed with
        other settings is refused (export/sweep_checks.py), not summarized as if measured with this run's."""
        return {
            "target": self.target,
            "dtype": self.dtype,
            "new_tokens": self.new_tokens,
            "requests_per_slot": self.requests_per_slot,
            "min_requests": self.min_requests,
            "threads": self.threads,
            "prompts_sha256": hashlib.sha256(json.dumps(self.prompts).encode()).hexdigest(),
            "drafter": self.drafter,
            "engine_arguments": self.engine_arguments,
        }

    def rows(
        self,
        session,
        method: str,
        gamma: int,
        speculative_config: Optional[dict[str, Any]],
        source: Optional[str],
        levels: Sequence[int],
        plain: dict[int, dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The rows of `method` at `gamma` at each of `levels`, served in `session` (an
        export.verify.EngineSession); `plain`: plain's rows by concurrency, for speed-up and lossless."""
        began = time.perf_counter()
        doing = "serve plain decoding" if speculative_config is None else f"serve {method} at γ {gamma}"
        result = session.run(self.python, self.request(levels, speculative_config), doing)
        served = {**result["runs"]["run"], "vllm_version": result["vllm_version"]}
        served["process_s"] = time.perf_counter() - began
        return [
            measured_row(method, gamma, level, plain.get(level["concurrency"]), served, self.settings(), source)
            for level in served["levels"]
        ]


def measured_row(method, gamma, level, plain, served, settings, source) -> dict[str, Any]:
    """A sweep.jsonl row (the module docstring) from one level of the worker's reply; `settings`: Load.settings."""
    metrics = level["metrics"]
    drafts = metrics["num_drafts"]
    tpot = sorted(level["tpot_s"])
    tok_s = level["tokens"] / level["seconds"]
    request_steps = level["steps"] * level["mean_batch"]
    return {
        "method": method,
        "gamma": gamma,
        "concurrency": level["concurrency"],
        "requests": len(level["outputs"]),
        "tokens": level["tokens"],
        "seconds": round(level["seconds"], 3),
        "steps": level["steps"],
        "mean_batch": round(level["mean_batch"], 3),
        "tok_s": round(tok_s, 2),
        "tpot_ms_p50": round(1000 * statistics.median(tpot), 2) if tpot else None,
        "tpot_ms_p90": round(1000 * tpot[min(len(tpot) - 1, int(0.9 * len(tpot)))], 2) if tpot else None,
        "speedup": round(tok_s / plain["tok_s"], 4) if plain else (1.0 if method == PLAIN else None),
        "tau": round(1 + metrics["num_accepted_tokens"] / drafts, 4) if drafts else None,
        "acceptance_per_position": [round(n / drafts, 4) for n in metrics["accepted_per_position"]] if drafts else [],
        "drafts": drafts,
        "accepted_per_position": metrics["accepted_per_position"]
        + [0] * (gamma - len(metrics["accepted_per_position"])),
        "tokens_per_step": round(level["tokens"] / request_steps, 4) if request_steps else None,
        "lossless": None if plain is None else digests(level["outputs"]) == plain["outputs_sha256"],
        "outputs_sha256": digests(level["outputs"]),
        "source_sha256": source,
        "engine": {"vllm_version": served["vllm_version"], **served["engine_settings"]},
        "load": settings,
        "process_s": round(served["process_s"], 1),
    }


def digests(outputs: list[list[int]]) -> list[str]:
    """Per request, a short digest of its output token ids: enough to tell two outputs apart."""
    return [hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16] for ids in outputs]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows measured so far (none before the first)."""
    return read_sweep(path) if path.is_file() else []


def measure(path: Path, load: Load, session, levels: Sequence[int], method: str, gamma: int,
            speculative_config: Optional[dict[str, Any]], source: Optional[str] = None) -> None:  # fmt: skip
    """Append to `path` the rows of `method` at `gamma` for the levels it does not hold yet."""
    done = {(row["method"], row["gamma"], row["concurrency"]) for row in read_rows(path)}
    missing = [c for c in levels if (method, gamma, c) not in done]
    if not missing:
        return
    log.info("load sweep: %s at γ %d, concurrency %s", method, gamma, missing)
    plain = {row["concurrency"]: row for row in read_rows(path) if row["method"] == PLAIN}
    rows = load.rows(session, method, gamma, speculative_config, source, missing, plain)
    append_lines(path, [json.dumps(row) + "\n" for row in rows])


def run_sweep(cfg: DictConfig, checkpoint: Path, session=None, target=None, served=None) -> Path:
    """Measure `checkpoint`'s export under load (the module docstring); returns sweep.jsonl's path.
    `session`: an export.verify.EngineSession to serve in (one of its own otherwise); `target`: the
    loaded target for the export (loaded here otherwise); `served`: the SERVED drafter settings the command line
    gave (formats/folder.py's served_settings)."""
    from contextlib import nullcontext

    from draftsmith.engines import missing_suffix_decoding, vllm_python
    from draftsmith.export.verify import EngineSession
    from draftsmith.files import checkpoint_digest, write_text_atomic
    from draftsmith.formats import exporter_for
    from draftsmith.formats.folder import served_values
    from draftsmith.formats.versions import VLLM_PYTHON_KEY, require_vllm_serves
    from draftsmith.heads.base import saved_drafter
    from draftsmith.outputs import DirectoryLock
    from draftsmith.target_loading import load_config

    settings = cfg.export.sweep
    output = Path(settings.output or Path(cfg.output_dir) / "sweep")
    require_own_output(output, checkpoint)
    levels = sorted(set(settings.concurrency))  # each from 1 to MAX_SWEEP_CONCURRENCY (draftsmith/recipe_checks.py)
    drafter_cls, drafter_config = saved_drafter(checkpoint)[:2]
    method, longest = drafter_cls.type, drafter_cls.max_chain(drafter_config)
    given = None if settings.gammas is None else list(settings.gammas)
    default = range(1, min(DEFAULT_LONGEST, longest or DEFAULT_LONGEST) + 1)
    gammas = sorted(set(given)) if given is not None else list(default)
    if not gammas or min(gammas) < 1:
        raise UserError(f"export.sweep.gammas={given} must list integers >= 1, at least one (unset: 1 up to the chain)")
    require_proposes(gammas, longest, method, checkpoint)
    python = vllm_python(cfg.export.vllm_python, VLLM_PYTHON_KEY)
    exporter = exporter_for(method)  # a release without the method: refused now, not after the free methods' levels
    version = require_vllm_serves(exporter.vllm_method, exporter.releases(asdict(drafter_config), max(gammas)), python)
    missing = None if settings.suffix is False else missing_suffix_decoding(python, VLLM_PYTHON_KEY)
    if settings.suffix and missing:
        raise UserError(missing)
    suffix = settings.suffix is not False and missing is None
    target_config = load_config(cfg.target)
    varied = varied_drafts(target_config, python, settings)
    digest = checkpoint_digest(checkpoint)
    prompts = sweep_prompts(cfg)  # bad traffic is one line before the export is written
    path = output / ROWS
    with DirectoryLock(output, key="export.sweep.output"):
        resumed = read_rows(path)
        require_same_checkpoint(path, resumed, digest)
        drafter = served_values(drafter_config, served)
        folder = exported_for_sweep(cfg, checkpoint, output / "export", digest, target, drafter)  # a resume keeps it
        longest = max(gammas, default=0)  # the free methods' too: suffix decoding drafts up to its tree's depth
        longest = max(longest, suffix_config(cached_answers=0)["num_speculative_tokens"] if suffix else 0)
        load = sweep_load(cfg, python, folder, drafter, target_config, longest, prompts)
        require_same_load(path, resumed, load.settings(), version)
        threads_env = {"OMP_NUM_THREADS": str(load.threads)}
        with nullcontext(session) if session is not None else EngineSession(threads_env) as engines:
            measure(path, load, engines, levels, PLAIN, 0, None)
            baselines = [(NGRAM, gamma, ngram_config(gamma)) for gamma in gammas] if settings.ngram else []
            if suffix:  # each level serves the prompts again: an answer cached from an earlier request would
                # be the very text asked for, which real traffic rarely repeats; the prompt's own tree only
                config = suffix_config(cached_answers=0)
                baselines.append((SUFFIX, config["num_speculative_tokens"], config))
            swept = {name: [gamma for other, gamma, _ in baselines if other == name] for name, _, _ in baselines}
            not_measured = {f"{name} at γ {', '.join(map(str, at))}": varied for name, at in swept.items() if varied}
            for left_out in not_measured:
                log.warning("load sweep: %s left out: %s", left_out, varied)
            for baseline, gamma, config in [] if varied else baselines:
                try:
                    measure(path, load, engines, levels, baseline, gamma, config)
                except (ExportCheckFailed, EngineUnavailable) as failed:  # the engine's failure in a free method,
                    # not the drafter's: the drafter's rows are still what the sweep is for
                    not_measured[f"{baseline} at γ {gamma}"] = str(failed)
                    log.warning("load sweep: %s at γ %d not measured: %s", baseline, gamma, failed)
            # γ 0 is served as a schedule: this proposer takes none, or the engine cannot serve its short steps here
            takes = exporter.vllm_takes_schedule
            no_schedule = (None if takes else NO_SCHEDULE.format(method=exporter.vllm_method)) or varied
            if no_schedule:
                not_measured[f"{method} at γ 0"] = no_schedule
            for gamma in gammas if no_schedule else [0, *gammas]:
                measure(path, load, engines, levels, method, gamma, served_at(folder, gamma, levels), digest)
            measure(path, load, engines, levels, PLAIN_AGAIN, 0, None)
        rows = read_rows(path)
        summary = summarize(rows, [*swept, method], swept)
        summary["schedule"], predicted = ({"refused": no_schedule}, {}) if no_schedule else schedule_of(rows, method)
        summary["settings"] = {
            "concurrency": levels,
            "gammas": gammas,
            NGRAM: bool(settings.ngram),
            SUFFIX: "prompt trees only (no answers cached across requests)"
            if suffix
            else ("off" if settings.suffix is False else "not measured: export.vllm_python has no arctic-inference"),
            "new_tokens": load.new_tokens,
            "requests_per_slot": load.requests_per_slot,
            "min_requests": load.min_requests,
            "threads": load.threads,
            "dtype": load.dtype,
            "prompts": len(load.prompts),
            "engine_arguments": load.engine_arguments,
            "not_measured": not_measured,
        }
        write_text_atomic(output / SUMMARY, json.dumps(summary, indent=2) + "\n")
        plot(summary["best_per_concurrency"], predicted, output / PLOT, summary["gammas"])
    log.info("load sweep of %s: %s: %s, %s", checkpoint, findings_line(summary, method), path, output / SUMMARY)
    return path


NO_SCHEDULE = (
    "vLLM's {method} proposer drafts the one γ it was loaded with (it asserts it): it takes no γ per batch size "
    "(num_speculative_tokens_per_batch_size), so neither γ 0 nor a schedule can be served"
)


def served_at(folder: Path, gamma: int, levels: Sequence[int]) -> dict[str, Any]:
    """The speculative config of the export in `folder` at a fixed γ; at γ 0, loaded with a schedule that
    drafts at no batch size up to the largest level (what a schedule's K = 0 costs)."""
    served = read_json(folder / EXPORT_INFO, "export record")["speculative_config"]
    fixed = {k: v for k, v in served.items() if k != "num_speculative_tokens_per_batch_size"} | {"model": str(folder)}
    if gamma == 0:
        return {**fixed, "num_speculative_tokens": 1, "num_speculative_tokens_per_batch_size": [[1, max(levels), 0]]}
    return {**fixed, "num_speculative_tokens": gamma}


def round_robin(by_domain: dict[str, list[list[int]]]) -> list[list[int]]:
    """The prompts of every domain in turn: the first of each, then the second of each, ..."""
    longest = max(map(len, by_domain.values()))
    return [prompts[i] for i in range(longest) for prompts in by_domain.values() if i < len(prompts)]


def exported_for_sweep(cfg: DictConfig, checkpoint: Path, output: Path, digest: str, target, drafter) -> Path:
    """The checkpoint's vLLM folder the sweep serves: kept from an earlier run of the sweep when made from
    the same checkpoint to serve as `drafter` (its SERVED settings), else exported (vLLM only, unchecked, not
    pushed)."""
    from draftsmith.export.run import export_checkpoint
    from draftsmith.recipe import derived

    info = output / "vllm" / EXPORT_INFO
    record = read_json(info, "export record") if info.is_file() else None
    if record and record["source"]["sha256"] == digest and drafter.items() <= record["drafter_config"].items():
        return output / "vllm"
    variant = derived(
        cfg,
        {
            "export.output": str(output),
            "export.engines": ["vllm"],
            "export.vllm_python": None,
            "export.batch_sweep": None,
            "export.push.repo_id": None,
        },
        "export",
    )
    return export_checkpoint(variant, checkpoint, target=target, served=drafter)["vllm"]


def sweep_prompts(cfg: DictConfig) -> list[list[int]]:
    """The sweep's prompts: the eval prompts (eval.max_prompts a domain), domains in turn; how many, said."""
    from draftsmith.eval.prompts import load_prompts, prompt_sources
    from draftsmith.target import load_tokenizer

    sources, per_file = prompt_sources(cfg)  # the eval report's prompts
    if not sources:
        raise UserError("the load sweep serves the eval prompts: set eval.data or data.eval")
    by_domain = load_prompts(
        sources, load_tokenizer(cfg.target), int(cfg.eval.max_prompts), int(cfg.data.max_length),
        cfg.data.skip_invalid_utf8, per_file,
    )  # fmt: skip
    counts = ", ".join(f"{domain} {len(prompts)}" for domain, prompts in by_domain.items())
    log.info(
        "the sweep serves %d prompts of %s (%s: the first eval.max_prompts=%d of each domain), reused round-robin",
        sum(map(len, by_domain.values())), ", ".join(map(str, sources)), counts, int(cfg.eval.max_prompts),
    )  # fmt: skip
    return round_robin(by_domain)


def sweep_load(
    cfg: DictConfig,
    python: str,
    folder: Path,
    drafter: dict[str, Any],
    target_config,
    longest_gamma: int,
    prompts: list[list[int]],
) -> Load:
    """The sweep's settings from the recipe, serving `prompts` (`sweep_prompts`); `drafter`: the SERVED settings
    `folder` serves with; `target_config`: the target's (target_loading.load_config)."""
    from draftsmith.families import reads_in_order
    from draftsmith.target import dtype_name, resolve_device, resolve_dtype

    new_tokens = int(cfg.eval.max_new_tokens)
    cores = len(os.sched_getaffinity(0))
    threads = cfg.export.sweep.cpu_threads or int(os.environ.get("OMP_NUM_THREADS") or cores)
    if threads > cores:  # on a CPU engine, threads beyond the cores spin against each other: every level slower
        log.warning("the engine runs %d threads on %d cores (export.sweep.cpu_threads): slower levels", threads, cores)
    # a drafter that verifies with a target of its own (Medusa-2's adapted one) serves it from its folder
    served_target = folder / "target" if (folder / "target").is_dir() else cfg.target.name_or_path
    record = read_json(folder / EXPORT_INFO, "export record")  # the target's overrides and engine arguments, as checked
    overrides, folder_arguments = record.get("target_overrides") or {}, record.get("engine_arguments") or {}
    return Load(
        python=python,
        target=str(served_target),
        prompts=prompts,
        new_tokens=new_tokens,
        requests_per_slot=int(cfg.export.sweep.requests_per_slot),
        min_requests=int(cfg.export.sweep.min_requests),
        threads=int(threads),
        dtype=dtype_name(resolve_dtype(cfg.target.dtype, resolve_device(cfg.eval.device))),
        max_model_len=vllm_context(prompts, new_tokens, longest_gamma),
        drafter=drafter,
        engine_arguments=target_arguments(reads_in_order(target_config), served_target, overrides) | folder_arguments,
    )


def schedule_of(rows: list[dict[str, Any]], method: str) -> tuple[dict[str, Any], dict[str, dict[int, float]]]:
    """The γ per batch size the export would write from these rows (or why it refuses), and its predicted
    speed-up over plain per concurrency, for the plot."""
    from draftsmith.export.schedule import NoSchedule, batch_schedule

    try:
        schedule = batch_schedule(rows, method)
    except NoSchedule as refused:  # said here too: summary.json alone held it, and the export refused it later
        log.warning("no γ per batch size for an export from this sweep: %s", refused)
        return {"refused": str(refused)}, {}
    predicted = {int(c): v["predicted_vs_plain"] for c, v in schedule["per_concurrency"].items()}
    return schedule, {f"{method} with its γ schedule (predicted)": predicted}


def main(argv: Sequence[str]) -> None:
    from draftsmith.formats.folder import require_weights_as_configured, served_settings
    from draftsmith.recipe import checkpoint_to_read, load_recipe

    cfg = load_recipe(argv, "sweep")
    served = served_settings(argv, cfg)
    require_weights_as_configured(checkpoint_to_read(cfg))
    print(run_sweep(cfg, checkpoint_to_read(cfg), served=served))
