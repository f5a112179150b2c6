# bash benchmarks/device/throughput.sh [--dry-run]: issue #37's GPU throughput figures in one device call.
# Runs benchmarks/train_throughput.py --shape for each SHAPES entry NAME:ROWS (default: qwen3-0.6b with one
# row of 2048 tokens per step, the speculators PR #1111 anchor; smollm2-135m with 8 rows; llama-3.1-8b with
# one), sequence length 2048, the target built on the GPU in bf16 (random weights: nothing is downloaded or
# carried), EAGLE-3, P-EAGLE and DFlash each; one JSON line per kind into $OUT/throughput_<name>_b<rows>.jsonl,
# stderr beside it (.err). PEAK_TFLOPS (default 989, the dense bf16 peak of an H100 SXM and of an H200) gives
# MFU: set it for the card you were lent. Each shape runs under its own timeout (SHAPE_S, default 150 s),
# cut to what is left before DEADLINE (epoch seconds, optional), so one slow shape cannot eat the loan.
# COMPILE=1 (default) then runs the first shape once more with the drafter under torch.compile (--compile),
# EAGLE-3 and DFlash, into ..._compiled.jsonl: whether compiling pays on the GPU (on the CPU it did not:
# docs/performance.md); COMPILE=only runs just that. Carry the wheels the image lacks (.whl/, setup.sh).
# --dry-run: the same loop on the CPU with the tiny shape at sequence length 64, to know the script starts; the
# compiled row is left out (compiling on the CPU takes minutes, and its few timed steps would be recompiles).
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/throughput_out}; mkdir -p "$OUT"
peak=${PEAK_TFLOPS:-989} limit=${SHAPE_S:-150} compile=${COMPILE:-1}
if [ "$1" = --dry-run ]; then
  shapes=(tiny:1) args=(--device cpu --dtype float32 --seq 64 --steps 2 --warmup 1 --threads 1)
  [ "$compile" != 0 ] && echo "== compiled row skipped in the dry run (COMPILE=$compile counts on the GPU only)"
  compile=0
else
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  [ -d .whl ] && { source benchmarks/device/setup.sh || exit $?; }
  read -r -a shapes <<< "${SHAPES:-qwen3-0.6b:1 smollm2-135m:8 llama-3.1-8b:1}"
  args=(--device cuda --dtype bfloat16 --seq 2048 --steps 5 --warmup 2)
fi
status=0
measure() {  # FILE_NAME [extra arguments]: one shape's kinds under their own timeout, one summary line per kind
  local name=$1 seconds=$limit; shift
  [ -n "$DEADLINE" ] && seconds=$(( DEADLINE - $(date +%s) < limit ? DEADLINE - $(date +%s) : limit ))
  [ "$seconds" -lt 20 ] && { echo "== $name skipped: ${seconds}s left"; status=124; return; }
  echo "== $name (timeout ${seconds}s) $(date +%T)"
  # stderr (the libraries' and the profiler's lines) is kept only when the shape failed: the device tool returns 8 files
  if timeout -s TERM "$seconds" python3 benchmarks/train_throughput.py --peak-tflops "$peak" "${args[@]}" "$@" \
    > "$OUT/throughput_$name.jsonl" 2> "$OUT/throughput_$name.err"; then rm "$OUT/throughput_$name.err"
  else status=$?; tail -5 "$OUT/throughput_$name.err"; fi
  python3 -c "import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line); print(r['kind'], r['tokens_per_s'], 'tok/s', 'mfu', r['mfu'], 'peak MiB', r.get('peak_memory_mb', r.get('peak_rss_mb')), 'vocab share', r.get('vocabulary_share'), 'parts', r['part_s_median'], 'compiled', r['compiled'])" "$OUT/throughput_$name.jsonl"
}
if [ "$compile" != only ]; then
  for spec in "${shapes[@]}"; do
    measure "${spec%%:*}_b${spec##*:}" --shape "${spec%%:*}" --batch "${spec##*:}"
  done
fi
first=${shapes[0]}
[ "$compile" != 0 ] && measure "${first%%:*}_b${first##*:}_compiled" --shape "${first%%:*}" --batch "${first##*:}" --kinds eagle3,dflash --compile
exit $status
