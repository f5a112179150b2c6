"""Rebuild the bundled demo from the shared reference assets (how demo/ was made).

    python demo/make_demo.py ../shared

demo/target/ is a copy of shared/models/reference-target (a 5.2M-parameter Llama trained on the
corpus, bf16 weights, its own BPE tokenizer and chat template). demo/data/ holds, per domain, the
first TRAIN_PER_DOMAIN records of `<domain>.train.jsonl.gz` and the first EVAL_PER_DOMAIN records
of `<domain>.eval.jsonl.gz` from shared/data/corpus, unchanged.
"""

import gzip
import shutil
import sys
from pathlib import Path

TRAIN_PER_DOMAIN = 600
EVAL_PER_DOMAIN = 24
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


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "../shared").resolve())
