"""Rebuild the bundled demo from the shared reference assets (how demo/ was made).

    python demo/make_demo.py ../shared

demo/target/ is a copy of shared/models/reference-target (a 5.2M-parameter Llama trained on the
corpus, bf16 weights, its own BPE tokenizer and chat template). demo/data/ holds, per domain, the
first TRAIN_PER_DOMAIN records of `<domain>.train.jsonl.gz` and the first EVAL_PER_DOMAIN records
of `<domain>.eval.jsonl.gz` from shared/data/corpus, unchanged.

demo/mtp-target/ is a target with its own MTP layer, for `recipe=mtp`: a GLM-4.5-style model
(`Glm4MoeForCausalLM`, partial rotary) of the demo target's shape holding the demo target's tensors
wherever name and shape match, its first 3 decoder layers dense, the last a mixture of experts (random
experts; vLLM builds a GLM-4.5 model only with one), and a random MTP layer (a mixture of experts, as
GLM-4.5's is) in the checkpoint's `model.layers.4.*`, bf16.

demo/gemma4-target/ is a Gemma-4 target for `recipe=gemma4_assistant`, whose assistant reads a target's KV
cache: a two-layer `Gemma4ForCausalLM` (a sliding-window layer, then a full-attention one) of the demo target's
shape, without per-layer inputs, started from the demo target's tensors wherever name and shape match (the
first two layers' projections and MLPs, the embedding) and then trained for GEMMA4_STEPS steps on data/train.jsonl.gz
(draftsmith.random_target.train_on_demo: next-token loss on every token, about 2 minutes on 2 CPU threads):
Gemma-4's layers compute another function of those tensors (normed queries, keys and values, a scaled
embedding), and untrained it answers every prompt with line breaks, which any drafter predicts. bf16 (5 MiB: the
working tree travels to a lent GPU whole).
"""

import gzip
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TRAIN_PER_DOMAIN = 600
EVAL_PER_DOMAIN = 24
GEMMA4_STEPS = 300  # demo/gemma4-target's training (draftsmith.random_target.train_on_demo)
DOMAINS = ("code", "docs", "math", "packages")
TARGET_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "README.md",
    "training_summary.json",
)


def head_lines(src: Path, count: int) -> list[bytes]:
    with gzip.open(src, "rb") as f:
        return [line for _, line in zip(range(count), f)]


def main(shared: Path) -> None:
    here = Path(__file__).resolve().parent
    (here / "target").mkdir(exist_ok=True)
    for name in TARGET_FILES:
        shutil.copyfile(shared / "models/reference-target" / name, here / "target" / name)
    (here / "data").mkdir(exist_ok=True)
    for split, count in (("train", TRAIN_PER_DOMAIN), ("eval", EVAL_PER_DOMAIN)):
        lines = [line for d in DOMAINS for line in head_lines(shared / f"data/corpus/{d}.{split}.jsonl.gz", count)]
        # mtime=0 keeps the gzip bytes identical from one rebuild to the next.
        with gzip.GzipFile(here / "data" / f"{split}.jsonl.gz", "wb", mtime=0) as f:
            f.writelines(lines)
    make_mtp_target(here / "target", here / "mtp-target")
    make_gemma4_target(here / "target", here / "gemma4-target")


def make_mtp_target(demo_target: Path, directory: Path) -> None:
    from draftsmith.heads.mtp_random_layer import write_random_layer
    from draftsmith.random_target import write_random_target

    shutil.rmtree(directory, ignore_errors=True)
    layers = json.loads((demo_target / "config.json").read_text())["num_hidden_layers"]
    write_random_target("glm4_moe", directory, seed_from=demo_target, first_k_dense_replace=layers - 1)
    write_random_layer(directory)
    to_bfloat16(directory)


def make_gemma4_target(demo_target: Path, directory: Path) -> None:
    from draftsmith.random_target import write_random_target

    shutil.rmtree(directory, ignore_errors=True)
    kinds = ["sliding_attention", "full_attention"]
    shape = {"num_hidden_layers": len(kinds), "layer_types": kinds, "per_layer_config": {}}
    no_per_layer_inputs = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    write_random_target(
        "gemma4_text", directory, seed_from=demo_target, train_steps=GEMMA4_STEPS, **shape, **no_per_layer_inputs
    )
    to_bfloat16(directory)


def to_bfloat16(directory: Path) -> None:
    weights = directory / "model.safetensors"
    tensors = {name: tensor.to(torch.bfloat16) for name, tensor in load_file(str(weights)).items()}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "../shared").resolve())
