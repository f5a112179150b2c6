# bash benchmarks/device/import.sh KIND SOURCE: a drafter trained on the device -> runs/gpu_protocol/KIND (best/, curve,
# log, recipe), where `benchmarks/standard_protocol.py --runs runs/gpu_protocol --kinds KIND` and load_sweep.py read it.
# SOURCE is either the folder a device call's files came back to (KIND.tar.* parts, as call2.sh/call3.sh pack them) or a
# drafter folder kept elsewhere (model.safetensors, config.json, best.json, curve.json, log.jsonl, as
# ../shared/models/smollm2-eagle3.1-h200 holds them): its recipe.yaml is then the one train.sh trained with.
set -eo pipefail
kind=$1 source=$2
cd "$(dirname "$0")/../.."
out=runs/gpu_protocol/$kind
if [ -f "$source/model.safetensors" ]; then
  mkdir -p "$out/best"
  cp "$source/model.safetensors" "$source/config.json" "$source/best.json" "$out/best/"
  cp "$source/curve.json" "$source/log.jsonl" "$out/"
  chmod -R u+w "$out"
  # its name goes into every result measured with it (standard_protocol.py's `drafters`)
  basename "$(realpath "$source")" > "$out/imported_from"
  extra=()
  [ "$kind" = peagle ] && extra=(drafter.parallel_drafting=true drafter.mask_token_id=16)
  python3 -c "import sys; from draftsmith.recipe import load_recipe, save_recipe; save_recipe(load_recipe(sys.argv[2:]), sys.argv[1])" \
    "$out" recipe=eagle3_sharegpt_smollm2 "output_dir=$out" "${extra[@]}"
  echo "imported $source -> $out (sha256 of its weights: $(sha256sum "$out/best/model.safetensors" | cut -c1-16))"
else
  mkdir -p runs/gpu_protocol
  cat "$source"/"$kind".tar.* > "/tmp/$kind.tar"
  sha256sum "/tmp/$kind.tar"
  tar -C runs/gpu_protocol -xf "/tmp/$kind.tar"
  mv -f "runs/gpu_protocol/$kind.log" "$out/train.log"
fi
ls -la "$out" "$out/best"
