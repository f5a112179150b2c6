# device call 1 (carry: call 1 of `python benchmarks/device/plan.py check`, .whl, .gpu/probe_target and the GGUF's
# first part): wheels, the first part of the SmolLM2 GGUF put aside (setup.sh), a throughput probe of the KINDS
# trainings (default both) at once on a random model of SmolLM2's shapes (also the first CUDA run of draftsmith)
cd "$(dirname "$0")/../.." || exit 2
date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
source benchmarks/device/setup.sh || exit $?
python3 -c "import torch, transformers, accelerate, datasets, omegaconf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__, 'cuda', torch.cuda.is_available())"
python3 benchmarks/device/probe_model.py .gpu/probe_target /tmp/probe_target || exit 5
mkdir -p /tmp/probe
for kind in ${KINDS:-eagle3 peagle}; do
  timeout -s TERM 170 bash benchmarks/device/train.sh $kind /tmp/probe/$kind 40 20 32 target.name_or_path=/tmp/probe_target target.gguf_file=null > /tmp/probe/$kind.log 2>&1 &
done
wait
for kind in ${KINDS:-eagle3 peagle}; do
  echo "== probe $kind"; grep -vE "it/s\]|s/it\]" /tmp/probe/$kind.log | tail -12
  python3 benchmarks/device/rate.py /tmp/probe/$kind/log.jsonl | tee /tmp/probe/$kind.rate.json
  cp /tmp/probe/$kind.log $OUT/probe_$kind.log
done
nvidia-smi --query-gpu=memory.used --format=csv; date
