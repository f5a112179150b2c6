"""How a DFlash training step's cost grows with sequence length T and anchors A, as JSON.

    python benchmarks/dflash_attention.py [--lengths 256,512,1024,2048] [--anchors 16,64,256]
                                          [--block-size 8] [--threads 2]

For each (T, A) a fresh process builds the `recipe=dflash` drafter for the bundled demo target, runs
the target once over a random sequence of T tokens (not timed), then times one drafter loss +
backward with A anchors (the median of 3) and reads the process's peak resident memory before and
after: `step_peak_mib` is how far the step raised it. Next to the measurements, the attention score
elements per layer and sequence: DFlash's two-part attention computes heads·A·S·(T+S) of them
(each block's queries against the context and against its own block), where one mask over every
block would need heads·(A·S)·(T+A·S); and the logits the loss computes, A·(S−1)·V at most. With the rows:
the machine, threads, versions and wall time (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance

REPO = Path(__file__).resolve().parent.parent


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def one(length: int, anchors: int, block_size: int, threads: int) -> dict:
    import torch

    from draftsmith.heads import drafter_class
    from draftsmith.resources import bundled
    from draftsmith.target import load_target, run_target

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    target = load_target(str(bundled("demo/target")))
    cls = drafter_class("dflash")
    config = cls.Config(num_layers=2, target_layers=[0, 1, 2], block_size=block_size, anchors=anchors)
    drafter = cls.from_target(config, target, "demo")
    vocab = target.config.vocab_size

    def step(tokens: int) -> float:
        ids = torch.randint(3, vocab, (1, tokens))
        batch = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}
        batch |= drafter.host_fields(batch)  # its blocks per row, counted on the host as the trainer does
        with torch.no_grad():
            out = run_target(target, ids, request=drafter.request)
        start = time.perf_counter()
        loss, count, _ = drafter(batch, out)
        (loss / count.clamp(min=1)).backward()
        drafter.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    step(64)  # warm up kernels and allocator at a small size
    with torch.no_grad():  # the target's forward at full length, so its memory is not the step's
        run_target(target, torch.randint(3, vocab, (1, length)), request=drafter.request)
    before = peak_mib()
    seconds = statistics.median(step(length) for _ in range(3))
    heads = target.config.num_attention_heads
    used = min(anchors, length - 1)  # every position but the last can anchor here (all tokens bear loss)
    return {
        "length": length,
        "anchors": used,
        "block_size": block_size,
        "step_s": round(seconds, 4),
        "step_peak_mib": round(peak_mib() - before, 1),
        "score_elements_per_layer": heads * used * block_size * (length + block_size),
        "dense_mask_score_elements_per_layer": heads * used * block_size * (length + used * block_size),
        "logit_elements": used * (block_size - 1) * vocab,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--anchors", default="16,64,256")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", nargs=2, type=int, metavar=("LENGTH", "ANCHORS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.block_size, args.threads)))
        return
    began, rows = time.perf_counter(), []
    for length in map(int, args.lengths.split(",")):
        for anchors in map(int, args.anchors.split(",")):
            command = [
                sys.executable,
                __file__,
                "--one",
                str(length),
                str(anchors),
                "--block-size",
                str(args.block_size),
                "--threads",
                str(args.threads),
            ]
            result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
            if result.returncode != 0:
                sys.exit(f"T={length} A={anchors} failed:\n{result.stderr[-2000:]}")
            rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), file=sys.stderr)
    report = {"target": "demo (4 heads, hidden 256, vocab 4096)", "rows": rows}
    print(json.dumps(report | provenance(args.threads, began), indent=2))


if __name__ == "__main__":
    main()
