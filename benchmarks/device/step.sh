# bash benchmarks/device/step.sh [--dry-run]: the EAGLE-3 step's GPU figures and checks in one device call (issue #61),
# what matters first, each part under its own deadline so that a slow compile costs its own row only:
# 1. the key checks of the GPU tier: the step on CUDA (compiled flex attention, the fused vocabulary loss)
#    equals the straightforward reference, and never waits for the host, nor do the other fixed-shape losses;
#    then, under its own deadline, EAGLE-3's draft layer compiled (flex attention inside) trains as the eager one;
# 2. Llama-3.1-8B's shape, one row of 2048 (the MFU target's shape), this tree's trainer step
#    (benchmarks/train_throughput.py --shape, random weights built on the GPU in bf16), eager, then compiled as a
#    GPU run trains (train.compile_target=true: the target's decoder layers; train.compile_drafter=true: the draft
#    layer; train.compile_vocab_loss=true);
# 3. Qwen3-0.6B at speculators' workload (3 TTT steps, PR #1111): eager, compiled without the draft layer (2026-12-04's
#    setting: 1.36x their figure), compiled;
# 4. the demo recipe's real micro-batches trained through compiled flex attention (varying rows and widths):
#    equal to dense, at most one graph per length bucket, no fallback (tests/test_gpu.py, "real_batches");
# 5. SmolLM2-135M's shape with 8 rows, eager then compiled; every row gives its kernel time beside the host's
#    (whether the GPU waited for launches) and the kernels of most time;
# 6. with BASELINE_DIR carried (.gpu/baseline: `bash benchmarks/device/prepare.sh --wheels` makes it of 53712a3,
#    the commit of 2026-11-28's rows), Qwen3-0.6B's 3-step row against that commit's step, alternating (its eager
#    row ran 40k tokens/s then, 23k on 2026-12-04); 7. the rest of the GPU tier, if time is left.
# Every part's stdout and stderr are kept (a fresh /tmp/step_logs.XXXXXX per run, outside $OUT, packed into
# $OUT/step_logs.tar.gz after each part: a call brings back at most 8 files); its summary lines are printed.
# BUDGET_S (default 540 s from the start) is the whole call's; PART_S the most one part may take. PEAK_TFLOPS
# (default 989: H100 SXM and H200 dense bf16) gives MFU.
# --dry-run: the same sequence on the CPU, the tiny shape at sequence length 64, the checks only collected.
cd "$(dirname "$0")/../.." || exit 2
dry=
for option in "$@"; do
  case $option in --dry-run) dry=1 ;; *) echo "step.sh: unknown option $option" >&2; exit 2 ;; esac
done
export DEADLINE=${DEADLINE:-$(( $(date +%s) + ${BUDGET_S:-540} ))}
OUT=${OUT:-/tmp/step_out}; mkdir -p "$OUT" || exit 2
logs=$(mktemp -d /tmp/step_logs.XXXXXX) || exit 2  # this run's alone: no earlier run's logs in the tarball
peak=${PEAK_TFLOPS:-989} baseline=${BASELINE_DIR:-.gpu/baseline}
if [ -n "$dry" ]; then
  big=tiny:1 small=tiny:2 speculators=tiny:1
  args=(--device cpu --dtype float32 --seq 64 --steps 2 --warmup 1 --threads 1) profile=1
  collect=(--collect-only)  # skipped without CUDA: proves only that each selection collects
else
  date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  [ -d .whl ] && { source benchmarks/device/setup.sh || exit $?; }
  big=llama-3.1-8b:1 small=smollm2-135m:8 speculators=qwen3-0.6b:1
  args=(--device cuda --dtype bfloat16 --seq 2048 --steps 5 --warmup 2 --peak-tflops "$peak") profile=2
  collect=()
fi
status=0
part() {  # NAME LIMIT COMMAND...: the command under min(LIMIT, time left), its output in $logs/NAME.{out,err}
  local name=$1 left=$(( DEADLINE - $(date +%s) )); local limit=$(( left < $2 ? left : $2 )); shift 2
  if [ "$limit" -lt 30 ]; then echo "== $name skipped: ${left}s left"; status=124; return; fi
  echo "== $name (timeout ${limit}s) $(date +%T)"
  timeout -s TERM "$limit" "$@" > "$logs/$name.out" 2> "$logs/$name.err"; local code=$?
  [ "$code" -ne 0 ] && { status=$code; echo "$name exit $code"; tail -5 "$logs/$name.err"; }
  grep -hE '"summary"|"tokens_per_s"' "$logs/$name.out" | python3 benchmarks/device/step_rows.py
  grep -hE "passed|failed|skipped|collected|^FAILED|^E " "$logs/$name.out" | tail -8
  tar czf "$OUT/step_logs.tar.gz" -C "$logs" .
}
tier=(python3 -m pytest -o "addopts=-ra --strict-markers" -m gpu tests/test_gpu.py -q -p no:cacheprovider "${collect[@]}")
throughput=(python3 benchmarks/train_throughput.py --kinds eagle3 "${args[@]}")
shape() { echo "--shape ${1%%:*} --batch ${1##*:}"; }  # NAME:ROWS -> the benchmark's options

part checks "${CHECKS_S:-120}" "${tier[@]}" -k "never_wait or straightforward_reference"
# its own deadline: inductor compiles six forward and backward graphs of the draft layer
part compiled_draft_layer "${CHECKS_S:-120}" "${tier[@]}" -k "compiled_draft_layer"
# each shape eager, then compiled as a GPU run should train (the target's layers, the draft layer, the loss's chunk
# math); Qwen3-0.6B (the target not met on 2026-12-04) also without the draft layer, that day's setting
compiled=(train.compile_target=true train.compile_vocab_loss=true)
all=("${compiled[@]}" train.compile_drafter=true)
part "${big/:/_x}" "${PART_S:-150}" "${throughput[@]}" $(shape "$big") --profile-steps "$profile"
part "${big/:/_x}_compiled" "${PART_S:-150}" "${throughput[@]}" $(shape "$big") --profile-steps "$profile" "${all[@]}"
for variant in eager:"" target:"${compiled[*]}" compiled:"${all[*]}"; do
  # shellcheck disable=SC2086  # the settings split into words
  part "speculators_ttt3_${variant%%:*}" "${PART_S:-150}" "${throughput[@]}" $(shape "$speculators") \
    --profile-steps "$profile" drafter.ttt_steps=3 ${variant#*:}
done
part real_batches "${CHECKS_S:-150}" "${tier[@]}" -k "real_batches"
part "${small/:/_x}" "${PART_S:-150}" "${throughput[@]}" $(shape "$small") --profile-steps "$profile"
part "${small/:/_x}_compiled" "${PART_S:-150}" "${throughput[@]}" $(shape "$small") --profile-steps "$profile" "${all[@]}"
if [ -d "$baseline" ]; then
  part baseline_compare "${PART_S:-150}" python3 benchmarks/step_compare.py --baseline-dir "$baseline" --rounds 1 \
    -- $(shape "$speculators") --kinds eagle3 "${args[@]}" drafter.ttt_steps=3
fi
[ -z "$dry" ] && part gpu_tier "${PART_S:-150}" "${tier[@]}" -n 4 \
  -k "not eagle3 and not never_wait and not straightforward_reference and not compiled_draft_layer and not real_batches"
date; exit $status
