"""What one long answer costs to tokenize into a training row: `render_rows` on a conversation whose answer is many
megabytes of words, its row cut to data.max_length tokens (as train and capture make it), beside the same text
encoded whole (as before 2026-12-06, and still where no cut applies). Each size and way runs in a fresh process, so
its peak memory is its own. Prints JSON (a row per size and way: seconds, peak RSS, tokens; the machine, versions
and wall time: benchmarks/provenance.py), a line per row to stderr. The reference target's tokenizer (a byte-level
BPE, bundled in demo/target).

    python benchmarks/long_rows.py                      # 4, 20 and 80 MB answers, max_length 2048; whole up to 4 MB
    python benchmarks/long_rows.py --megabytes 1 --whole-up-to 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import resource
import sys
import time
from pathlib import Path

from provenance import provenance

TOKENIZER = Path(__file__).resolve().parent.parent / "demo" / "target"
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, nargs="+", default=[4, 20, 80], help="the answers' sizes")
    parser.add_argument("--max-length", type=int, default=2048, help="data.max_length: the tokens a row keeps")
    parser.add_argument(
        "--whole-up-to", type=float, default=4, help="encode whole only the answers this size or smaller (MB)"
    )
    args = parser.parse_args()
    if min(args.megabytes) <= 0 or args.max_length < 1:
        parser.error("--megabytes must be above 0 and --max-length at least 1")
    began = time.perf_counter()
    rows = []
    context = multiprocessing.get_context("spawn")  # a fresh process a row: its peak RSS is that row's alone
    for megabytes in args.megabytes:
        for way in ("cut", "whole") if megabytes <= args.whole_up_to else ("cut",):
            with context.Pool(1) as pool:
                row = pool.apply(measured, (megabytes, args.max_length if way == "cut" else None))
            rows.append({"megabytes": megabytes, "way": way, **row})
            print(
                f"{megabytes:g} MB {way}: {row['seconds']:.2f} s, {row['peak_rss_gb']:.2f} GB peak, "
                f"{row['tokens']:,} tokens",
                file=sys.stderr,
            )
    # the tokenizer's own threads are not set: it encodes one text, mostly on one
    print(json.dumps({"max_length": args.max_length, "rows": rows} | provenance(None, began), indent=2))


def measured(megabytes: float, kept_tokens: int | None) -> dict:
    """`render_rows` of one conversation whose answer is `megabytes` of words, in this process."""
    from draftsmith.data_prep.template import render_rows
    from draftsmith.target import load_tokenizer

    tokenizer = load_tokenizer(str(TOKENIZER))
    rng = random.Random(0)
    answer = " ".join(rng.choice(WORDS) for _ in range(int(megabytes * 1e6) // 6))
    messages = [{"role": "user", "content": "Summarise this."}, {"role": "assistant", "content": answer}]
    start = time.perf_counter()
    ((ids, _),) = render_rows(tokenizer, messages, kept_tokens=kept_tokens)
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak, Linux's unit
    return {"seconds": round(seconds, 3), "peak_rss_gb": round(peak_kb / 2**20, 3), "tokens": len(ids)}


if __name__ == "__main__":
    main()
