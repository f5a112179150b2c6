"""Mark the cut answers of a regeneration made before `draftsmith regenerate` marked them, in place:

    python benchmarks/mark_cut_answers.py benchmarks/data/sharegpt_smollm2 [more folders ...]

A regeneration since 2026-11-29 marks an answer its engine cut at `data.regenerate.max_new_tokens` with
`"cut": true` on the turn (training then leaves the end-of-turn after it out of the loss) and records
`"marks": ["cut"]` in regenerate.settings; draftsmith refuses to resume or reuse a folder without that record,
whose cut answers would read as finished. The folders in benchmarks/data were made before, and regenerating them
took hours on this CPU, so this infers the marks from the answers as written: an assistant turn whose text
tokenizes (the settings' target tokenizer) to at least max_new_tokens - 2 tokens is marked cut. The margin is
measured: on sharegpt_smollm2 (2,217 answers, 256 new tokens) 1,184 answers tokenize to 256 tokens, 72 to 255 and
41 to 254 (a cut answer's text as written loses its trailing whitespace), against 4 to 6 at each length from 251
to 253, the natural endings; marking 254 and 255 leaves out the end-of-turn of a few natural endings as well, the
cost of not training an end where the target went on. Each part is rewritten as regenerate writes parts (gzip at
mtime 0, by rename), then the settings record the marks; the folder's README gets a line saying so. Prints one
JSON line per folder: answers, marked, and the token-count histogram at the margin.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
from pathlib import Path

from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
from draftsmith.data_prep.regenerate import MARKS, write_part
from draftsmith.data_prep.turns import CUT_KEY
from draftsmith.files import write_text_atomic

MARGIN = 2  # tokens below max_new_tokens that still mark an answer cut (the module docstring)


def mark_folder(folder: Path) -> dict:
    from transformers import AutoTokenizer

    settings_path = folder / REGENERATE_SETTINGS
    settings = json.loads(settings_path.read_text())
    if settings.get("marks") == MARKS:
        return {"folder": str(folder), "already": True}
    tokenizer = AutoTokenizer.from_pretrained(settings["target"])
    limit = int(settings["max_new_tokens"]) - MARGIN
    answers, marked, lengths = 0, 0, collections.Counter()
    for part in sorted(folder.glob("part-*.jsonl.gz")):
        records = [json.loads(line) for line in gzip.open(part, "rt", encoding="utf-8")]
        for record in records:
            for turn in record["messages"]:
                if turn["role"] != "assistant":
                    continue
                length = len(tokenizer(turn["content"], add_special_tokens=False).input_ids)
                answers += 1
                if length >= limit - 3:
                    lengths[length] += 1
                if length >= limit:
                    turn[CUT_KEY] = True
                    marked += 1
        write_part(part, records)
    write_text_atomic(settings_path, json.dumps({**settings, "marks": MARKS}, indent=2) + "\n")
    readme = folder / "README.md"
    if readme.is_file():
        readme.write_text(
            readme.read_text().rstrip("\n")
            + "\n\nCut answers marked afterwards (`benchmarks/mark_cut_answers.py`, 2026-11-30): "
            f"{marked} of {answers} answers, those whose text tokenizes to at least {limit} tokens "
            f'(max_new_tokens {limit + MARGIN} - {MARGIN}), carry `"cut": true`; regenerate.settings records '
            '`"marks": ["cut"]`.\n'
        )
    return {"folder": str(folder), "answers": answers, "marked": marked, "lengths": dict(sorted(lengths.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path)
    args = parser.parse_args()
    for folder in args.folders:
        if not (folder / REGENERATE_SETTINGS).is_file():
            parser.error(f"{folder} holds no {REGENERATE_SETTINGS}: not a regeneration")
    for folder in args.folders:
        print(json.dumps(mark_folder(folder)), flush=True)


if __name__ == "__main__":
    main()
