# device call 4, issue #37 (carry .whl): the GPU tier (tests/test_gpu.py: every kind's bf16 steps, lossless
# decoding on CUDA, FSDP2 target sharding, ZeRO-2, ZeRO-3), then the throughput figures at real shapes
# (throughput.sh), then the compiled drafter if time is left; all under one deadline (BUDGET_S, default
# 540 s from the start) so the call ends inside the tool's 600 s limit with its files.
cd "$(dirname "$0")/../.." || exit 2
export DEADLINE=$(( $(date +%s) + ${BUDGET_S:-540} ))
source benchmarks/device/setup.sh || exit $?
python3 -c "import torch, transformers, accelerate, datasets, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, 'deepspeed', deepspeed.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tail -2
echo "== GPU tier (timeout ${TIER_S:-150}s) $(date +%T)"
timeout "${TIER_S:-150}" python3 -m pytest -o addopts="-ra --strict-markers" -m gpu tests/test_gpu.py -q -p no:cacheprovider \
  -n 4 --durations=0 > "$OUT/gpu_tier.log" 2>&1; echo "tier exit $?"; grep -E "passed|failed|^FAILED|^E .*(rror|must)" "$OUT/gpu_tier.log" | tail -20
COMPILE=0 SHAPE_S=${SHAPE_S:-120} bash benchmarks/device/throughput.sh; status=$?
COMPILE=only SHAPE_S=${SHAPE_S:-120} bash benchmarks/device/throughput.sh
date; exit $status
