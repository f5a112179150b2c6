"""Training throughput of a drafter against its real target (default: EAGLE-3 for SmolLM2-135M-Instruct),
the trainer's own step timed, as JSON.

    python benchmarks/train_throughput.py [--recipe eagle3_smollm2] [--data FILE] [--steps 8]
                                          [--warmup 2] [--profile-steps 3] [--threads 2] [KEY=VALUE ...]

KEY=VALUE are recipe overrides, as `train.py` takes them (e.g. drafter.ttt_steps=7
data.max_length=256 train.micro_batch_size=4 data.pack=true). The data is `--data` (default the
bundled demo conversations whose answers SmolLM2 regenerated, demo/data/train.regenerated.jsonl.gz).
The run is built by the trainer's own set-up (trainer/setup.py `set_up`: data, target, drafter, optimizer
and schedule under accelerate) and each step is the trainer's `train_step`: every micro-batch's target
forward, drafter forward and backward, gradient clipping, the next step's micro-batches collated, the
step's all-reduce, the optimizer and the schedule. After `--warmup` untimed steps, `--steps` steps are
timed (wall clock, the device synchronised around each), then `--steps` more back to back as the loop runs
them (`tokens_per_s_together`: the host may run ahead of the device); the report gives real tokens (padding
not counted, as the trainer's train/tokens_per_s) per second over the steps timed one at a time, per core
(torch thread), the median step, the
per-token loss of every step (same data and seed give the same losses on any code that learns the same
thing, up to float rounding), the peak RSS of the process, and where the numbers came from (machine,
threads, versions, wall time: benchmarks/provenance.py). Then `--profile-steps` more steps run under the
trainer's profiler (`train.profile_steps`, trainer/observe.py StepProfiler) and the step's parts come from
its trace (`trace_parts`): the target's forward, the drafter's forward and backward, the optimizer
(clipping and step), the rest, and the time spent in the vocabulary. The machine may be shared: compare
two versions by alternating runs of both and taking medians, not by one run each; and with other jobs on
the cores, more torch threads than free cores make every parallel op wait for a descheduled thread (on a
2-core machine running another job, --threads 1 was 4x faster than 2).

Real shapes without downloads (issue #37):

    python benchmarks/train_throughput.py --shape NAME [--kinds eagle3,peagle,dflash] [--seq 2048]
        [--batch 1] [--layers N] [--device cuda] [--dtype bfloat16] [--peak-tflops 989] [KEY=VALUE ...]

builds a random-weight target of a named real model's shape (SHAPES below: llama-3.1-8b, qwen3-8b,
qwen3-0.6b, qwen3-30b-a3b, smollm2-135m, tiny) with draftsmith.random_target, directly on the device in
the given dtype (an 8B shape never exists on the CPU), and measures online training of each kind on
synthetic rows of `--seq` random tokens, every position supervised, `--batch` rows per step, with the
trainer's pieces (its accelerator, optimizer, schedule and `train_step`; the train section from
recipes/eagle3.yaml with the settings below and the KEY=VALUE overrides, e.g. a chunk size of the
vocabulary loss): one JSON object per kind with tokens/s, MFU (with --peak-tflops; FLOP count:
draftsmith.trainer.observe), peak memory, the step's parts and the share of the step spent in the
vocabulary, from the profiler's trace. The drafter trains as the trainer trains it: float32 weights,
under bf16 autocast (train.mixed_precision=bf16) when --dtype is bfloat16. Throughput does not depend on
the weights' values, with one exception handled here: EAGLE-3 sends only positions whose target argmax
is in its draft vocabulary through its lm_head, so the target's lm_head rows of the draft vocabulary (the
ids the synthetic data draws from) are scaled up and its argmax falls there, as on real data (the
reported `vocab_coverage` says how often). `--layers N` cuts the decoder to N layers (CPU runs of big
shapes). An option of one mode given to the other (--compile without --shape, --data with it) is refused,
exit 2: that mode would ignore it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from names import names_of
from provenance import cpu_model, provenance

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "demo" / "data" / "train.regenerated.jsonl.gz"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def time_steps(run, warmup: int, steps: int, profiled: int, scratch: Path) -> dict:
    """The trainer's `train_step` on `run` as the loop calls it: `warmup` untimed steps, `steps` timed one at a time
    (wall clock, the device synchronised around each), `steps` more timed together as the loop runs them (one
    synchronisation before and after: the host may run ahead of the device, as in training), then `profiled` steps
    under the trainer's profiler. Returns the steps' seconds, tokens and positions one at a time and together, every
    step's per-token loss, the drafter's vocabulary coverage where it reports one, and the profiler's trace."""
    from draftsmith.errors import StopRequest
    from draftsmith.trainer.loop import agree, micro_batches, next_step, train_step
    from draftsmith.trainer.observe import StepProfiler

    accelerator, cfg = run.accelerator, run.cfg
    stream = micro_batches(run.train_data, run.collate, cfg, 1, 0, run.state)
    upcoming = next_step(stream, run.module, cfg.train.grad_accum)
    agreed = agree(accelerator, upcoming=upcoming)
    together = range(warmup + steps + 1, warmup + 2 * steps + 1)  # the steps timed as the loop runs them
    first = together.stop
    profiler, stop = StepProfiler([first, first + profiled - 1], scratch, 0), StopRequest()
    measured = {"seconds": [], "tokens": 0, "positions": 0, "losses": [], "coverage": [], "trace": None}
    measured |= {"together_s": 0.0, "together_tokens": 0}
    stats = []  # read after the steps: reading them is a wait for the device
    run.drafter.train()
    for number in range(1, first + profiled):
        profiler.before_step(number)
        if number not in together or number == together.start:
            sync(accelerator.device)
            start = time.perf_counter()
        done = train_step(run, upcoming, agreed, stream, stop)
        if number not in together or number == together[-1]:
            sync(accelerator.device)
            seconds = time.perf_counter() - start
        measured["trace"] = profiler.after_step(number) or measured["trace"]
        upcoming, agreed = done.upcoming, done.agreed
        stats.append(done.stats)
        if warmup < number <= warmup + steps:
            measured["seconds"].append(seconds)
            measured["tokens"] += done.data.tokens
            measured["positions"] += done.data.positions
        if number in together:
            measured["together_tokens"] += done.data.tokens
            measured["together_s"] = seconds  # from the first of them, at the last
    for step_stats in stats:
        loss, count = step_stats["loss"].tolist()
        measured["losses"].append(loss / max(count, 1))
        if "vocab_coverage" in step_stats:
            covered, scored = step_stats["vocab_coverage"].tolist()
            measured["coverage"].append(covered / max(scored, 1))
    return measured


# The trainer step's profiler ranges (trainer/loop.py) -> the part of the step reported
RANGES = {
    "target_forward": "target_forward",
    "drafter_forward_backward": "drafter_forward_backward",
    "clip_grad_norm": "optimizer",
    "optimizer_step": "optimizer",
}
PARTS = ("target_forward", "drafter_forward_backward", "optimizer", "other")
PARTS_NOTE = (
    "from the profiler's trace of --profile-steps further steps (trace_parts): on a GPU the kernel time "
    "each part launched, on a CPU its wall time; other = the next step's micro-batches, the all-reduce, bookkeeping"
)
VOCABULARY_NOTE = (
    "operators with an input dimension of the target's or the draft vocabulary (lm_heads forward and "
    "backward, softmaxes, the losses over the vocabulary) in the target's forward and the drafter's forward "
    "and backward, as a share of the step's profiled time"
)
# the parts that launch most kernels, whose host wall time (`host_<part>`) beside their kernel time says whether the GPU
# waited for the host to launch them
HOST_PARTS = ("target_forward", "drafter_forward_backward")
LAUNCHES = ("cuda_runtime", "cuda_driver")  # the trace's categories of kernel launches (a kernel's start on the host)


def dimensions(dims) -> list[int]:
    """The sizes in a trace operator's "Input Dims" (nested lists: tensors, tensor lists)."""
    if isinstance(dims, int):
        return [dims]
    return [size for item in dims or [] for size in dimensions(item)]


def self_times(ops: list[dict]) -> dict[int, float]:
    """Each operator's own time (its duration less its nested operators'), by id(); `ops` of one thread."""
    own, open_ops = {}, []
    for op in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        while open_ops and open_ops[-1]["ts"] + open_ops[-1]["dur"] <= op["ts"]:
            open_ops.pop()
        if open_ops:
            own[id(open_ops[-1])] -= op["dur"]
        own[id(op)] = op["dur"]
        open_ops.append(op)
    return own


def trace_events(path: Path) -> list[dict]:
    """The complete events ("X") of a Chrome trace, read once for `trace_parts` and `kernel_table`."""
    return [e for e in json.loads(Path(path).read_text())["traceEvents"] if e.get("ph") == "X"]


def trace_parts(events: list[dict], vocab_sizes: set[int]) -> list[dict[str, float]]:
    """Seconds per part of each profiled step, and `vocabulary`, from the trainer's profiler trace (a
    Chrome trace). A step ends with its `optimizer_step` range; work belongs to the range it started in
    (the backward, which autograd may run on a thread of its own, starts while the step waits in
    `drafter_forward_backward`). On a GPU a part is the time of the kernels it launched and `total` all
    the step's kernel time; on a CPU a part is its ranges' wall time and `total` the step's.
    `vocabulary`: VOCABULARY_NOTE, their kernels on a GPU, their own time on a CPU. `host_<part>` (HOST_PARTS): the
    ranges' wall time.
    `total` on a GPU against the timed step's wall time (or a part's kernels against its host time) says whether
    the GPU ran all the while or waited for the host to launch its kernels."""
    ranges = sorted(
        (e for e in events if e.get("cat") == "user_annotation" and e["name"] in RANGES), key=lambda e: e["ts"]
    )
    ends = [e["ts"] + e["dur"] for e in ranges if e["name"] == "optimizer_step"]
    windows = [(e["ts"], e["ts"] + e["dur"], RANGES[e["name"]]) for e in ranges]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    host = [f"host_{part}" for part in HOST_PARTS]
    steps = [dict.fromkeys((*PARTS, "vocabulary", "total", *host), 0.0) for _ in ends]

    def place(ts: float) -> tuple[dict, str]:
        """(the step, the part) that work started at `ts` belongs to."""
        at = bisect.bisect_right(windows, (ts, float("inf"), "")) - 1
        part = windows[at][2] if at >= 0 and ts <= windows[at][1] else "other"
        return steps[min(bisect.bisect_left(ends, ts), len(ends) - 1)], part

    def in_vocabulary(op: dict | None, part: str) -> bool:
        dims = dimensions(op["args"].get("Input Dims")) if op else []
        return part in ("target_forward", "drafter_forward_backward") and not vocab_sizes.isdisjoint(dims)

    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    for start, end, part in windows:
        if part in HOST_PARTS:
            place(start)[0][f"host_{part}"] += end - start
    if kernels:
        by_id = {op["args"].get("External id"): op for op in ops}
        launches = {e["args"].get("correlation"): e["ts"] for e in events if e.get("cat") in LAUNCHES}
        for kernel in kernels:
            op = by_id.get(kernel["args"].get("External id"))
            step, part = place(launches.get(kernel["args"].get("correlation"), op["ts"] if op else kernel["ts"]))
            step[part] += kernel["dur"]
            step["total"] += kernel["dur"]
            step["vocabulary"] += kernel["dur"] if in_vocabulary(op, part) else 0.0
    else:
        for start, end, part in windows:
            place(start)[0][part] += end - start
        for step, start, end in zip(steps, [min(e["ts"] for e in events), *ends], ends):
            step["total"] = end - start
            step["other"] = step["total"] - sum(step[part] for part in PARTS if part != "other")
        threads: dict[tuple, list[dict]] = {}
        for op in ops:
            threads.setdefault((op["pid"], op["tid"]), []).append(op)
        for thread in threads.values():
            own = self_times(thread)
            for op in thread:
                step, part = place(op["ts"])
                step["vocabulary"] += own[id(op)] if in_vocabulary(op, part) and op["ts"] <= ends[-1] else 0.0
    return [{name: value / 1e6 for name, value in step.items()} for step in steps]


def kernel_table(events: list[dict], steps: int, count: int = 15) -> dict:
    """The kernels launched a step and the `count` GPU kernels (by name) of most time in the trace, each [name,
    milliseconds a step, launches a step]; empty on a CPU."""
    totals: dict[str, list[float]] = {}
    for event in events:
        if event.get("cat") == "kernel":
            total = totals.setdefault(event["name"][:120], [0.0, 0])
            total[0] += event["dur"]
            total[1] += 1
    if not totals:
        return {}
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return {
        "launches_per_step": sum(launches for _, launches in totals.values()) // steps,
        "top": [[name, round(us / 1e3 / steps, 3), launches // steps] for name, (us, launches) in ranked],
    }


def report(measured: dict, vocab_sizes: set[int]) -> dict:
    """The JSON fields both modes share: the timed steps' throughput and median, the profiled parts."""
    seconds, tokens = measured["seconds"], measured["tokens"]
    events = trace_events(measured["trace"])
    profiled = trace_parts(events, vocab_sizes)
    median = statistics.median(seconds)
    return {
        "timed_steps": len(seconds),
        "tokens_per_s": round(tokens / sum(seconds), 1),
        # the same number of steps back to back, as the loop runs them (the host may run ahead of the device)
        "tokens_per_s_together": round(measured["together_tokens"] / measured["together_s"], 1),
        "tokens_per_step": round(tokens / len(seconds), 1),
        "padding_fraction": round(1 - tokens / max(measured["positions"], 1), 4),
        "step_s_mean": round(sum(seconds) / len(seconds), 4),
        "step_s_median": round(median, 4),
        "profiled_steps": len(profiled),
        "part_s_median": {part: round(statistics.median(s[part] for s in profiled), 4) for part in PARTS},
        "parts_note": PARTS_NOTE,
        "host_s_median": {
            part: round(statistics.median(s[f"host_{part}"] for s in profiled), 4) for part in HOST_PARTS
        },
        "kernel_s_median": round(statistics.median(s["total"] for s in profiled), 4),
        "vocabulary_s_median": round(statistics.median(s["vocabulary"] for s in profiled), 4),
        "vocabulary_share": round(statistics.median(s["vocabulary"] / max(s["total"], 1e-12) for s in profiled), 4),
        "vocabulary_note": VOCABULARY_NOTE,
        "vocab_coverage": round(statistics.mean(measured["coverage"]), 4) if measured["coverage"] else None,
        "kernels": kernel_table(events, len(profiled)),
        "losses": [round(value, 4) for value in measured["losses"]],
    }


def vocabularies(target, drafter) -> set[int]:
    """The target's vocabulary size and the drafter's draft vocabulary's, where it has one."""
    sizes = {target.config.vocab_size, getattr(drafter.config, "draft_vocab_size", None)}
    return {size for size in sizes if size}


def bench(recipe: str, data: str, overrides: list[str], steps: int, warmup: int, profiled: int) -> dict:
    from accelerate import PartialState
    from omegaconf import OmegaConf

    from draftsmith.recipe import load_recipe
    from draftsmith.trainer.checkpoint import claim_output_dir
    from draftsmith.trainer.loop import end_run
    from draftsmith.trainer.setup import set_up

    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_recipe(
            [
                f"recipe={recipe}",
                f"data.train=[{json.dumps(str(data))}]",
                *overrides,
                f"train.max_steps={warmup + 2 * steps + profiled}",
                f"output_dir={scratch}/run",
            ]
        )
        # set_up writes into the output directory from its first checks on: held (and made) as train.py holds it
        with claim_output_dir(cfg, PartialState(cpu=not torch.cuda.is_available())):
            run = set_up(cfg, Path(cfg.output_dir))
            measured = time_steps(run, warmup, steps, profiled, Path(scratch))
            result = report(measured, vocabularies(run.target, run.accelerator.unwrap_model(run.drafter)))
            accelerator = run.accelerator
            del run  # see end_run
            end_run(accelerator)
    threads = torch.get_num_threads()
    return {
        "recipe": recipe,
        "drafter": cfg.drafter.type,
        "overrides": overrides,
        "data": str(data),
        "max_length": cfg.data.max_length,
        "micro_batch_size": cfg.train.micro_batch_size,
        "grad_accum": cfg.train.grad_accum,
        "pack": bool(cfg.data.pack),
        "ttt_steps": OmegaConf.select(cfg, "drafter.ttt_steps"),
        "draft_vocab_size": OmegaConf.select(cfg, "drafter.draft_vocab_size"),
        "warmup_steps": warmup,
        **result,
        # per torch thread (torch.get_num_threads())
        "tokens_per_s_per_core": round(result["tokens_per_s"] / threads, 1),
    }


# Named shapes: (transformers model type, config fields). Real models' published configs; the vocabulary
# and tied embeddings as theirs. `tiny` is draftsmith.tiny_config.TINY with an 8,192-token vocabulary.
SHAPES: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            rope_theta=500000.0,
            max_position_embeddings=131072,
        ),
    ),
    "qwen3-8b": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
        ),
    ),
    "qwen3-0.6b": (  # the speculators PR #1111 anchor shape
        "qwen3",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            vocab_size=151936,
            max_position_embeddings=40960,
        ),
    ),
    "smollm2-135m": (
        "llama",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "tiny": ("llama", dict(vocab_size=8192)),
}
KINDS = ("eagle3", "peagle", "dflash")
WEIGHTS_NOTE = "throughput does not depend on the weights' values (random weights)"
PAD, MASK = 0, 3  # the synthetic data's padding id and the mask token of P-EAGLE and DFlash
# The train section of the shapes' runs: recipes/eagle3.yaml's with these (then the user's overrides)
SHAPE_TRAIN = ["train.grad_accum=1", "train.lr=1e-4", "train.warmup_steps=0", "train.max_grad_norm=1.0"]


def shape_target(name: str, layers: int | None, device: torch.device, dtype: torch.dtype):
    """The random-weight target of shape `name` (built on `device` in `dtype`) and its config fields."""
    from draftsmith.random_target import build_model
    from draftsmith.tiny_config import build_config

    model_type, fields = SHAPES[name]
    fields = dict(fields)
    vocab = fields.pop("vocab_size")
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = build_config(model_type, vocab, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD}, **fields)
    config.use_cache = False
    model = build_model(config, std=0.02, device=device, dtype=dtype).requires_grad_(False)
    return model, {"model_type": model_type, "vocab_size": vocab, **fields}


def shape_size(name: str, layers: int | None) -> tuple[int, int]:
    """(vocabulary, decoder layers) of shape `name` (cut to `layers`), without building it."""
    from draftsmith.tiny_config import build_config

    model_type, fields = SHAPES[name]
    fields = dict(fields)
    vocab = fields.pop("vocab_size")
    return vocab, layers or build_config(model_type, vocab, {}, **fields).num_hidden_layers


def shape_recipe(kind: str, layers: int, draft_vocab: int) -> list[str]:
    """The recipe of `kind` at a shape of `layers` layers, before the user's overrides: its kind's recipe
    with the settings the random target needs (tap layers, draft vocabulary, mask token). The target's
    name is a label (the target is built here, never loaded), so the recipe is not checked against the demo's."""
    taps = "null" if layers >= 8 else f"[0,{layers // 2},{layers - 1}]"  # the kinds' defaults need 8 layers
    label = f"target.name_or_path=random/{kind}"
    if kind == "dflash":
        return ["recipe=dflash", label, f"drafter.mask_token_id={MASK}", f"drafter.target_layers={taps}"]
    recipe = ["recipe=eagle3", label, f"drafter.aux_layers={taps}", f"drafter.draft_vocab_size={draft_vocab}"]
    if kind == "peagle":
        recipe += ["drafter.parallel_drafting=true", f"drafter.mask_token_id={MASK}", "eval.tree=0"]
    return [*recipe, "data.draft_vocab=null"]


def shape_run(args, kind: str, scratch: Path):
    """The trainer's Run for `kind` at shape `args.shape`: its accelerator, optimizer, schedule and
    collator over synthetic rows (`--warmup` + `--steps` + `--profile-steps` steps of `--batch` rows), the
    drafter built from the recipe by the trainer's `build_drafter` (every drafter.* and train.* override
    honoured, train.vocab_chunk_mb included)."""
    from accelerate.utils import set_seed

    from draftsmith.data_prep.collate import Collator
    from draftsmith.recipe import load_recipe
    from draftsmith.trainer.launcher import make_accelerator
    from draftsmith.trainer.setup import build_drafter, online_features, prepare_run

    total = args.warmup + 2 * args.steps + args.profile_steps
    precision = "bf16" if args.dtype == "bfloat16" else "no"
    vocab, layers = shape_size(args.shape, args.layers)
    draft_vocab = min(args.draft_vocab or 32000, vocab // 2)  # pruned, as EAGLE-3 trains
    cfg = load_recipe(
        [
            *shape_recipe(kind, layers, draft_vocab),
            *SHAPE_TRAIN,
            f"train.micro_batch_size={args.batch}",
            f"train.mixed_precision={precision}",
            *args.overrides,
            f"train.max_steps={total}",
            f"output_dir={scratch / 'run'}",
        ]
    )
    accelerator = make_accelerator(cfg, scratch / "run")
    if args.device and torch.device(args.device).type != accelerator.device.type:
        print(f"error: --device {args.device}: the trainer runs on {accelerator.device} here", file=sys.stderr)
        sys.exit(2)  # bad input, as every refusal of the benchmarks
    set_seed(cfg.train.seed)
    target, fields = shape_target(args.shape, args.layers, accelerator.device, getattr(torch, args.dtype))
    with torch.no_grad():  # the target's argmax in the draft vocabulary, as on real data (see the module doc)
        target.get_output_embeddings().weight[:draft_vocab].mul_(4.0)
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(MASK + 1, draft_vocab, (args.seq,), generator=generator).tolist(),
            "loss_mask": [1] * args.seq,
        }
        for _ in range(args.batch * total)
    ]
    drafter = build_drafter(cfg, target, accelerator.device)
    drafter.prepare(rows)
    if args.compile:  # automatic dynamic shapes: the positions scored per draft step vary, the rows do not
        drafter.compile()
    features = online_features(target, drafter.request, cfg.train.compile_target)
    return prepare_run(cfg, accelerator, target, drafter, rows, Collator(PAD), features), fields


def bench_shape(args, kind: str) -> dict:
    """One kind's online training at a named shape: `--warmup` untimed, `--steps` timed and
    `--profile-steps` profiled steps of the trainer's `train_step`."""
    from dataclasses import asdict

    from draftsmith.trainer.loop import end_run
    from draftsmith.trainer.observe import FlopCounter, mfu, parameter_counts

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as scratch:
        run, fields = shape_run(args, kind, Path(scratch))
        accelerator, drafter = run.accelerator, run.accelerator.unwrap_model(run.drafter)
        vocab_sizes = vocabularies(run.target, drafter)
        if vocab_sizes & {args.seq, args.seq * args.batch}:  # trace_parts would count every row-sized operator
            print(
                f"error: --seq {args.seq} x --batch {args.batch}: a row dimension equals a vocabulary size "
                f"{vocab_sizes}: give another",
                file=sys.stderr,
            )
            sys.exit(2)
        measured = time_steps(run, args.warmup, args.steps, args.profile_steps, Path(scratch))
        result = report(measured, vocab_sizes)
        flops = FlopCounter(run.target, drafter).per_token(args.seq)
        counts = parameter_counts(run.target, drafter)
        layers, config = run.target.config.num_hidden_layers, asdict(drafter.config)
        vocab_chunk_mb = run.cfg.train.vocab_chunk_mb
        del run  # see end_run
        end_run(accelerator)
    device = accelerator.device
    tokens_per_s = result["tokens_per_s"]
    result = {
        "kind": kind,
        "shape": args.shape,
        "target": fields,
        "layers": layers,
        "drafter": {k: v for k, v in config.items() if k != "decoder"},
        "vocab_chunk_mb": vocab_chunk_mb,
        "seq": args.seq,
        "batch": args.batch,
        "overrides": args.overrides,
        "warmup_steps": args.warmup,
        **result,
        "flops_per_token": {k: round(v) for k, v in flops.items()},
        "model_tflops_per_s": round(flops["total"] * tokens_per_s / 1e12, 4),
        "mfu": round(mfu(flops["total"], tokens_per_s, args.peak_tflops), 4) if args.peak_tflops else None,
        "peak_tflops": args.peak_tflops,
        "parameters": counts,
        "device": device_name(device),
        "dtype": args.dtype,
        "autocast": "bfloat16" if args.dtype == "bfloat16" else None,
        "compiled": args.compile,
        "note": WEIGHTS_NOTE,
    }
    if device.type == "cuda":
        result["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    else:
        result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return result


def json_output():
    """Where the JSON goes: this process's stdout, while everything else written to stdout (DeepSpeed's
    logger, which accelerate starts, prints there) goes to stderr from now on."""
    sys.stdout.flush()
    output = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return output


def main_shape(args, output) -> None:
    from draftsmith.errors import UserError

    torch.set_num_threads(args.threads)
    for kind in args.kinds:
        start = time.perf_counter()
        try:
            result = bench_shape(args, kind)
        except UserError as err:  # an override the kind's recipe does not take, say: bad input, exit 2
            print(f"error: {kind}: {err}", file=sys.stderr)
            sys.exit(2)
        result["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
        result |= provenance(torch.get_num_threads(), start)
        print(json.dumps(result), file=output, flush=True)


# Options of one mode -> their defaults (None: the mode decides); given to the other mode, which would ignore them,
# they are refused.
SHAPE_ONLY = {
    "kinds": list(KINDS),
    "seq": 2048,
    "batch": 1,
    "layers": None,
    "draft_vocab": None,
    "device": None,
    "dtype": None,
    "peak_tflops": None,
    "compile": False,
}
RECIPE_ONLY = {"recipe": "eagle3_smollm2", "data": str(DEFAULT_DATA)}
MODES = (("shape", SHAPE_ONLY), ("recipe", RECIPE_ONLY))


def flags(dests: list[str]) -> str:
    return ", ".join(f"--{dest.replace('_', '-')}" for dest in dests)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, KEY=VALUE")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a named real model's shape, random weights")
    parser.add_argument("--kinds", type=names_of(KINDS), help="with --shape: eagle3, peagle, dflash (default all 3)")
    parser.add_argument("--seq", type=int, help="with --shape: tokens per row (default 2048)")
    parser.add_argument("--batch", type=int, help="with --shape: rows per step (default 1)")
    parser.add_argument("--layers", type=int, help="with --shape: decoder layers instead of the shape's")
    parser.add_argument(
        "--draft-vocab", type=int, help="with --shape: EAGLE-3's draft vocabulary (default min(32000, vocab / 2))"
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="with --shape: where the trainer runs (a check: cuda when there is one)",
    )
    parser.add_argument("--dtype", help="with --shape: the target's dtype (default bfloat16 on cuda, else float32)")
    parser.add_argument(
        "--peak-tflops", type=float, help="with --shape: the device's peak TFLOP/s for MFU (989: H100 dense bf16)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --shape: torch.compile the drafter (nn.Module.compile) before the steps",
    )
    parser.add_argument("--recipe", help="without --shape: the recipe trained (default eagle3_smollm2)")
    parser.add_argument(
        "--data", help="without --shape: conversations file (data.train); default the bundled regenerated demo data"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps last, for the step's parts")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    if min(args.steps, args.profile_steps) < 1 or args.warmup < 0:
        parser.error("--steps and --profile-steps must be >= 1, --warmup >= 0")
    given = {  # a flag's value given (0 too, which `not in (None, False)` would take for unset: 0 == False)
        mode: [dest for dest in options if getattr(args, dest) is not None and getattr(args, dest) is not False]
        for mode, options in MODES
    }
    if args.shape and given["recipe"]:
        parser.error(f"{flags(given['recipe'])}: without --shape only (a shape builds its own target and rows)")
    if not args.shape and given["shape"]:
        parser.error(f"{flags(given['shape'])}: with --shape only (without it the recipe's own target trains)")
    for dest, default in (SHAPE_ONLY if args.shape else RECIPE_ONLY).items():
        setattr(args, dest, default if getattr(args, dest) is None else getattr(args, dest))
    output = json_output()
    if args.shape:
        args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
        return main_shape(args, output)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = bench(args.recipe, args.data, args.overrides, args.steps, args.warmup, args.profile_steps)
    result |= {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        **provenance(torch.get_num_threads(), start),
    }
    print(json.dumps(result, indent=2), file=output, flush=True)


if __name__ == "__main__":
    main()
