"""Seconds per optimizer step of a probe run, from its log.jsonl (the last logged interval), as JSON."""

import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if '"train/tokens_per_s"' in line]
last = rows[-1]
prev = rows[-2] if len(rows) > 1 else {"train/tokens": 0, "step": 0}
per_step = (last["train/tokens"] - prev["train/tokens"]) / (last["step"] - prev["step"])
print(
    json.dumps(
        {
            "s_per_step": per_step / last["train/tokens_per_s"],
            "tokens_per_step": per_step,
            "tokens_per_s": last["train/tokens_per_s"],
            "rows": len(rows),
        }
    )
)
