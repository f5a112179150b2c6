"""The γ per batch size (export/schedule.py, `export.batch_sweep`): chosen from a load sweep's step
costs and pooled acceptance, K = 0 where speculation loses, no edge that gains less than the margin,
written into the export's served config (and its serving command) with the pinned sampling settings;
a sweep that is not of this checkpoint, a malformed one, or one where speculation never pays is refused
in one line before the target loads; the rows `draftsmith sweep` writes are the rows it reads. The engine
side, the sweep measured in vLLM included, is tests/test_engine_vllm.py."""

from __future__ import annotations

import json
import os
import re

import pytest

from draftsmith.errors import ExportCheckFailed, UserError
from draftsmith.export.schedule import NoSchedule, batch_schedule, pooled_acceptance
from draftsmith.export.sweep import measured_row
from draftsmith.export.sweep_results import read_sweep
from draftsmith.files import checkpoint_digest
from draftsmith.formats.repo import EXPORT_INFO, VLLM_PINNED
from tests.helpers import (
    KINDS,
    assert_one_line_error,
    run_entry_in_process,
    save_drafter,
    stand_in_vllm,
    sweep,
    sweep_row,
    write_sweep,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pooled_acceptance_counts_a_position_only_in_runs_that_drafted_it():
    rows = [sweep_row("d", 1, 1, 1, [50], 100), sweep_row("d", 3, 2, 1, [70, 40, 10], 100)]
    assert pooled_acceptance(rows) == [120 / 200, 40 / 100, 10 / 100]


def test_k_follows_the_step_cost_and_is_zero_where_speculation_loses():
    # E(γ) = 1.6 / 1.9 / 2.0; a verify step costs more with γ the busier the batch
    cost = {
        1: {1: 1.1, 2: 1.2, 3: 1.4},
        2: {1: 1.2, 2: 1.5, 3: 1.9},
        4: {1: 1.7, 2: 2.4, 3: 3.2},
        8: {1: 2.0, 2: 3.0, 3: 4.0},
    }
    rows = sweep({c: 1.0 for c in cost}, {(c, g): s for c, by_gamma in cost.items() for g, s in by_gamma.items()})
    schedule = batch_schedule(rows, "d")
    chosen = {int(c): v["chosen"] for c, v in schedule["per_concurrency"].items()}
    assert chosen == {1: 2, 2: 1, 4: 0, 8: 0}  # 1.9/1.2 > 2.0/1.4 > 1.6/1.1; at 4, 1.6/1.7 < 1
    # batch sizes between measured ones take the nearer's K (geometric midpoint); the engine carries the last K on
    assert schedule["num_speculative_tokens_per_batch_size"] == [[1, 1, 2], [2, 2, 1], [3, 8, 0]]
    assert schedule["num_speculative_tokens"] == 2


def test_a_k_change_that_gains_less_than_the_margin_is_not_made():
    # at concurrency 2, γ 1 would be 1% faster than keeping γ 2: not worth an edge the engine could thrash on
    rows = sweep({1: 1.0, 2: 1.0}, {(1, 2): 1.2, (1, 1): 1.1, (2, 2): 1.4, (2, 1): 1.6 / (1.9 / 1.4) / 1.01})
    assert batch_schedule(rows, "d")["num_speculative_tokens_per_batch_size"] == [[1, 2, 2]]


def test_k_0_costs_what_the_drafter_measured_at_gamma_0_and_a_load_below_plain_is_named():
    """vLLM 0.32 runs an EAGLE-style drafter at K = 0 too: with the sweep's γ-0 rows (the drafter loaded,
    drafting nowhere) K = 0 is predicted at that cost, not plain's, and where even the best K stays
    below plain the schedule says so."""
    rows = sweep({1: 1.0, 2: 1.0}, {(1, 1): 1.1, (2, 1): 1.7})  # E(1) = 1.6: 1.45x at c=1, 0.94x at c=2
    assert batch_schedule(rows, "d")["num_speculative_tokens_per_batch_size"] == [[1, 1, 1], [2, 2, 0]]
    off = [sweep_row("d", 0, c, 1.1, (), 0, "abc") for c in (1, 2)]  # 10% slower than plain at γ 0
    schedule = batch_schedule(rows + off, "d")
    level = schedule["per_concurrency"]["2"]
    assert level["chosen"] == 1 and level["predicted_tok_s"]["0"] == round(1 / 1.1, 2)  # 0.94 beats 0.91 by > 2%
    assert schedule["below_plain_at"] == [2] and schedule["gamma_0_measured"] == [1, 2]
    assert schedule["predicted_below_plain_at"] == [2] and schedule["pays_up_to"] == 1
    assert schedule["acceptance"] == [0.6]  # the γ-0 rows add no drafts and dilute nothing
    # served at K = 0 where that is the choice, the measured speed-up is the γ-0 row's
    busy = sweep({1: 1.0, 2: 1.0}, {(1, 1): 1.1, (2, 1): 2.0}) + [
        sweep_row("d", 0, c, 1.05, (), 0, "abc") for c in (1, 2)
    ]
    level = batch_schedule(busy, "d")["per_concurrency"]["2"]
    assert level["chosen"] == 0 and level["speedup"] == round(1 / 1.05, 4)


def test_levels_that_pay_again_above_one_below_plain_are_said_to_need_a_longer_measure():
    """A load sweep's journey (2026-12-08): c=4 predicted at 0.95x and c=8 at 1.21x, and the card said "it pays up to 2;
    with more requests in flight, serve the target without it" beside its own 1.21x. Levels that do not fall with the
    load are the timings' noise (levels of a second or two): said so, with the settings that measure longer; the
    card marks a speed-up within the sweep's noise."""
    from draftsmith.export.card import batch_section
    from draftsmith.export.schedule import pays_again_above, pays_line

    rows = sweep({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, {(1, 1): 1.1, (2, 1): 1.2, (4, 1): 1.7, (8, 1): 1.3})
    rows += [sweep_row("d", 0, c, 1.1, (), 0, "abc") for c in (1, 2, 4, 8)]  # the drafter's cost at γ 0: 0.91x
    schedule = batch_schedule(rows, "d")  # E(1) = 1.6: 1.45x, 1.33x, 0.94x, 1.23x
    assert schedule["predicted_below_plain_at"] == [4] and schedule["pays_up_to"] == 2
    assert pays_again_above(schedule) == [8]
    line = pays_line(schedule)
    assert line.startswith("at or above plain again at concurrency 8: the levels do not fall with the load")
    assert "export.sweep.min_requests" in line and "serve the target without it" not in line
    falling = batch_schedule([row for row in rows if row["concurrency"] != 8], "d")
    assert pays_again_above(falling) == [] and pays_line(falling).startswith("it pays at every measured concurrency")
    card = "\n".join(batch_section({**schedule, "sweep": "s.jsonl", "method": "d", "engine": [], "noise": 0.25}))
    assert "**Predicted below plain decoding at concurrency 4 (0.94×, the γ served there" in card and line in card
    assert "| 4 | 1 | 1.60 | 0.94× (within the noise) |" in card and "| 1 | 1 | 1.60 | 1.45× |" in card


def test_a_drafter_that_beats_only_its_own_gamma_0_cost_is_refused():
    rows = sweep({1: 1.0}, {(1, 1): 1.62}) + [sweep_row("d", 0, 1, 1.3, (), 0, "abc")]  # 0.99x plain, 1.28x its γ 0
    with pytest.raises(NoSchedule, match="at no measured concurrency"):
        batch_schedule(rows, "d")


def test_a_sweep_where_speculation_never_pays_is_refused():
    rows = sweep({1: 1.0, 2: 1.0}, {(1, 1): 1.7, (2, 1): 1.8})
    with pytest.raises(NoSchedule, match="at no measured concurrency"):
        batch_schedule(rows, "d")


def test_an_export_whose_sweep_gives_no_schedule_is_bad_input_naming_its_sweep(tmp_path, caplog):
    """It exited 3, a correctness check's code ("report it; do not retry"), for a sweep to measure again on a quieter
    machine or a drafter to serve without: the input to fix, exit 2, naming export.batch_sweep. The sweep says so as
    it ends (summary.json alone held it)."""
    from draftsmith.errors import outcome
    from draftsmith.export.schedule import batch_schedule_of
    from draftsmith.export.sweep import schedule_of
    from draftsmith.recipe import load_recipe

    rows = sweep({1: 1.0, 2: 1.0}, {(1, 1): 1.7, (2, 1): 1.8})
    with caplog.at_level("WARNING"):
        assert schedule_of(rows, "d")[0]["refused"].startswith("at no measured concurrency")
    assert "no γ per batch size for an export from this sweep: at no measured" in caplog.text
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(NoSchedule) as refused:
        batch_schedule_of(load_recipe(["recipe=eagle3", f"export.batch_sweep={path}"]), "abc")
    code, line = outcome(refused.value, "export")
    assert code == 2 and line.startswith(f"error: export.batch_sweep={path}: at no measured concurrency does")


def test_the_margin_is_the_sweeps_own_noise_where_that_is_larger():
    """A second plain run 10% off the first: a predicted gain under 10% is noise, not a reason to draft."""
    rows = sweep({1: 1.0, 2: 1.0}, {(1, 1): 1.5, (2, 1): 1.1})  # E(1) = 1.6: 1.07x at c=1, 1.45x at c=2
    quiet = rows + [sweep_row("plain-rerun", 0, c, 1.01) for c in (1, 2)]
    schedule = batch_schedule(quiet, "d")
    assert schedule["num_speculative_tokens_per_batch_size"] == [[1, 2, 1]]
    assert (schedule["noise"], schedule["margin"]) == (round(1 - 1 / 1.01, 4), 0.02)
    noisy = rows + [sweep_row("plain-rerun", 0, 1, 1.0), sweep_row("plain-rerun", 0, 2, 1 / 1.1)]
    schedule = batch_schedule(noisy, "d")
    assert schedule["num_speculative_tokens_per_batch_size"] == [[1, 1, 0], [2, 2, 1]]  # 7% < the 10% noise
    assert schedule["margin"] == schedule["noise"] == 0.1
    # c=1 drafts nothing and costs nothing (plain's rate: no γ-0 rows), c=2 gains: at least plain everywhere
    assert schedule["predicted_below_plain_at"] == [] and schedule["pays_up_to"] == 2
    loaded = noisy + [sweep_row("d", 0, c, 1.02, (), 0, "abc") for c in (1, 2)]  # the drafter costs 2% at γ 0
    schedule = batch_schedule(loaded, "d")
    # within the 10% noise, so not below_plain_at; still named, and so is the load up to which it pays: none
    assert schedule["below_plain_at"] == [] and schedule["predicted_below_plain_at"] == [1]
    assert schedule["pays_up_to"] is None
    swamped = sweep({1: 1.0}, {(1, 1): 1.1}) + [sweep_row("plain-rerun", 0, 1, 1 / 1.6)]  # 45% gain, 60% noise
    with pytest.raises(
        NoSchedule, match=r"plain decoding by 60% \(how far the sweep.s two plain runs differ\).*quieter machine"
    ):
        batch_schedule(swamped, "d")


def test_a_malformed_sweep_is_named_by_its_line(tmp_path):
    path = tmp_path / "sweep.jsonl"
    path.write_text(json.dumps(sweep_row("plain", 0, 1, 1.0)) + "\n{not json\n")
    with pytest.raises(UserError, match=r"sweep.jsonl:2: not JSON \(Expecting property name .*\)$"):
        read_sweep(path)
    # a last row cut short by a stop mid-write, and the sweep's summary.json given for its rows (a journey, 2026-12-08)
    path.write_text(json.dumps(sweep_row("plain", 0, 1, 1.0)) + "\n" + json.dumps(sweep_row("plain", 0, 2, 1.0))[:40])
    with pytest.raises(UserError, match=r"sweep.jsonl:2: not JSON .*: the last row, cut short .*delete that line"):
        read_sweep(path)
    path.write_text(json.dumps({"noise": 0.1, "schedule": {}}, indent=2))
    with pytest.raises(UserError, match=r"sweep.jsonl:1: not JSON .*: one JSON document, not a sweep's JSON lines"):
        read_sweep(path)
    path.write_text(json.dumps({"method": "plain"}) + "\n")
    with pytest.raises(UserError, match="sweep.jsonl:1: not a load-sweep row"):
        read_sweep(path)
    # values edited by hand: exit 70 (0 seconds divided by, a count read as int("x")), or exported (negative rates,
    # NaN written into draftsmith_export.json)
    for key, value, said in (("seconds", 0, "a finite time > 0"), ("concurrency", "x", "a count >= 1"),
                             ("seconds", float("nan"), "a finite time > 0"), ("drafts", -1, "a count >= 0"),
                             ("accepted_per_position", None, "a list of finite counts >= 0"),
                             ("engine", None, "a mapping"), ("source_sha256", 5, "a sha256 or null")):  # fmt: skip
        path.write_text(json.dumps({**sweep_row("d", 1, 1, 1.0, (5,), 10), key: value}) + "\n")
        with pytest.raises(UserError, match=rf"sweep.jsonl:1: not a load-sweep row \({key}=.*: {re.escape(said)}\)$"):
            read_sweep(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(UserError, match="sweep.jsonl:1: not a load-sweep row"):
        read_sweep(path)


def test_the_rows_the_sweep_writes_are_what_the_export_reads(tmp_path):
    """export/sweep.py's row from a level as the vLLM worker answers it: read back and scheduled."""

    def level(seconds: float, tokens: int, accepted: list[int], outputs: list[list[int]]) -> dict:
        metrics = {"num_drafts": 100 if accepted else 0, "num_accepted_tokens": sum(accepted)}
        return {"concurrency": 1, "outputs": outputs, "seconds": seconds, "tokens": tokens, "steps": 100,
                "mean_batch": 1.0, "tpot_s": [0.01],
                "metrics": {**metrics, "accepted_per_position": accepted}}  # fmt: skip

    served = {"vllm_version": "0.32.0", "engine_settings": {"runner": "cpu"}, "process_s": 1.0}
    plain = measured_row("plain", 0, level(100.0, 100, [], [[1, 2]]), None, served, {"threads": 2}, None)
    drafted = measured_row("d", 1, level(110.0, 160, [60], [[1, 2]]), plain, served, {"threads": 2}, "abc")
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in (plain, drafted)))
    rows = read_sweep(path)
    assert rows[1]["lossless"] and rows[1]["tau"] == 1.6 and rows[1]["speedup"] == round(1.6 / 1.1, 4)
    assert batch_schedule(rows, "d")["num_speculative_tokens_per_batch_size"] == [[1, 1, 1]]


@pytest.fixture(scope="module")
def target():
    from draftsmith.target import load_target
    from tests.helpers import REFERENCE_TARGET

    return load_target(str(REFERENCE_TARGET))


def test_the_export_serves_the_schedule_with_the_pinned_sampling_settings(target, tmp_path):
    from draftsmith.export.run import export_checkpoint
    from draftsmith.recipe import load_recipe

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    measured = write_sweep(tmp_path / "sweep.jsonl", checkpoint_digest(checkpoint))
    with measured.open("a") as rows:  # the same export served with a schedule (load_sweep.py's row): not a γ's
        served_with_schedule = {"num_speculative_tokens_per_batch_size": [[1, 4, 1]]}
        scheduled = sweep_row("d+schedule", 1, 1, 0.5, [90], 100, checkpoint_digest(checkpoint))
        rows.write(json.dumps({**scheduled, "engine": served_with_schedule}) + "\n")
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path / 'run'}",
                       f"export.output={tmp_path / 'export'}", f"export.batch_sweep={measured}"])  # fmt: skip
    folder = export_checkpoint(cfg, checkpoint, target=target)["vllm"]
    info = json.loads((folder / EXPORT_INFO).read_text())
    served = {
        "method": "eagle3",
        "num_speculative_tokens": 2,
        **VLLM_PINNED,
        "num_speculative_tokens_per_batch_size": [[1, 2, 2], [3, 4, 0]],
    }
    assert info["speculative_config"] == served and info["num_speculative_tokens"] == 2
    assert info["batch_schedule"]["sweep"] == str(measured) and info["batch_schedule"]["method"] == "d"
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 2
    card = (folder / "README.md").read_text()
    assert "## Speed-up by batch size" in card and "| 4 | 0 | – | 1.00× |" in card  # τ and speed-up as a pair
    assert (
        json.dumps(
            {"method": "eagle3", "model": str(folder.resolve()), **{k: v for k, v in served.items() if k != "method"}}
        )
        in card
    )

    # the same sweep with the drafter's γ-0 rows (10% below plain), served as the sweep serves γ 0 (a schedule
    # drafting nowhere): at 4 requests even its best γ loses to plain
    with measured.open("a") as rows:
        for concurrency in (1, 4):
            at_zero = sweep_row("d", 0, concurrency, 1.1, (), 0, checkpoint_digest(checkpoint))
            rows.write(json.dumps({**at_zero, "engine": {"num_speculative_tokens_per_batch_size": [[1, 4, 0]]}}) + "\n")
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path / 'run'}",
                       f"export.output={tmp_path / 'again'}", f"export.batch_sweep={measured}"])  # fmt: skip
    folder = export_checkpoint(cfg, checkpoint, target=target)["vllm"]
    schedule = json.loads((folder / EXPORT_INFO).read_text())["batch_schedule"]
    assert schedule["below_plain_at"] == [4] and schedule["num_speculative_tokens_per_batch_size"] == [
        [1, 2, 2],
        [3, 4, 1],
    ]
    card = (folder / "README.md").read_text()
    assert "At concurrency 4 this drafter is predicted slower than plain decoding" in card
    assert "Predicted below plain decoding at concurrency 4 (0.94×, the γ served there" in card
    assert "it pays at every measured concurrency up to 1; with more requests in flight, serve the target" in card


@pytest.mark.parametrize(
    "setting, fragment",
    [
        ("other", "the sweep measured no export of it"),
        ("gamma", "export.num_speculative_tokens=3 but export.batch_sweep's schedule needs 2"),
        ("missing", "does not exist"),
        ("empty", "holds no rows: sweep the checkpoint"),
    ],
)
def test_a_sweep_that_does_not_fit_is_refused_in_one_line(setting, fragment, target, tmp_path, capsys):
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    digest = "0" * 64 if setting == "other" else checkpoint_digest(checkpoint)
    measured = write_sweep(tmp_path / "sweep.jsonl", digest) if setting != "missing" else tmp_path / "none.jsonl"
    if setting == "empty":
        measured.write_text("")
    extra = ["export.num_speculative_tokens=3"] if setting == "gamma" else []
    result = run_entry_in_process(["-m", "export", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path / 'run'}", f"export.output={tmp_path / 'export'}",
                                   f"export.batch_sweep={measured}", *extra], capsys)  # fmt: skip
    assert_one_line_error(result, 2, fragment)
    assert not (tmp_path / "export" / "vllm").exists()


def test_the_sweep_of_another_checkpoint_is_not_resumed(target, tmp_path, capsys):
    """`draftsmith sweep` into a folder holding another checkpoint's rows: one line, before any engine."""
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    (tmp_path / "sweep").mkdir()
    write_sweep(tmp_path / "sweep" / "sweep.jsonl", "0" * 64)
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path}",
                                   f"export.vllm_python={stand_in_vllm(tmp_path)}"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, "holds a sweep of another checkpoint (sha256 000000000000)")


def test_the_sweeps_traffic_is_read_before_the_export_is_written_and_what_it_serves_is_said(
    target, tmp_path, capsys, caplog
):
    """A load sweep's journey (2026-12-08): a traffic file that cannot be read was refused after the drafter had been
    exported into the sweep's folder (11 MB left beside the error); of 32 conversations 24 were served and 4,832
    tokens of a prompt cut to data.max_length, without a word. The prompts are read first; the log says how many
    are served, of which domains, and how many were cut; more engine threads than cores (64 on 2) are warned of."""
    from draftsmith.export.sweep import sweep_load, sweep_prompts
    from draftsmith.recipe import load_recipe

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("not json\n")
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path}", f"export.vllm_python={stand_in_vllm(tmp_path)}",
                                   f"eval.data=[{traffic}]"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, f"{traffic}:1: malformed JSON")
    assert not (tmp_path / "sweep").exists()
    asked = [{"messages": [{"role": "user", "content": text}], "domain": domain}
             for domain, text in [("a", "hi " * 500), ("a", "hello"), ("a", "more"), ("b", "bye")]]  # fmt: skip
    traffic.write_text("".join(json.dumps(record) + "\n" for record in asked))
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"eval.data=[{traffic}]", "eval.max_prompts=2"])
    with caplog.at_level("INFO"):
        prompts = sweep_prompts(cfg)
    assert len(prompts) == 3 and max(map(len, prompts)) == cfg.data.max_length
    assert f"the sweep serves 3 prompts of {traffic} (a 2, b 1: the first eval.max_prompts=2 of each domain)" in (
        caplog.text
    )
    assert f"1 of the 3 prompts are longer than data.max_length={cfg.data.max_length} tokens" in caplog.text
    (tmp_path / "folder").mkdir()  # an export's record, as the sweep's engine arguments are read from it
    (tmp_path / "folder" / EXPORT_INFO).write_text("{}")
    cores = len(os.sched_getaffinity(0))
    many = load_recipe([f"recipe={KINDS['eagle3']}", f"export.sweep.cpu_threads={cores + 1}"])
    with caplog.at_level("INFO"):
        sweep_load(many, "python", tmp_path / "folder", {}, target.config, 1, prompts)
    assert f"the engine runs {cores + 1} threads on {cores} cores (export.sweep.cpu_threads)" in caplog.text
    traffic.write_text(json.dumps({"messages": [{"role": "system", "content": "be brief"}]}) + "\n")
    with pytest.raises(UserError, match="record 1: no assistant turn, and it does not end with a user turn to answer$"):
        sweep_prompts(cfg)  # it said "so nothing to train on", of traffic to answer


def test_a_sweep_with_a_program_that_is_not_a_vllm_python_is_refused_before_it_exports(target, tmp_path, capsys):
    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['eagle3']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path}", "export.vllm_python=/bin/true"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, "export.vllm_python='/bin/true' is not the Python of an environment with vllm")
    assert not (tmp_path / "sweep").exists()


def test_a_sweep_gamma_beyond_what_the_checkpoint_proposes_is_refused_before_anything_runs(target, tmp_path, capsys):
    """Medusa with 3 heads proposes at most 3 tokens: γ 4 would fail in vLLM only after the plain levels ran.
    Refused from the checkpoint's own config, before the vLLM Python is even asked (this one is no vLLM); unset,
    the γs fit the drafter."""
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt", num_heads=3)
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['medusa']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path}", "export.vllm_python=/bin/true",
                                   "export.sweep.gammas=[1,2,4]"], capsys)  # fmt: skip
    assert_one_line_error(
        result, 2, f"export.sweep.gammas=[1, 2, 4] but the medusa drafter in {checkpoint} proposes at most 3 tokens a "
        "step: give γs up to 3 (export.sweep.gammas=[1,2,3])",
    )  # fmt: skip
    assert not (tmp_path / "sweep").exists()
    # unset, the γs are 1 up to the drafter's chain (they were [1..5]): past that check to the Python's
    result = run_entry_in_process(["-m", "export.sweep", f"recipe={KINDS['medusa']}", f"checkpoint={checkpoint}",
                                   f"output_dir={tmp_path}", "export.vllm_python=/bin/true"], capsys)  # fmt: skip
    assert_one_line_error(result, 2, "export.vllm_python='/bin/true' is not the Python of an environment with vllm")


class EngineFailingSuffix:
    """Stands in for export.verify.EngineSession, answering every "runs" request with equal outputs, but failing
    vLLM's suffix decoding (or `failing`: what the request is for) as the real engine once did, started in the
    process of an n-gram engine (an llvmlite AttributeError; tests/test_engine_vllm.py serves them in turn)."""

    def __init__(self, failing: str = "serve suffix at γ 24"):
        self.asked: list[str] = []
        self.failing = failing

    def run(self, python: str, request: dict, doing: str) -> dict:
        config = request["runs"][0]["speculative_config"]
        self.asked.append(doing)
        if doing == self.failing:
            raise ExportCheckFailed(f"vLLM could not {doing}: AttributeError: 'NoneType' object has no attribute 'x'")
        gamma = config["num_speculative_tokens"] if config else 0
        levels = [
            {"concurrency": level["concurrency"], "outputs": [[1, 2]] * len(level["prompts"]), "seconds": 1.0,
             "tokens": 2 * len(level["prompts"]), "steps": 2, "mean_batch": 1.0, "tpot_s": [0.01],
             "metrics": {"num_drafts": 2 if gamma else 0, "num_accepted_tokens": gamma,
                         "accepted_per_position": [1] * gamma}}
            for level in request["load"]
        ]  # fmt: skip
        return {"vllm_version": "0.32.0", "runs": {"run": {"levels": levels, "engine_settings": {}}}}


def test_a_free_baseline_the_engine_fails_is_left_unmeasured_not_blamed_on_the_export(target, tmp_path):
    """`draftsmith sweep` whose suffix stage failed in vLLM ended exit 3 blaming the export, with the drafter's rows
    never measured: now the baseline's rows are missing, the summary says why, and the drafter is measured."""
    from draftsmith.export.sweep import run_sweep
    from draftsmith.recipe import load_recipe

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    python = stand_in_vllm(tmp_path, arctic=True)
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path}", f"export.vllm_python={python}",
                       "export.sweep.concurrency=[1]", "export.sweep.gammas=[1,2]", "export.sweep.suffix=true",
                       "eval.max_prompts=1"])  # fmt: skip
    engine = EngineFailingSuffix()
    rows = read_sweep(run_sweep(cfg, checkpoint, engine, target))
    assert "serve suffix at γ 24" in engine.asked
    assert {(row["method"], row["gamma"]) for row in rows} == {
        ("plain", 0), ("ngram", 1), ("ngram", 2), ("eagle3", 0), ("eagle3", 1), ("eagle3", 2), ("plain-rerun", 0)
    }  # fmt: skip
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert summary["settings"]["not_measured"] == {
        "suffix at γ 24": "vLLM could not serve suffix at γ 24: AttributeError: 'NoneType' object has no attribute 'x'"
    }
    assert summary["best_per_concurrency"]["suffix"] == {} and summary["best_per_concurrency"]["eagle3"]


def test_a_free_baseline_measured_at_some_of_its_gammas_is_summarized_as_the_best_of_those(target, tmp_path):
    """n-gram served at γ 1 and 2 and failing at 2: the summary and the plot's legend named it the best fixed γ, as
    if every γ had been measured; now they say which γs it was measured at."""
    from draftsmith.export.sweep import run_sweep
    from draftsmith.export.sweep_results import best_label
    from draftsmith.recipe import load_recipe

    checkpoint = save_drafter("eagle3", target, tmp_path / "ckpt")
    python = stand_in_vllm(tmp_path)
    cfg = load_recipe([f"recipe={KINDS['eagle3']}", f"output_dir={tmp_path}", f"export.vllm_python={python}",
                       "export.sweep.concurrency=[1]", "export.sweep.gammas=[1,2]", "eval.max_prompts=1"])  # fmt: skip
    run_sweep(cfg, checkpoint, EngineFailingSuffix(failing="serve ngram at γ 2"), target)
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert list(summary["settings"]["not_measured"]) == ["ngram at γ 2"]
    assert summary["gammas"]["ngram"] == {"measured": [1], "not_measured": [2]}
    assert summary["gammas"]["eagle3"] == {"measured": [0, 1, 2], "not_measured": []}
    assert best_label("ngram", summary["gammas"]["ngram"]) == "ngram (best of γ 1; γ 2 not measured)"
    assert best_label("eagle3", summary["gammas"]["eagle3"]) == "eagle3 (best fixed γ)"
    assert (tmp_path / "sweep" / "speedup.png").stat().st_size > 0
