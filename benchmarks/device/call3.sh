# device call 3 (carry nothing new): P-EAGLE's files back; then the GPU tier (tests/test_gpu.py) in what time is left
cd "$(dirname "$0")/../.." || exit 2
source benchmarks/device/setup.sh || exit $?
cp /tmp/runs/peagle_parts/* $OUT/
timeout ${TIER_S:-200} python3 -m pytest -o addopts="-ra --strict-markers" -m gpu tests/test_gpu.py -q -p no:cacheprovider --durations=0 2>&1 | tail -40
