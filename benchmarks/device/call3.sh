# device call 3 (carry nothing new): the second kind's files back (KINDS as in call 2; P-EAGLE by default); then the GPU tier (tests/test_gpu.py) in what time is left
cd "$(dirname "$0")/../.." || exit 2
source benchmarks/device/setup.sh || exit $?
read -r -a kinds <<< "${KINDS:-eagle3 peagle}"
[ -n "${kinds[1]}" ] && cp /tmp/runs/${kinds[1]}_parts/* $OUT/
timeout ${TIER_S:-200} python3 -m pytest -o addopts="-ra --strict-markers" -m gpu tests/test_gpu.py -q -p no:cacheprovider --durations=0 2>&1 | tail -40
