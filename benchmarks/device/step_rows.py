"""One short line per JSON row of benchmarks/train_throughput.py or step_compare.py on stdin (step.sh prints
these; the whole rows stay in its logs): shape, rows, kind, TTT steps, tokens/s, MFU, peak memory, wall time."""

import json
import sys

for line in sys.stdin:
    row = json.loads(line)
    if "summary" in row:
        print(f"  compare {row['summary']}: tokens/s {row['tokens_per_s']}, speed-up {row['speedup']}")
        continue
    drafter = row.get("drafter") or {}
    print(
        f"  {row.get('shape')} x{row.get('batch')} {row.get('kind')} ttt_steps={drafter.get('ttt_steps')}: "
        f"{row['tokens_per_s']:,.0f} tokens/s, mfu {row.get('mfu')}, "
        f"peak {row.get('peak_memory_mb', row.get('peak_rss_mb'))} MB, {row.get('wall_s')} s "
        f"[{row.get('tree', 'current')}]"
    )
