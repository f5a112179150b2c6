"""The operators one trainer step dispatches, by part of the step, as JSON: what a GPU launches a kernel for, so
the host's share of a small shape's step (issue #61: Qwen3-0.6B's 3-step EAGLE-3 step on an H200 launched 1,515
kernels and waited for the host) is counted on any machine.

    python benchmarks/step_operators.py [--shape qwen3-0.6b] [--layers 4] [--seq 64] [--batch 1] [--kind eagle3]
                                        [--top 12] [KEY=VALUE ...]

Builds the run as `benchmarks/train_throughput.py --shape` does (the trainer's set-up, its `train_step`, a
random-weight target of the named shape, on the CPU in float32, `--layers` of its decoder), takes two steps, then
counts a third's operators under a TorchDispatchMode: every operator that reaches the kernels (views, which
launch none, left out), by the profiler range it runs in (the target's forward, the drafter's forward and
backward, the optimizer, the rest), the most frequent per part, and the drafter's by the draftsmith function
that issued them (its backward runs in the trainer's `forward_backward`). The counts do not depend on the weights
nor, for a fixed-shape loss, on the data. torch.compile does not run under a dispatch mode, so the train.compile_*
settings, which would be ignored, are refused (exit 2): what a compiled part launches is the GPU benchmark's.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import train_throughput
from provenance import provenance
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE = Path(train_throughput.__file__).resolve().parents[1]  # draftsmith's source: where an operator came from
# operators that launch no kernel: views, shape queries, allocations without a fill
NO_KERNEL = {
    "_reshape_alias", "_unsafe_view", "alias", "as_strided", "chunk", "detach", "diagonal", "empty", "empty_like",
    "empty_strided", "expand", "expand_as", "flatten", "lift_fresh", "movedim", "narrow", "new_empty",
    "new_empty_strided", "permute", "reshape", "select", "slice", "split", "split_with_sizes", "squeeze",
    "sym_numel", "sym_size", "sym_storage_offset", "sym_stride", "t", "transpose", "unbind", "unflatten",
    "unfold", "unsqueeze", "view", "view_as",
}  # fmt: skip
PARTS = train_throughput.RANGES  # the trainer's profiler range -> the part of the step


class Operators(TorchDispatchMode):
    """Counts the operators dispatched while on, by the innermost of the trainer's profiler ranges around them."""

    def __init__(self):
        super().__init__()
        self.ranges: list[str] = []
        self.parts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.drafter_sources: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "profiler":  # a record_function range opening or closing
            if "enter" in func.__name__:
                self.ranges.append(str(args[0]))
            elif self.ranges:
                self.ranges.pop()
        elif name not in NO_KERNEL:
            part = next((PARTS[r] for r in reversed(self.ranges) if r in PARTS), "other")
            self.parts[part][f"{func.namespace}.{name}"] += 1
            if part == "drafter_forward_backward":
                self.drafter_sources[source()] += 1
        return func(*args, **(kwargs or {}))


def source() -> str:
    """The innermost draftsmith function on the stack (file:function), the caller of transformers or torch."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(PACKAGE) and "benchmarks" not in path.parts:
            return f"{path.relative_to(PACKAGE)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def count(args) -> dict:
    from draftsmith.errors import StopRequest
    from draftsmith.trainer.loop import agree, micro_batches, next_step, train_step

    shape = argparse.Namespace(
        shape=args.shape, layers=args.layers, seq=args.seq, batch=args.batch, dtype="float32", device="cpu",
        draft_vocab=None, warmup=2, steps=1, profile_steps=0, compile=False, overrides=args.overrides,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        run, fields = train_throughput.shape_run(shape, args.kind, Path(scratch))
        stream = micro_batches(run.train_data, run.collate, run.cfg, 1, 0, run.state)
        upcoming = next_step(stream, run.module, run.cfg.train.grad_accum)
        agreed = agree(run.accelerator, upcoming=upcoming)
        run.drafter.train()
        for _ in range(2):  # warm: the first steps build what later ones reuse
            done = train_step(run, upcoming, agreed, stream, StopRequest())
            upcoming, agreed = done.upcoming, done.agreed
        operators = Operators()
        # the trainer's ranges reach the dispatcher while a profiler records
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), operators:
            train_step(run, upcoming, agreed, stream, StopRequest())
    parts = {part: sum(counts.values()) for part, counts in operators.parts.items()}
    return {
        "kind": args.kind,
        "shape": args.shape,
        "target": fields,
        "layers": args.layers,
        "seq": args.seq,
        "batch": args.batch,
        "overrides": args.overrides,
        "operators": {"total": sum(parts.values()), **parts},
        "top": {part: counts.most_common(args.top) for part, counts in operators.parts.items()},
        "drafter_sources": operators.drafter_sources.most_common(args.top),
    }


def main() -> None:
    from draftsmith.errors import UserError

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="recipe overrides, KEY=VALUE")
    parser.add_argument("--shape", choices=sorted(train_throughput.SHAPES), default="qwen3-0.6b")
    parser.add_argument("--layers", type=int, default=4, help="the target's decoder layers (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per row (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="rows per step (default 1)")
    parser.add_argument("--kind", choices=train_throughput.KINDS, default="eagle3")
    parser.add_argument("--top", type=int, default=12, help="operators listed per part (default 12)")
    args = parser.parse_args()
    compiled = [o for o in args.overrides if o.startswith("train.compile_") and not o.endswith(("=false", "=False"))]
    if compiled:
        print(
            f"error: {' '.join(compiled)}: torch.compile does not run under the counting dispatch mode", file=sys.stderr
        )
        sys.exit(2)
    output = train_throughput.json_output()  # DeepSpeed's logger prints to stdout
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        result = count(args)
    except UserError as err:  # a setting the recipe refuses: bad input
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    result["command"] = " ".join(["python", *sys.argv])
    print(json.dumps(result | provenance(torch.get_num_threads(), start)), file=output, flush=True)


if __name__ == "__main__":
    main()
