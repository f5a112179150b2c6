"""Each recipe section's own values checked (ranges, choices, paths that must exist or be creatable),
before any model or data is touched: `draftsmith.recipe.validate` calls them after the schema has typed
every key; the train section's are in draftsmith/train_checks.py, the drafter section is its kind's own check
(`draftsmith.recipe.check_drafter`)."""

from __future__ import annotations

import math
import re
import urllib.parse
from pathlib import Path
from typing import Any, Optional

import numpy
from omegaconf import DictConfig, OmegaConf

from draftsmith.engines import PROMPT_LOOKUP_MIN, SERVING_ENGINES, VLLM_FORMATS, arctic_build, suffix_decoding_installed
from draftsmith.errors import UserError
from draftsmith.files import cache_root
from draftsmith.outputs import check_output_dir, loops

FLOAT32_MAX = float(numpy.finfo(numpy.float32).max)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)


def require_at_least_one(section, prefix: str, *keys: str) -> None:
    """Counts that must be >= 1, each named alone when it is not."""
    for key in keys:
        require(section[key] >= 1, f"{prefix}.{key}={section[key]} must be >= 1")


# numpy's seeds (accelerate's set_seed seeds numpy with train.seed): one outside failed in its call, exit 70
SEED_RANGE = range(2**32)
# the highest load `draftsmith sweep` measures (vLLM's largest default max_num_seqs), and the most requests a level
# serves for each method and γ (a level of 10^5 was 200,000 requests, a dozen times over)
MAX_SWEEP_CONCURRENCY = 1024
MAX_LEVEL_REQUESTS = 100_000
# the most answers a regeneration draws for one conversation (a few to a few dozen give the target's spread)
MAX_REGENERATE_SAMPLES = 1000


def require_seed(value: int, key: str) -> None:
    require(value in SEED_RANGE, f"{key}={value} must be in 0 .. {SEED_RANGE[-1]}")


def refuse_unread_sampling(section, defaults: type, prefix: str, greedy: str) -> None:
    """Sampling settings changed from their defaults (`defaults`, the section's class) where temperature 0 decodes
    greedily and reads none of them: they changed nothing, and what the part wrote recorded them as applied."""
    keys = [key for key in ("top_p", "top_k", "seed") if hasattr(defaults, key)]
    changed = [f"{prefix}.{key}={section[key]}" for key in keys if section[key] != getattr(defaults, key)]
    one = len(changed) == 1
    require(
        section.temperature > 0 or not changed,
        f"{' and '.join(changed)} {'is' if one else 'are'} read only when sampling, and {prefix}.temperature=0 "
        f"{greedy}: set {prefix}.temperature > 0, or leave {'it' if one else 'them'} out",
    )


def check_finite_settings(settings: dict, prefix: str = "") -> None:
    """Every number of the recipe (`settings`: it as a plain dict) is finite: inf passes the range checks
    (train.lr=inf > 0) and reaches the arithmetic (a run trained to non-finite weights), and nan passes a key
    that no range check compares."""
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            check_finite_settings(value, f"{name}.")
            continue
        numbers = value if isinstance(value, list) else [value]
        require(
            all(math.isfinite(number) for number in numbers if isinstance(number, float)),
            f"{name}={value} must be finite (a number, not inf or nan)",
        )


def check_data(data) -> None:
    from draftsmith.recipe_schema import RegenerateSection

    # A prompt needs 2 tokens (the last one is the first decode root), a training row 3 (predict 2 ahead).
    require(data.max_length >= 3, f"data.max_length={data.max_length} must be >= 3")
    require(
        data.max_conversations is None or data.max_conversations >= 1,
        f"data.max_conversations={data.max_conversations} must be >= 1 (or null for all)",
    )
    require(
        data.pack_length is None or data.pack_length >= data.max_length,
        f"data.pack_length={data.pack_length} must be >= data.max_length={data.max_length}: "
        "a conversation is packed whole into one row",
    )
    require(
        data.pack or data.pack_length is None,
        f"data.pack_length={data.pack_length} is the length of packed rows, and data.pack=false pads a row per "
        "conversation: set data.pack=true, or leave it out",
    )
    capture = data.capture
    require_at_least_one(capture, "data.capture", "topk", "shard_tokens")
    layers = list(capture.layers or [])
    require(all(layer >= -1 for layer in layers), f"data.capture.layers={layers}: ids are >= -1 (-1 = embeddings)")
    repeated = sorted({layer for layer in layers if layers.count(layer) > 1})
    require(not repeated, f"data.capture.layers={layers} names {repeated} more than once: each layer is stored once")
    check_vllm_engine(capture.vllm, "data.capture.vllm")
    regenerate = data.regenerate
    require_at_least_one(regenerate, "data.regenerate", "batch_size", "max_new_tokens", "samples", "min_turns")
    require_seed(regenerate.seed, "data.regenerate.seed")
    require(
        regenerate.max_turns is None or regenerate.max_turns >= 1,
        f"data.regenerate.max_turns={regenerate.max_turns} must be >= 1 (or null: every assistant turn)",
    )
    require(
        regenerate.temperature >= 0 and 0 < regenerate.top_p <= 1,
        f"need data.regenerate.temperature >= 0 and 0 < top_p <= 1 (got {regenerate.temperature}, {regenerate.top_p})",
    )
    require(
        regenerate.max_turns is None or regenerate.max_turns >= regenerate.min_turns,
        f"data.regenerate.max_turns={regenerate.max_turns} is below min_turns={regenerate.min_turns}: no "
        "conversation would be written",
    )
    refuse_unread_sampling(regenerate, RegenerateSection, "data.regenerate", "answers greedily")
    require(
        regenerate.samples == 1 or regenerate.temperature > 0,
        f"data.regenerate.samples={regenerate.samples} needs temperature > 0: greedy answers to one prompt are "
        "all the same",
    )
    require(  # 10^9 listed its rows before the first answer: out of memory, with a line naming nothing
        regenerate.samples <= MAX_REGENERATE_SAMPLES,
        f"data.regenerate.samples={regenerate.samples} answers each conversation {regenerate.samples} times: at most "
        f"{MAX_REGENERATE_SAMPLES}",
    )
    require(
        not regenerate.reuse or regenerate.temperature == 0,
        "data.regenerate.reuse needs greedy answers (temperature 0): "
        "a sampled answer is one draw, not the target's answer",
    )
    check_vllm_engine(regenerate.vllm, "data.regenerate.vllm")


def check_vllm_engine(vllm, key: str) -> None:
    require_at_least_one(vllm, key, "tensor_parallel_size", "max_num_seqs")
    require(
        vllm.gpu_memory_utilization is None or 0 < vllm.gpu_memory_utilization <= 1,
        f"{key}.gpu_memory_utilization={vllm.gpu_memory_utilization} must be in (0, 1]",
    )


def check_eval(eval_section) -> None:
    from draftsmith.recipe_schema import EvalSection

    require_at_least_one(eval_section, "eval", "max_new_tokens", "max_prompts")
    require_seed(eval_section.seed, "eval.seed")
    require(
        eval_section.num_speculative_tokens >= 1,
        f"eval.num_speculative_tokens={eval_section.num_speculative_tokens} must be >= 1",
    )
    require(eval_section.tree >= 0, f"eval.tree={eval_section.tree} must be >= 0 (0 = chain only)")
    require(
        eval_section.temperature >= 0 and 0 < eval_section.top_p <= 1 and eval_section.top_k >= 0,
        f"need eval.temperature >= 0, 0 < eval.top_p <= 1, eval.top_k >= 0 (got {eval_section.temperature}, "
        f"{eval_section.top_p}, {eval_section.top_k})",
    )
    require(  # below it the baseline never drafts, as vLLM's proposer would not
        eval_section.ngram_max >= PROMPT_LOOKUP_MIN,
        f"eval.ngram_max={eval_section.ngram_max} must be >= {PROMPT_LOOKUP_MIN} (vLLM's prompt_lookup_min)",
    )
    refuse_unread_sampling(eval_section, EvalSection, "eval", "decodes greedily")
    require(
        eval_section.ngram_baseline or eval_section.ngram_max == EvalSection.ngram_max,
        f"eval.ngram_max={eval_section.ngram_max} is the n-gram baseline's, and eval.ngram_baseline=false: "
        "leave it out",
    )
    require(
        eval_section.suffix_baseline is not True or suffix_decoding_installed(),
        f"eval.suffix_baseline=true needs arctic-inference, which is not installed here (build it: {arctic_build()}; "
        "or set eval.suffix_baseline=false)",
    )
    require(eval_section.batch_size >= 1, f"eval.batch_size={eval_section.batch_size} must be >= 1")
    sizes = list(eval_section.batch_sizes)
    require(
        all(size >= 1 for size in sizes) and len(set(sizes)) == len(sizes),
        f"eval.batch_sizes={sizes} must be distinct sizes >= 1",
    )
    require(
        bool(re.fullmatch(r"auto|cpu|cuda(:\d+)?", eval_section.device)),
        f"eval.device={eval_section.device!r} is not auto, cpu, cuda or cuda:N",
    )


def check_export(export) -> None:
    engines = list(export.engines)
    require(
        bool(engines) and all(engine in SERVING_ENGINES for engine in engines) and len(set(engines)) == len(engines),
        f"export.engines={engines}: give one or more of {', '.join(SERVING_ENGINES)}, each once",
    )
    require(
        export.num_speculative_tokens is None or export.num_speculative_tokens >= 1,
        f"export.num_speculative_tokens={export.num_speculative_tokens} must be >= 1",
    )
    require(0 < export.tolerance < 1, f"export.tolerance={export.tolerance} must be in (0, 1)")
    require(
        export.vllm_format in VLLM_FORMATS,
        f"export.vllm_format={export.vllm_format!r} is not one of {', '.join(VLLM_FORMATS)}",
    )
    # the vLLM folder's settings, with no vLLM folder to apply them to: ignored without a word otherwise
    require(
        export.vllm_python is None or "vllm" in engines,
        f"export.vllm_python checks the vLLM folder, and export.engines={engines} makes none: add vllm, or leave "
        "export.vllm_python out",
    )
    require(
        export.vllm_format == VLLM_FORMATS[0] or "vllm" in engines,
        f"export.vllm_format={export.vllm_format} is the vLLM folder's layout, and export.engines={engines} makes none",
    )
    repo = export.push.repo_id
    require(
        repo is None or bool(re.fullmatch(r"[\w.-]+/[\w.-]+", repo)), f"export.push.repo_id={repo!r} is not ORG/NAME"
    )
    sweep = export.sweep  # a level serves max(min_requests, requests_per_slot x concurrency) requests
    require(
        min(sweep.requests_per_slot, sweep.min_requests) >= 0 and max(sweep.requests_per_slot, sweep.min_requests) >= 1,
        f"export.sweep.requests_per_slot={sweep.requests_per_slot} and min_requests={sweep.min_requests} must be >= 0, "
        "one of them >= 1: a level of no requests measures nothing",
    )
    levels = list(sweep.concurrency)
    require(  # the engine's max_num_seqs is set to the highest level; 10^9 built its requests after the engine started
        bool(levels) and 1 <= min(levels) and max(levels) <= MAX_SWEEP_CONCURRENCY,
        f"export.sweep.concurrency={levels} must list integers from 1 to {MAX_SWEEP_CONCURRENCY}, at least one (the "
        "requests in flight at once: speculation pays at the low ones)",
    )
    requests = max(sweep.min_requests, sweep.requests_per_slot * max(levels))
    require(
        requests <= MAX_LEVEL_REQUESTS,
        f"export.sweep's concurrency {max(levels)} serves {requests} requests (max(min_requests={sweep.min_requests}, "
        f"requests_per_slot={sweep.requests_per_slot} x concurrency)) for each method and γ: at most "
        f"{MAX_LEVEL_REQUESTS} a level",
    )
    require(
        sweep.cpu_threads is None or sweep.cpu_threads >= 1,
        f"export.sweep.cpu_threads={sweep.cpu_threads} must be >= 1, or null for the engine's default",
    )


def require_export_settings_read(export) -> None:
    """For the commands that export (export, monitor): a setting only a part of the export reads, changed from its
    default where that part does not run, was ignored without a word. A value equal to the default cannot be told
    from an unset one here, and changes nothing."""
    from draftsmith.recipe_schema import ExportSection, PushSection

    require(
        export.vllm_python is not None or export.tolerance == ExportSection.tolerance,
        f"export.tolerance={export.tolerance} is the vLLM check's, and export.vllm_python is unset, so no check "
        "runs: give "
        "export.vllm_python=PYTHON, or leave export.tolerance out",
    )
    if export.push.repo_id is None:
        for key in ("revision", "private", "commit_message"):
            value = export.push[key]
            given = str(value).lower() if isinstance(value, bool) else value  # as the command line writes it
            require(
                value == getattr(PushSection, key),
                f"export.push.{key}={given} is for a push, and export.push.repo_id is unset, so nothing is pushed: "
                "give export.push.repo_id=ORG/NAME, or leave it out",
            )


def check_monitor(monitor) -> None:
    require(
        monitor.engine in SERVING_ENGINES,
        f"monitor.engine={monitor.engine!r} is not one of {', '.join(SERVING_ENGINES)}",
    )
    require(
        0 < monitor.max_drop < 1 and 0.5 < monitor.confidence < 1,
        f"need 0 < monitor.max_drop < 1 and 0.5 < monitor.confidence < 1 (got {monitor.max_drop}, "
        f"{monitor.confidence})",
    )
    require_at_least_one(
        monitor, "monitor", "min_drafts", "consecutive", "sample_per_domain", "retrain_samples", "new_data_weight"
    )
    for key in ("cooldown_s", "gate_min_gain", "gate_max_loss"):
        require(monitor[key] >= 0, f"monitor.{key}={monitor[key]} must be >= 0")
    # a window of no time holds no request: every check would wait for traffic that never counts
    require(monitor.traffic_window_s > 0, f"monitor.traffic_window_s={monitor.traffic_window_s} must be > 0 (seconds)")
    # each check scrapes every replica (and may start a retraining): more often than each second is no interval
    require(monitor.interval_s >= 1, f"monitor.interval_s={monitor.interval_s} must be >= 1 (seconds between checks)")
    require(
        monitor.redeploy_command is None or bool(str(monitor.redeploy_command).strip()),
        "monitor.redeploy_command is empty: give the command that rolls out an export, or leave it unset",
    )
    require(monitor.redeploy_timeout_s > 0, f"monitor.redeploy_timeout_s={monitor.redeploy_timeout_s} must be > 0")
    for url in monitor.metrics:
        try:
            parts = urllib.parse.urlsplit(str(url))
            reachable = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
            reachable = reachable and str(url).isprintable() and " " not in str(url)  # http.client refuses them
        except ValueError:  # a port out of range or not a number, an unclosed [IPv6 address]
            reachable = False
        require(
            reachable,
            f"monitor.metrics: {str(url)!r} is not an http(s) URL of a host (and a port 1-65535): give the URLs of "
            "the engines' /metrics",
        )


# The recipe keys that name a directory a job writes; unset, each but output_dir is a folder under output_dir.
OUTPUT_KEYS = (
    "output_dir",
    "data.capture.output",
    "data.regenerate.output",
    "export.output",
    "export.sweep.output",
    "monitor.state_dir",
)


def check_outputs(cfg, tokenizes: bool = True) -> None:
    """Every output directory the recipe names is creatable, and none is empty (which a path would take
    as the current folder); each job's lock checks the defaults under output_dir it takes. The tokenized-data
    cache, given or, for a command that `tokenizes` its data (train, capture), its default, is creatable too: a
    file there, or a read-only file system, failed once the data had been read (exit 70, or 74 as if the disk had
    failed)."""
    for key in OUTPUT_KEYS:
        path = OmegaConf.select(cfg, key)
        if path is None:
            continue
        unset = "" if key == "output_dir" else ", or null for its default under output_dir"
        require(str(path) != "", f"{key} is empty: give a directory{unset}")
        check_output_dir(path, key)
        check_outside_data(cfg, str(path), key)
    cache = cfg.data.cache_dir
    if cache or tokenizes:
        unset = f"data.cache_dir=null (its default, {cache_root()})"
        check_output_dir(cache or cache_root(), "data.cache_dir", named=None if cache else unset)


def check_outside_data(cfg, output: str, key: str) -> None:
    """An output directory is no data folder the recipe reads, nor inside one: a run wrote its checkpoints, logs and
    checksums into its data.train folder, and its own eval's read of that folder (and every later run's) then met
    them as conversations (`checksums.json record 1: no 'messages' field`), after the whole training."""
    written = Path(output).expanduser().absolute()
    for data_key in ("data.train", "data.eval", "data.draft_vocab"):
        sources = OmegaConf.select(cfg, data_key) or []
        for source in [sources] if isinstance(sources, str) else sources:
            folder = Path(str(source)).expanduser().absolute()
            require(
                not folder.is_dir() or not written.is_relative_to(folder),
                f"{key}={output} is inside the {data_key} folder {source}, whose every file is read as data: give "
                "an output directory outside it",
            )


# paths a command reads, each with a default when null: given empty, it was read as unset, without a word
INPUT_KEYS = ("checkpoint", "train.init_from", "export.report")


def check_inputs(cfg) -> None:
    for key in INPUT_KEYS:
        require(
            OmegaConf.select(cfg, key) != "", f"{key} is empty: give a path, or leave it out (null) for its default"
        )
    # else refused as no such folder, or read as a Hub id
    require(
        not loops(Path(str(cfg.target.name_or_path)).expanduser()),
        f"target.name_or_path={cfg.target.name_or_path}: a loop of symbolic links, no folder",
    )


# train.resume's value for "the newest checkpoint whose files match their checksums" (true: the newest, verified)
LATEST_INTACT = "latest_intact"


def resolve_bool_or_path(value: Optional[str]) -> Optional[str]:
    """`train.resume`: None/false -> None, true -> 'latest', anything else is a path (or `latest_intact`,
    which trainer/checkpoint.py reads)."""
    if value is None or str(value).lower() in ("false", "none", ""):
        return None
    if str(value).lower() == "true":
        return "latest"
    return str(value)


def unset_keys(cfg: DictConfig) -> list[str]:
    """The keys whose value is OmegaConf's MISSING (`???`), read from the plain container: OmegaConf.missing_keys walks
    the config node by node, a sixth of a recipe's validation."""

    def walk(node: Any, key: str):
        if isinstance(node, dict):
            for name, value in node.items():
                yield from walk(value, f"{key}.{name}" if key else str(name))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                yield from walk(value, f"{key}[{index}]")
        elif node == "???":
            yield key

    return sorted(walk(OmegaConf.to_container(cfg, resolve=False), ""))
