"""The next loan's device calls, each sized from what travels with it.

A `run` call carries the working tree as git would carry it (the tracked files and the untracked ones git does
not ignore, and shared/ where the checkout has one) plus the ignored paths its `carry` names: 64 MiB in all.
The xz-compressed SmolLM2 GGUF (87 MiB) and the wheels the device image lacks (about 9 MiB packed) do not fit beside
the tree in one call, so they are spread over several:

    python benchmarks/device/plan.py prepare   # prepare.sh: cut .gpu/gguf.xz into parts for the tree as it is
    python benchmarks/device/plan.py prepare --no-regeneration   # the same, the last call training only
    python benchmarks/device/plan.py check     # right before the loan: every call's total, and the calls to make

The plan (.gpu/plan.json): call 1 carries the wheels, the probe target and the GGUF's first part and times the
training (call1.sh); each next call carries one more part, which `setup.sh` puts aside; the last carries the
last part and the regeneration's input (REGEN_INPUT, first_turns.py), joins the parts, regenerates and trains
(call2.sh); with --no-regeneration it carries the last part alone and trains for the whole call. `check` measures
the tree again, since what travels changes between preparing and the loan (a new data folder, committed or not
yet), and refuses in one line a plan that a call would exceed.
"""

from __future__ import annotations

import argparse
import json
import os
import string
import subprocess
from pathlib import Path

from draftsmith.cli import run_cli
from draftsmith.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
LIMIT = 64 * MIB  # what one call may carry, the working tree included
RESERVE = 2 * MIB  # room left in each call for the tree to grow a little between prepare and the loan
MAX_CARRY = 8  # paths one call's carry may name
# The last call (call2.sh) within CALL_S=550 s of its 600: the target made (about 40 s, an estimate), SmolLM2's
# sampled answers regenerated on the GPU for at most REGEN_S=240 s (regenerate.sh), then EAGLE-3.1 alone trained
# for what is left, at most 300 s of steps with SIGTERM at 390 s (best/ kept whatever happens; about 160 s of steps
# when the regeneration takes all its 240 s), 8 held-out evaluations, stopped after 3 without a new best. With a
# machine start of 1-2 minutes and call 1's probe, the loan takes about 14 of its 15 minutes.
PROBE = "KINDS=eagle3 bash benchmarks/device/call1.sh"
STASH = "source benchmarks/device/setup.sh"
TRAIN = (
    "KINDS=eagle3 REGEN_S=240 CALL_S=550 TRAIN_S=300 DEADLINE_S=390 EVALS=8 PATIENCE=3 bash benchmarks/device/call2.sh"
)
REGEN_INPUT = ".gpu/sharegpt_first_turns_0_16800.jsonl.gz"  # regenerate.sh's input, carried by the last call
# `prepare --no-regeneration`: the last call trains for the whole of it (no input to carry, no GPU regeneration):
# the target made (about 40 s), at most 380 s of steps with SIGTERM at 470 s, within CALL_S=550 s.
TRAIN_ONLY = (
    "KINDS=eagle3 REGEN_S=0 CALL_S=550 TRAIN_S=380 DEADLINE_S=470 EVALS=8 PATIENCE=3 bash benchmarks/device/call2.sh"
)


def travelling_files(root: Path = ROOT) -> list[Path]:
    """The files a call copies whatever it carries: git's tracked and untracked-not-ignored files (those
    still on disk), and shared/ inside the checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    files = {root / os.fsdecode(name) for name in listed.split(b"\0") if name}
    files |= set(files_under(root / "shared"))
    return sorted(path for path in files if path.is_file() or path.is_symlink())


def files_under(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [item for item in path.rglob("*") if item.is_file() or item.is_symlink()] if path.is_dir() else []


def size(paths: list[Path]) -> int:
    return sum(path.lstat().st_size for path in paths)  # a link travels as a link


def carried_bytes(carry: list[str], root: Path = ROOT) -> int:
    missing = [path for path in carry if not (root / path).exists()]
    if missing:
        raise UserError(f"{', '.join(missing)} missing: run benchmarks/device/prepare.sh first")
    return sum(size(files_under(root / path)) for path in carry)


def prepare(root: Path = ROOT, regenerate: bool = True) -> None:
    """Cut .gpu/gguf.xz into .gpu/part_a, part_b, ... so that each call stays under LIMIT - RESERVE beside the
    tree as it is now (call 1 beside the wheels and the probe target too, the last beside REGEN_INPUT unless
    `regenerate` is off: then the last call trains only), and write the plan."""
    gpu = root / ".gpu"
    tree = size(travelling_files(root))
    room = LIMIT - RESERVE - tree
    probe_carry = [".whl", ".gpu/probe_target"]
    first = room - carried_bytes(probe_carry, root)
    if first < 0:
        raise UserError(
            f"the working tree ({tree / MIB:.1f} MiB) with the wheels and the probe target "
            f"({(room - first) / MIB:.1f} MiB) exceeds the {(LIMIT - RESERVE) // MIB} MiB a call may carry here"
        )
    last_carry = [REGEN_INPUT] if regenerate else []
    last = carried_bytes(last_carry, root)
    if last > room:
        raise UserError(
            f"the working tree ({tree / MIB:.1f} MiB) with {REGEN_INPUT} ({last / MIB:.1f} MiB) exceeds the "
            f"{(LIMIT - RESERVE) // MIB} MiB a call may carry here"
        )
    data = (gpu / "gguf.xz").read_bytes()
    chunks = [data[:first], *(data[start : start + room] for start in range(first, len(data), room))]
    if len(chunks) == 1 or len(chunks[-1]) + last > room:
        chunks.append(b"")  # the last call carries the regeneration's input alone
    if len(chunks) > len(string.ascii_lowercase):
        raise UserError(f"the GGUF would take {len(chunks)} calls beside a {tree / MIB:.1f} MiB working tree")
    for old in gpu.glob("part_*"):
        old.unlink()
    names = []
    for letter, chunk in zip(string.ascii_lowercase, chunks):
        if chunk:  # call 1's is empty when the wheels and the probe target fill it
            (root / f".gpu/part_{letter}").write_bytes(chunk)
        names.append([f".gpu/part_{letter}"] if chunk else [])
    calls = [{"command": PROBE, "carry": probe_carry + names[0], "timeout_s": 300}]
    calls += [{"command": STASH, "carry": carry, "timeout_s": 120} for carry in names[1:-1]]
    calls.append({"command": TRAIN if regenerate else TRAIN_ONLY, "carry": names[-1] + last_carry, "timeout_s": 600})
    (gpu / "plan.json").write_text(json.dumps({"tree_bytes": tree, "calls": calls}, indent=2) + "\n")
    (gpu / "gguf.xz").unlink()


def check(root: Path = ROOT) -> list[int]:
    """Every call's total with the tree as it is now; a call over LIMIT, or with a carried path missing or too
    many paths, is refused in one line."""
    calls = read_plan(root)["calls"]
    tree = size(travelling_files(root))
    totals = []
    for number, call in enumerate(calls, 1):
        if len(call["carry"]) > MAX_CARRY:
            raise UserError(f"call {number} names {len(call['carry'])} carried paths, more than {MAX_CARRY}")
        total = tree + carried_bytes(call["carry"], root)
        if total > LIMIT:
            raise UserError(
                f"call {number} would carry {total / MIB:.1f} MiB (the working tree {tree / MIB:.1f} MiB + "
                f"{', '.join(call['carry'])}), over the {LIMIT // MIB} MiB a call may: "
                "rerun benchmarks/device/prepare.sh"
            )
        totals.append(total)
    return totals


def read_plan(root: Path = ROOT) -> dict:
    path = root / ".gpu" / "plan.json"
    if not path.is_file():
        raise UserError(f"{path} missing: run benchmarks/device/prepare.sh first")
    return json.loads(path.read_text())


def show(root: Path = ROOT) -> None:
    calls = read_plan(root)["calls"]
    for number, (call, total) in enumerate(zip(calls, check(root)), 1):
        print(f"call {number}: {total / MIB:.1f} MiB, timeout_s {call['timeout_s']}, carry {json.dumps(call['carry'])}")
        print(f"  {call['command']}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("prepare", "check"))
    parser.add_argument(
        "--no-regeneration",
        action="store_true",
        help="prepare: the last call trains for all of its time and carries no regeneration input",
    )
    args = parser.parse_args(argv)
    if args.action == "prepare":
        prepare(regenerate=not args.no_regeneration)
    elif args.no_regeneration:
        raise UserError("--no-regeneration is an option of prepare: run prepare.sh --no-regeneration")
    show()


if __name__ == "__main__":
    import sys

    run_cli(main, sys.argv[1:])
