"""benchmarks/device/plan.py, the next GPU loan's calls: the GGUF's parts sized from what travels with each call
(git's tracked and untracked-not-ignored files, not the ignored ones), joined back whole, and a plan that a
grown working tree would push over the limit refused in one line before the loan starts. At a scale of bytes:
the limit is patched down from 64 MiB. The last call carries the regeneration's input beside the last part, or
alone when they do not fit together, or none (`prepare --no-regeneration`: that call trains only)."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from draftsmith.errors import UserError
from tests.helpers import REPO


@pytest.fixture
def plan(monkeypatch):
    spec = importlib.util.spec_from_file_location("device_plan", REPO / "benchmarks" / "device" / "plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "LIMIT", 10_000)
    monkeypatch.setattr(module, "RESERVE", 0)
    return module


def repository(tmp_path, regen_input: int):
    """A checkout whose tree is 2,000 bytes (tracked and untracked), with 3,000 bytes of wheels and probe target,
    a 20,480-byte GGUF and a regeneration input of `regen_input` bytes to carry."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.whl/\n/.gpu/\n/ignored\n")  # 23 bytes
    (tmp_path / "tracked").write_bytes(b"t" * 977)
    subprocess.run(["git", "-C", str(tmp_path), "add", "tracked", ".gitignore"], check=True)
    (tmp_path / "untracked").write_bytes(b"u" * 1000)  # travels too
    (tmp_path / "ignored").write_bytes(b"i" * 50_000)  # does not
    carried = ((".whl/a.whl", 2500), (".gpu/probe_target/config.json", 500), (".gpu/regen.jsonl.gz", regen_input))
    for path, count in carried:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(b"w" * count)
    gguf = bytes(range(256)) * 80  # 20,480 bytes
    (tmp_path / ".gpu" / "gguf.xz").write_bytes(gguf)
    return gguf


def test_the_plan_sizes_the_parts_from_what_travels_and_refuses_a_grown_tree(tmp_path, plan, monkeypatch):
    monkeypatch.setattr(plan, "REGEN_INPUT", ".gpu/regen.jsonl.gz")
    gguf = repository(tmp_path, 500)

    plan.prepare(tmp_path)  # 2,000 bytes travel: call 1 has room for 5,000 of the GGUF beside 3,000, the rest 8,000
    calls = [(call["carry"], call["command"]) for call in plan.read_plan(tmp_path)["calls"]]
    assert calls == [
        ([".whl", ".gpu/probe_target", ".gpu/part_a"], plan.PROBE),
        ([".gpu/part_b"], plan.STASH),
        ([".gpu/part_c", ".gpu/regen.jsonl.gz"], plan.TRAIN),  # 7,480 of the GGUF and the 500-byte input
    ]
    parts = sorted((tmp_path / ".gpu").glob("part_*"))
    assert b"".join(part.read_bytes() for part in parts) == gguf and not (tmp_path / ".gpu" / "gguf.xz").exists()
    assert plan.check(tmp_path) == [10_000, 10_000, 9_980]

    (tmp_path / "new_data").write_bytes(b"n")  # an untracked folder grew after preparing
    with pytest.raises(UserError, match=r"^call 1 would carry 0\.0 MiB \(the working tree 0\.0 MiB \+ \.whl, "):
        plan.check(tmp_path)


def test_a_regeneration_input_that_does_not_fit_beside_the_last_part_travels_alone(tmp_path, plan, monkeypatch):
    monkeypatch.setattr(plan, "REGEN_INPUT", ".gpu/regen.jsonl.gz")
    repository(tmp_path, 600)  # 7,480 + 600 > 8,000

    plan.prepare(tmp_path)
    assert [call["carry"] for call in plan.read_plan(tmp_path)["calls"]][2:] == [
        [".gpu/part_c"],
        [".gpu/regen.jsonl.gz"],
    ]
    assert plan.check(tmp_path) == [10_000, 10_000, 9_480, 2_600]


def test_without_the_regeneration_the_last_call_carries_the_last_part_alone_and_trains_only(
    tmp_path, plan, monkeypatch
):
    monkeypatch.setattr(plan, "REGEN_INPUT", ".gpu/regen.jsonl.gz")
    repository(tmp_path, 600)  # the input that took a call of its own above

    plan.prepare(tmp_path, regenerate=False)
    calls = [(call["carry"], call["command"]) for call in plan.read_plan(tmp_path)["calls"]]
    assert calls[2:] == [([".gpu/part_c"], plan.TRAIN_ONLY)]
    assert "REGEN_S=0" in plan.TRAIN_ONLY and plan.check(tmp_path) == [10_000, 10_000, 9_480]
