# device call 2, the plan's last (carry: the GGUF's last part and the regeneration's input, as `python
# benchmarks/device/plan.py check` says; the parts between came with `source benchmarks/device/setup.sh`, a call each):
# the GGUF made whole from its parts (sha256 checked) and dequantized once (target.sh); with REGEN_S > 0, SmolLM2's
# sampled answers regenerated on the GPU for at most REGEN_S seconds into sharegpt_smollm2_sampled_t07_gpu
# (regenerate.sh: its finished parts go to $OUT before the training starts); then the KINDS (default EAGLE-3.1 and
# P-EAGLE-3.1) trained side by side on every folder, the new one included, for TRAIN_S seconds of steps (from call 1's
# probe), EVALS held-out evaluations each, stopped early after PATIENCE evaluations without a new best
# (train.patience; 0 = never) and hard-stopped by SIGTERM at DEADLINE_S (exit 75, best/ kept). The whole call keeps
# within CALL_S seconds: TRAIN_S and DEADLINE_S shrink, keeping their difference (the training's start-up and last
# evaluation), to what the regeneration and the target left, less PACK_S to pack; a regeneration that finishes
# early leaves its time to the training. Any further arguments are train.py overrides. best/ + curve + log of the
# first kind come back now, the second's in call 3
TRAIN_S=${TRAIN_S:-200} DEADLINE_S=${DEADLINE_S:-270} EVALS=${EVALS:-6} PATIENCE=${PATIENCE:-0}
REGEN_S=${REGEN_S:-0} CALL_S=${CALL_S:-560} PACK_S=${PACK_S:-15}
start=$(date +%s)
read -r -a kinds <<< "${KINDS:-eagle3 peagle}"
cd "$(dirname "$0")/../.." || exit 2
date; source benchmarks/device/setup.sh || exit $?
bash benchmarks/device/target.sh || exit $?
if [ "$REGEN_S" -gt 0 ]; then
  REGEN_S=$REGEN_S bash benchmarks/device/regenerate.sh; echo "regenerate.sh exit $?"
fi
left=$(( CALL_S - ($(date +%s) - start) - PACK_S ))
startup=$(( DEADLINE_S - TRAIN_S ))
DEADLINE_S=$(( left < DEADLINE_S ? left : DEADLINE_S )) && TRAIN_S=$(( DEADLINE_S - startup ))
[ "$TRAIN_S" -ge 30 ] || { echo "${left}s left of CALL_S=$CALL_S: no time to train"; date; exit 0; }
echo "training: ${TRAIN_S}s of steps, SIGTERM at ${DEADLINE_S}s"
mkdir -p /tmp/runs
for kind in "${kinds[@]}"; do
  steps=$(python3 -c "import json; r=json.load(open('/tmp/probe/$kind.rate.json')); print(int($TRAIN_S / r['s_per_step']))")
  every=$(( steps / EVALS > 10 ? steps / EVALS : 10 ))
  echo "$kind: $steps steps, held-out every $every, patience $PATIENCE"
  timeout -s TERM $DEADLINE_S bash benchmarks/device/train.sh $kind /tmp/runs/$kind $steps $every 32 train.patience=$PATIENCE "$@" > /tmp/runs/$kind.log 2>&1 &
done
wait
for kind in "${kinds[@]}"; do
  echo "== $kind"; grep -vE "it/s\]|s/it\]" /tmp/runs/$kind.log | grep -v accelerate.checkpointing | tail -15
  cat /tmp/runs/$kind/curve.json | python3 -c "import json,sys; c=json.load(sys.stdin); print([(r['step'], r['tokens'], round(r['tau_est'],3)) for r in c['rows']])"
  tar -C /tmp/runs -cf /tmp/runs/$kind.tar $kind/best $kind/curve.json $kind/log.jsonl $kind/recipe.yaml $kind.log
  mkdir -p /tmp/runs/${kind}_parts && split -b 15m /tmp/runs/$kind.tar /tmp/runs/${kind}_parts/$kind.tar.
  sha256sum /tmp/runs/$kind.tar
done
cp /tmp/runs/${kinds[0]}_parts/* $OUT/
date
