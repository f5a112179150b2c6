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
        f"{row['tokens_per_s']:,.0f} tokens/s ({row.get('tokens_per_s_together', 0):,.0f} back to back), "
        f"mfu {row.get('mfu')}, "
        f"peak {row.get('peak_memory_mb', row.get('peak_rss_mb'))} MB, {row.get('wall_s')} s "
        f"[{row.get('tree', 'current')}] {' '.join(row.get('overrides', []))}"
        f"{' --compile' if row.get('compiled') else ''}"
    )
    if "part_s_median" in row:  # kernel time against the host's, per part: whether the GPU waited for launches
        print(
            f"    step {row['step_s_median']} s, kernels {row.get('kernel_s_median')} s, parts {row['part_s_median']}, "
            f"host {row.get('host_s_median')}, vocabulary {row.get('vocabulary_s_median')} s, "
            f"launches {row.get('kernels', {}).get('launches_per_step')}"
        )
        for name, milliseconds, launches in row.get("kernels", {}).get("top", [])[:8]:
            print(f"      {milliseconds:8.3f} ms {launches:5d}x {name[:100]}")
