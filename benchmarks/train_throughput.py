"""Training throughput of a drafter against its real target (default: EAGLE-3 for SmolLM2-135M-Instruct),
full training steps as the trainer runs them, as JSON.

    python benchmarks/train_throughput.py [--recipe eagle3_smollm2] [--data FILE] [--steps 8]
                                          [--warmup 2] [--threads 2] [KEY=VALUE ...]

KEY=VALUE are recipe overrides, as `train.py` takes them (e.g. drafter.ttt_steps=7
data.max_length=256 train.micro_batch_size=4 data.pack=true). The data is `--data` (default the
bundled demo conversations whose answers SmolLM2 regenerated, demo/data/train.regenerated.jsonl.gz),
tokenized and drawn into micro-batches exactly as trainer/loop.py does (`load_tokenized`, the seeded
`micro_batches`, `Collator` or with data.pack `PackingCollator`); the drafter is built and prepared as
there (seed, `from_target`, `prepare` on the training data, AdamW over `param_groups`).

A timed step is the trainer's step on one micro-batch, in four parts, each timed on its own:
`target` the frozen target's forward under no_grad (`run_target` with the drafter's request),
`drafter` the drafter's forward and loss, `backward`, and `optimizer` (gradient clipping, AdamW step,
zero_grad). After `--warmup` untimed steps, `--steps` steps are timed; the report gives real tokens
(padding not counted, as the trainer's train/tokens_per_s) per second over the timed steps, per
core (torch thread), the median step and each part's median, the losses of every step (same data and
seed give the same losses on any code that learns the same thing, up to float rounding), the peak RSS
of the process, and the machine (CPU model, torch version and threads). The machine may be shared:
compare two versions by alternating runs of both and taking medians, not by one run each; and with
other jobs on the cores, more torch threads than free cores make every parallel op wait for a
descheduled thread (on a 2-core machine running another job, --threads 1 was 4x faster than 2).

Real shapes without downloads (issue #37):

    python benchmarks/train_throughput.py --shape NAME [--kinds eagle3,peagle,dflash] [--seq 2048]
        [--batch 1] [--layers N] [--device cuda] [--dtype bfloat16] [--peak-tflops 989] [--draft-chunk-mb MB]

builds a random-weight target of a named real model's shape (SHAPES below: llama-3.1-8b, qwen3-8b,
qwen3-0.6b, qwen3-30b-a3b, smollm2-135m, tiny) with draftsmith.random_target, directly on the device in
the given dtype (an 8B shape never exists on the CPU), and measures online training of each kind on
synthetic rows of `--seq` random tokens, every position supervised, `--batch` rows per step: one JSON
object per kind with tokens/s, MFU (with --peak-tflops; FLOP count: draftsmith.trainer.observe), peak
memory, the step's parts (target forward, drafter forward + backward, optimizer) and, for the EAGLE-3
kinds, the share of the step spent in the vocabulary projections and softmaxes. The drafter trains as the
trainer trains it: float32 weights, under bf16 autocast when --dtype is bfloat16. Throughput does not
depend on the weights' values, with one exception handled here: EAGLE-3 sends only positions whose
target argmax is in its draft vocabulary through its lm_head, so the target's lm_head rows of the draft
vocabulary (the ids the synthetic data draws from) are scaled up and its argmax falls there, as on real
data (the reported `vocab_coverage` says how often). `--layers N` cuts the decoder to N layers (CPU
runs of big shapes); `--draft-chunk-mb` sets EAGLE-3's draft-loss tile (heads/eagle3.py
DRAFT_CHUNK_BYTES; 0 = never tiled), to compare the tiled loss with the untiled one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO / "demo" / "data" / "train.regenerated.jsonl.gz"


def cpu_model() -> str:
    """The CPU's model name (lscpu), else what platform knows."""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def bench(recipe: str, data: str, overrides: list[str], steps: int, warmup: int) -> dict:
    from omegaconf import OmegaConf

    from draftsmith.data_prep import Collator, PackingCollator, load_tokenized
    from draftsmith.heads import drafter_class
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.recipe import load_recipe
    from draftsmith.target import load_target, load_tokenizer, run_target
    from draftsmith.trainer.checkpoint import TrainerState
    from draftsmith.trainer.loop import micro_batches

    with tempfile.TemporaryDirectory() as scratch:
        cfg = load_recipe(
            [f"recipe={recipe}", f"data.train=[{json.dumps(str(data))}]", *overrides, f"output_dir={scratch}/run"]
        )
    tokenizer = load_tokenizer(cfg.target)
    train_data = load_tokenized(cfg, cfg.data.train, tokenizer, "data.train")
    target = load_target(cfg.target)
    torch.manual_seed(cfg.train.seed)
    drafter = drafter_class(cfg.drafter.type).from_target(
        OmegaConf.to_object(cfg.drafter), target, cfg.target.name_or_path
    )
    drafter.prepare(train_data)
    groups = [{"params": params, "lr": cfg.train.lr * scale} for params, scale in drafter.param_groups()]
    optimizer = torch.optim.AdamW(
        groups, lr=cfg.train.lr, betas=tuple(cfg.train.adam_betas), weight_decay=cfg.train.weight_decay
    )
    request = drafter.request
    collate = (
        PackingCollator(tokenizer.pad_token_id, cfg.data.pack_length or cfg.data.max_length)
        if cfg.data.pack
        else Collator(tokenizer.pad_token_id)
    )
    drafter.train()

    parts = ("target", "drafter", "backward", "optimizer")
    seconds: dict[str, list[float]] = {part: [] for part in (*parts, "step")}
    losses, tokens, positions = [], 0, 0
    stream = micro_batches(train_data, collate, cfg, 1, 0, TrainerState())
    for index in range(warmup + steps):
        _, _, batch = next(stream)
        clock = [time.perf_counter()]
        with torch.no_grad():
            target_out = run_target(target, batch["input_ids"], request=request, **causal_lm_inputs(batch))
        clock.append(time.perf_counter())
        loss, count, _ = drafter(batch, target_out)
        clock.append(time.perf_counter())
        (loss / count.clamp(min=1)).backward()  # the per-token loss (heads/base.py)
        clock.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.train.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.append(time.perf_counter())
        del target_out
        losses.append(float(loss.detach()))
        if index < warmup:
            continue
        for part, start, stop in zip(parts, clock, clock[1:]):
            seconds[part].append(stop - start)
        seconds["step"].append(clock[-1] - clock[0])
        tokens += int(batch["attention_mask"].sum())
        positions += batch["input_ids"].numel()

    total = sum(seconds["step"])
    threads = torch.get_num_threads()
    return {
        "recipe": recipe,
        "drafter": cfg.drafter.type,
        "overrides": overrides,
        "data": str(data),
        "max_length": cfg.data.max_length,
        "micro_batch_size": cfg.train.micro_batch_size,
        "pack": bool(cfg.data.pack),
        "ttt_steps": OmegaConf.select(cfg, "drafter.ttt_steps"),
        "draft_vocab_size": OmegaConf.select(cfg, "drafter.draft_vocab_size"),
        "warmup_steps": warmup,
        "timed_steps": steps,
        "tokens_per_s": round(tokens / total, 1),
        "tokens_per_s_per_core": round(tokens / total / threads, 1),  # per torch thread (torch.get_num_threads())
        "tokens_per_step": round(tokens / steps, 1),
        "padding_fraction": round(1 - tokens / max(positions, 1), 4),
        "step_s_mean": round(total / steps, 4),
        "step_s_median": round(statistics.median(seconds["step"]), 4),
        "part_s_median": {part: round(statistics.median(seconds[part]), 4) for part in parts},
        "part_s_mean": {part: round(sum(seconds[part]) / steps, 4) for part in parts},
        "losses": [round(value, 6) for value in losses],
    }


# Named shapes: (transformers model type, config fields). Real models' published configs; the vocabulary
# and tied embeddings as theirs. `tiny` is draftsmith.random_target.TINY with an 8,192-token vocabulary.
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def shape_target(name: str, layers: int | None, device: torch.device, dtype: torch.dtype):
    """The random-weight target of shape `name` (built on `device` in `dtype`) and its config fields."""
    from draftsmith.random_target import build_config, build_model

    model_type, fields = SHAPES[name]
    fields = dict(fields)
    vocab = fields.pop("vocab_size")
    if layers is not None:
        fields["num_hidden_layers"] = layers
    config = build_config(model_type, vocab, {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": PAD}, **fields)
    config.use_cache = False
    model = build_model(config, std=0.02, device=device, dtype=dtype).requires_grad_(False)
    return model, {"model_type": model_type, "vocab_size": vocab, **fields}


def shape_drafter(kind: str, target, vocab: int, draft_vocab: int):
    from draftsmith.heads import drafter_class

    layers = target.config.num_hidden_layers
    if kind == "dflash":
        cls = drafter_class("dflash")
        config = cls.Config(mask_token_id=MASK, target_layers=None if layers >= 8 else [0, layers // 2, layers - 1])
    else:
        cls = drafter_class("eagle3")
        aux = None if layers >= 8 else [0, layers // 2, layers - 1]  # EAGLE-3's default needs 8 layers
        config = cls.Config(
            aux_layers=aux,
            draft_vocab_size=draft_vocab,
            parallel_drafting=kind == "peagle",
            mask_token_id=MASK if kind == "peagle" else None,
        )
    return cls.from_target(config, target, f"random:{kind}")


def bench_shape(args, kind: str) -> dict:
    """One kind's online training at a named shape: `--warmup` untimed then `--steps` timed steps."""
    from dataclasses import asdict

    from draftsmith.data_prep import Collator
    from draftsmith.heads.eagle3 import Eagle3
    from draftsmith.heads.packing import causal_lm_inputs
    from draftsmith.target import run_target
    from draftsmith.trainer.observe import FlopCounter, mfu, parameter_counts

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.draft_chunk_mb is not None:
        Eagle3.DRAFT_CHUNK_BYTES = int(args.draft_chunk_mb * 2**20) if args.draft_chunk_mb > 0 else 1 << 62
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(0)
    target, fields = shape_target(args.shape, args.layers, device, dtype)
    vocab = fields["vocab_size"]
    draft_vocab = min(args.draft_vocab or 32000, vocab // 2)  # pruned, as EAGLE-3 trains
    with torch.no_grad():  # the target's argmax in the draft vocabulary, as on real data (see the module doc)
        target.get_output_embeddings().weight[:draft_vocab].mul_(4.0)
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "input_ids": torch.randint(MASK + 1, draft_vocab, (args.seq,), generator=generator).tolist(),
            "loss_mask": [1] * args.seq,
        }
        for _ in range(args.batch * (args.warmup + args.steps))
    ]
    drafter = shape_drafter(kind, target, vocab, draft_vocab)
    drafter.prepare(rows)
    drafter.to(device).train()
    if args.compile:  # automatic dynamic shapes: the positions scored per draft step vary, the rows do not
        drafter.compile()
    optimizer = torch.optim.AdamW([{"params": params, "lr": 1e-4 * scale} for params, scale in drafter.param_groups()])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
    collate, request = Collator(PAD), drafter.request

    # The vocabulary's share (EAGLE-3 kinds): the target's distribution is timed where it runs (no grad);
    # the draft side's forward + backward is replayed on the step's own inputs after the step.
    vocab_seconds, draft_calls = [0.0], []
    timed_vocabulary = isinstance(drafter, Eagle3) and not args.compile  # its timers would break the compiled graph
    if timed_vocabulary:
        target_distribution, draft_loss = drafter.target_distribution, drafter.draft_loss

        def timed_distribution(*a, **k):
            sync(device)
            start = time.perf_counter()
            out = target_distribution(*a, **k)
            sync(device)
            vocab_seconds[0] += time.perf_counter() - start
            return out

        def recorded_loss(outputs, p, slot):
            draft_calls.append((outputs.detach(), p, slot))
            return draft_loss(outputs, p, slot)

        drafter.target_distribution, drafter.draft_loss = timed_distribution, recorded_loss

    parts = ("target_forward", "drafter_forward_backward", "optimizer")
    seconds: dict[str, list[float]] = {part: [] for part in (*parts, "step", "vocabulary")}
    stats_coverage, losses = [], []
    for index in range(args.warmup + args.steps):
        batch = collate(rows[index * args.batch : (index + 1) * args.batch])
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        count = int(drafter.loss_tokens(batch))  # on the host before the step, as the trainer counts
        vocab_seconds[0], draft_calls[:] = 0.0, []
        sync(device)
        clock = [time.perf_counter()]
        with torch.no_grad():
            target_out = run_target(target, batch["input_ids"], request=request, **causal_lm_inputs(batch))
        sync(device)
        clock.append(time.perf_counter())
        with autocast:
            loss, _, stats = drafter(batch, target_out)
        (loss / max(count, 1)).backward()
        sync(device)
        clock.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        clock.append(time.perf_counter())
        del target_out
        losses.append(float(loss.detach()) / max(count, 1))
        if "vocab_coverage" in stats:
            coverage = stats["vocab_coverage"].sum(0)
            stats_coverage.append(float(coverage[0] / coverage[1].clamp(min=1)))
        vocab = vocab_seconds[0]
        for outputs, p, slot in draft_calls:  # the draft side's forward + backward, replayed
            features = outputs.clone().requires_grad_(True)
            sync(device)
            start = time.perf_counter()
            with autocast:
                token_loss, _ = Eagle3.draft_loss(drafter, features, p, slot)  # not the recording wrapper
            token_loss.sum().backward()
            sync(device)
            vocab += time.perf_counter() - start
        drafter.zero_grad(set_to_none=True)
        if index < args.warmup:
            continue
        for part, start, stop in zip(parts, clock, clock[1:]):
            seconds[part].append(stop - start)
        seconds["step"].append(clock[-1] - clock[0])
        seconds["vocabulary"].append(vocab)

    tokens = args.batch * args.seq  # every position is a real token (no padding)
    step = statistics.median(seconds["step"])
    tokens_per_s = tokens / step
    flops = FlopCounter(target, drafter).per_token(args.seq)
    result = {
        "kind": kind,
        "shape": args.shape,
        "target": fields,
        "layers": target.config.num_hidden_layers,
        "drafter": {k: v for k, v in asdict(drafter.config).items() if k != "decoder"},
        "seq": args.seq,
        "batch": args.batch,
        "tokens_per_step": tokens,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "tokens_per_s": round(tokens_per_s, 1),
        "step_s_median": round(step, 4),
        "part_s_median": {part: round(statistics.median(seconds[part]), 4) for part in parts},
        "flops_per_token": {k: round(v) for k, v in flops.items()},
        "model_tflops_per_s": round(flops["total"] * tokens_per_s / 1e12, 4),
        "mfu": round(mfu(flops["total"], tokens_per_s, args.peak_tflops), 4) if args.peak_tflops else None,
        "peak_tflops": args.peak_tflops,
        "parameters": parameter_counts(target, drafter),
        "losses": [round(value, 4) for value in losses],
        "device": device_name(device),
        "dtype": args.dtype,
        "autocast": "bfloat16" if dtype == torch.bfloat16 else None,
        "compiled": args.compile,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "note": WEIGHTS_NOTE,
    }
    if timed_vocabulary:
        share = statistics.median(seconds["vocabulary"])
        result |= {
            "vocabulary_s_median": round(share, 4),
            "vocabulary_share": round(share / step, 4),
            "vocabulary_note": "target's distribution (full-vocabulary lm_head, softmax) as timed in the step, "
            "plus the draft lm_head + log-softmax + loss forward and backward replayed on the step's inputs",
            "vocab_coverage": round(statistics.mean(stats_coverage), 4) if stats_coverage else None,
            "draft_chunk_bytes": Eagle3.DRAFT_CHUNK_BYTES,
        }
    if device.type == "cuda":
        result["peak_memory_mb"] = round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    else:
        result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return result


def main_shape(args) -> None:
    torch.set_num_threads(args.threads)
    for kind in args.kinds.split(","):
        if kind not in KINDS:
            sys.exit(f"--kinds: {kind!r} is not one of {', '.join(KINDS)}")
        start = time.perf_counter()
        result = bench_shape(args, kind)
        result["wall_s"] = round(time.perf_counter() - start, 1)
        result["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, KEY=VALUE")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a named real model's shape, random weights")
    parser.add_argument("--kinds", default=",".join(KINDS), help="with --shape: eagle3, peagle, dflash")
    parser.add_argument("--seq", type=int, default=2048, help="with --shape: tokens per row")
    parser.add_argument("--batch", type=int, default=1, help="with --shape: rows per step")
    parser.add_argument("--layers", type=int, help="with --shape: decoder layers instead of the shape's")
    parser.add_argument(
        "--draft-vocab", type=int, help="with --shape: EAGLE-3's draft vocabulary (default min(32000, vocab / 2))"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", help="with --shape: the target's dtype (default bfloat16 on cuda, else float32)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s for MFU (989: H100 dense bf16)")
    parser.add_argument("--draft-chunk-mb", type=float, help="EAGLE-3's draft-loss tile in MiB; 0 = untiled")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="with --shape: torch.compile the drafter (nn.Module.compile) before the steps",
    )
    parser.add_argument("--recipe", default="eagle3_smollm2")
    parser.add_argument(
        "--data",
        default=str(DEFAULT_DATA),
        help="conversations file (data.train); default the bundled regenerated demo data",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = parser.parse_args()
    if args.shape:
        args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
        return main_shape(args)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    result = bench(args.recipe, args.data, args.overrides, args.steps, args.warmup)
    result |= {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "machine": {
            "cpu": cpu_model(),
            "processor": platform.processor(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
