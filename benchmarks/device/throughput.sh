# bash benchmarks/device/throughput.sh [--dry-run]: issue #37's GPU throughput figures in one device call.
# Runs benchmarks/train_throughput.py --shape for qwen3-0.6b (the speculators PR #1111 anchor), smollm2-135m and
# llama-3.1-8b at sequence length 2048, the target built on the GPU in bf16 (random weights: nothing is downloaded
# or carried), EAGLE-3, P-EAGLE and DFlash each; one JSON line per kind into $OUT/throughput_<shape>.jsonl, stderr
# into $OUT/throughput_<shape>.err. PEAK_TFLOPS (default 989, an H100 SXM's dense bf16 peak; an H200's is the same
# 989) gives MFU: set it for the card you were lent. Each shape runs under its own timeout (SHAPE_S, default 150 s)
# so one slow shape cannot eat the loan. Carry the wheels the image lacks as for call1.sh (.whl/, setup.sh).
# Then the first shape once more with the drafter under torch.compile (--compile), EAGLE-3 and DFlash, into
# $OUT/throughput_<shape>_compiled.jsonl: whether compiling pays on the GPU (on the CPU it did not: docs/performance.md).
# --dry-run: the same loop on the CPU with the tiny shape at sequence length 64, to know the script starts.
cd "$(dirname "$0")/../.." || exit 2
OUT=${OUT:-/tmp/throughput_out}; mkdir -p "$OUT"
peak=${PEAK_TFLOPS:-989} limit=${SHAPE_S:-150}
if [ "$1" = --dry-run ]; then
  shapes=(tiny) args=(--device cpu --dtype float32 --seq 64 --batch 1 --steps 2 --warmup 1 --threads 1)
else
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  [ -d .whl ] && { source benchmarks/device/setup.sh || exit $?; }
  shapes=(qwen3-0.6b smollm2-135m llama-3.1-8b) args=(--device cuda --dtype bfloat16 --seq 2048 --batch 1 --steps 5 --warmup 2)
fi
status=0
measure() {  # NAME [extra arguments]: one shape's kinds under their own timeout, one summary line per kind
  local name=$1; shift
  echo "== $name"
  timeout -s TERM "$limit" python3 benchmarks/train_throughput.py --peak-tflops "$peak" "${args[@]}" "$@" \
    > "$OUT/throughput_$name.jsonl" 2> "$OUT/throughput_$name.err" || { status=$?; tail -5 "$OUT/throughput_$name.err"; }
  python3 -c "import json,sys
for line in open(sys.argv[1]):
    r = json.loads(line); print(r['kind'], r['tokens_per_s'], 'tok/s', 'mfu', r['mfu'], 'peak MiB', r.get('peak_memory_mb', r.get('peak_rss_mb')), 'vocab share', r.get('vocabulary_share'), 'compiled', r['compiled'])" "$OUT/throughput_$name.jsonl"
}
for shape in "${shapes[@]}"; do
  measure "$shape" --shape "$shape"
done
measure "${shapes[0]}_compiled" --shape "${shapes[0]}" --kinds eagle3,dflash --compile
exit $status
