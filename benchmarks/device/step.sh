# bash benchmarks/device/step.sh [--dry-run]: issue #51's GPU figures in one device call.
# 1. The GPU tier's EAGLE-3 step checks (tests/test_gpu.py -k "eagle3"): the step on CUDA (compiled flex
#    attention, the fused vocabulary loss) equal to the straightforward reference, and no host sync in it.
# 2. The step of this tree against the baseline commit's (benchmarks/step_compare.py: each tree's own
#    benchmarks/train_throughput.py, alternating), EAGLE-3 at each SHAPES entry NAME:ROWS (default
#    qwen3-0.6b:1, smollm2-135m:8, llama-3.1-8b:1), sequence length 2048, random weights built on the GPU in
#    bf16; one JSON line per run and a summary line per shape into $OUT/step_<name>.jsonl.
# 3. speculators' workload (PR #1111): qwen3-0.6b, 3 TTT steps (drafter.ttt_steps=3), this tree only, with
#    the step's parts from the profiler (the drafter's share is the figure without the target's forward).
# 4. The rest of the GPU tier if time is left.
# The baseline is carried, not built there (no git on the device): `python benchmarks/step_compare.py
# --make-baseline .gpu/baseline` here first (after prepare.sh, which empties .gpu), then carry .gpu/baseline and .whl. Each part
# runs under its own timeout, cut to what is left before DEADLINE (BUDGET_S, default 540 s from the start).
# PEAK_TFLOPS (default 989: H100 SXM and H200 dense bf16) gives MFU.
# --dry-run: the same sequence on the CPU with the tiny shape at sequence length 64, the baseline made here.
cd "$(dirname "$0")/../.." || exit 2
export DEADLINE=${DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-540} ))}
OUT=${OUT:-/tmp/step_out}; mkdir -p "$OUT"
peak=${PEAK_TFLOPS:-989} baseline=${BASELINE_DIR:-.gpu/baseline}
if [ "$1" = --dry-run ]; then
  [ -d "$baseline" ] || python3 benchmarks/step_compare.py --make-baseline "$baseline" || exit 2
  shapes=(tiny:1) args=(--device cpu --dtype float32 --seq 64 --steps 2 --warmup 1 --threads 1) profile=1
  tier=(-k "eagle3 and not cuda_equals")  # skipped without CUDA: proves only that the selection collects
else
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  [ -d .whl ] && { source benchmarks/device/setup.sh || exit $?; }
  [ -d "$baseline" ] || { echo "no $baseline: run benchmarks/step_compare.py --make-baseline $baseline and carry it"; exit 2; }
  read -r -a shapes <<< "${SHAPES:-qwen3-0.6b:1 smollm2-135m:8 llama-3.1-8b:1}"
  args=(--device cuda --dtype bfloat16 --seq 2048 --steps 5 --warmup 2 --peak-tflops "$peak") profile=2
  tier=(-k eagle3)
fi
status=0
seconds_left() {  # LIMIT: LIMIT, or less if the deadline is nearer
  local left=$(( DEADLINE - $(date +%s) )); echo $(( left < $1 ? left : $1 ))
}
limit=$(seconds_left "${TIER_S:-120}")
echo "== EAGLE-3 step checks on the device (timeout ${limit}s) $(date +%T)"
timeout "$limit" python3 -m pytest -o addopts="-ra --strict-markers" -m gpu tests/test_gpu.py "${tier[@]}" -q \
  -p no:cacheprovider > "$OUT/step_checks.log" 2>&1; echo "checks exit $?"
grep -E "passed|failed|skipped|^FAILED|^E " "$OUT/step_checks.log" | tail -12
for spec in "${shapes[@]}"; do
  name=${spec%%:*} rows=${spec##*:} limit=$(seconds_left "${SHAPE_S:-150}")
  [ "$limit" -lt 30 ] && { echo "== $name skipped: ${limit}s left"; status=124; continue; }
  echo "== $name, $rows rows: baseline and current (timeout ${limit}s) $(date +%T)"
  timeout -s TERM "$limit" python3 benchmarks/step_compare.py --baseline-dir "$baseline" --rounds 1 \
    --current-extra "--profile-steps $profile" -- \
    --shape "$name" --batch "$rows" --kinds eagle3 "${args[@]}" > "$OUT/step_${name}.jsonl" 2> "$OUT/step_${name}.err" \
    || { status=$?; tail -5 "$OUT/step_${name}.err"; }
  grep '"summary"' "$OUT/step_${name}.jsonl"
  [ -s "$OUT/step_${name}.err" ] || rm -f "$OUT/step_${name}.err"
done
first=${shapes[0]} limit=$(seconds_left "${SHAPE_S:-150}")
if [ "$limit" -ge 30 ]; then
  echo "== ${first%%:*}, 3 TTT steps (speculators' workload), current tree (timeout ${limit}s) $(date +%T)"
  timeout -s TERM "$limit" python3 benchmarks/train_throughput.py --shape "${first%%:*}" --batch "${first##*:}" \
    --kinds eagle3 "${args[@]}" --profile-steps "$profile" drafter.ttt_steps=3 > "$OUT/step_ttt3.jsonl" 2> "$OUT/step_ttt3.err" || status=$?
  [ -s "$OUT/step_ttt3.err" ] || rm -f "$OUT/step_ttt3.err"
fi
limit=$(seconds_left "${TIER_S:-150}")
if [ "$1" != --dry-run ] && [ "$limit" -ge 60 ]; then
  echo "== the rest of the GPU tier (timeout ${limit}s) $(date +%T)"
  timeout "$limit" python3 -m pytest -o addopts="-ra --strict-markers" -m gpu tests/test_gpu.py -k "not eagle3" -q \
    -p no:cacheprovider -n 4 > "$OUT/gpu_tier.log" 2>&1; echo "tier exit $?"; grep -E "passed|failed|^FAILED" "$OUT/gpu_tier.log" | tail -8
fi
date; exit $status
