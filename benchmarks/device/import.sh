# bash benchmarks/device/import.sh KIND FILES_DIR: a drafter trained on the device -> runs/gpu_protocol/KIND (best/, curve, log, recipe)
kind=$1 files=$2
mkdir -p runs/gpu_protocol && cat "$files"/$kind.tar.* > /tmp/$kind.tar && sha256sum /tmp/$kind.tar && tar -C runs/gpu_protocol -xf /tmp/$kind.tar && mv -f runs/gpu_protocol/$kind.log runs/gpu_protocol/$kind/train.log && ls -la runs/gpu_protocol/$kind runs/gpu_protocol/$kind/best
