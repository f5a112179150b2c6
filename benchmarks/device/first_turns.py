"""The device's regeneration input: the first N records of `named:sharegpt` (default 16,800: ShareGPT records
1-16,800, as the first-turn folders of benchmarks/data read them), each cut after its first answer.

    python benchmarks/device/first_turns.py .gpu/sharegpt_first_turns_0_16800.jsonl.gz

A regeneration with `max_turns: 1` (the recipe eagle3_sharegpt_smollm2) answers only the first user turn and
writes only the first exchange, so the later turns need not travel: the whole records (the
runs/sharegpt_0_16800.jsonl.gz of ../data/sharegpt_smollm2_later_turns/README.md) are 24 MiB, more than a call
has room for beside the GGUF. The records keep their order and fields; the file's bytes depend only on them
(gzip's time fixed), so the same command always gives the same `data` digest in `regenerate.settings`.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from draftsmith.data_prep.sources import named_file


def first_turns(out: Path, count: int = 16800) -> int:
    """Write the first `count` records cut after their first assistant turn; returns how many."""
    records = []
    with gzip.open(named_file("named:sharegpt"), "rt", encoding="utf-8") as source:
        for line in source:
            if len(records) == count:
                break
            record = json.loads(line)
            roles = [message["role"] for message in record["messages"]]
            record["messages"] = record["messages"][: roles.index("assistant") + 1]
            records.append(record)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode())
    return len(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("count", type=int, nargs="?", default=16800)
    args = parser.parse_args()
    written = first_turns(args.out, args.count)
    print(f"{args.out}: {written:,} records, {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
