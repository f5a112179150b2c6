"""The benchmark scripts' arguments and resumed files, before any engine or training runs: load_sweep.py,
target_matrix.py, peer_ablation.py and standard_protocol.py read relative paths from the current directory;
load_sweep.py resumes a drafter's rows only for the checkpoint its RUN_DIR holds now (rows of another are
one line, exit 2); peer_ablation.py stops in one line when the
speculators checkpoint it was asked to score is not there. And export/gamma.py's recommended γ names only the
engines that serve the drafter's chains (an MTP drafter's: vLLM alone; SGLang's export refuses it), and the
model card lists draftsmith's P(accepted >= k) up to γ as vLLM's. Options a benchmark would ignore or could not
run are refused before any work (train_throughput.py's of the other mode, step_operators.py's compile settings,
drafters.py's unknown names, a misspelt name in any benchmark's --only, --kinds, --stages,
--methods or --dtypes list (benchmarks/names.py), step_compare.py's zero rounds and missing baseline,
speculators_cpu.py outside its venv), every benchmark's JSON says where it came from (benchmarks/provenance.py),
and standard_protocol.py's time stage measures its noise as load_sweep.py does (plain once more, last). Every
benchmark that runs vLLM reads --vllm-python alike (benchmarks/vllm_probe.py), and the ones that train a recipe
first do it one way (benchmarks/draftsmith_commands.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import runpy
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.errors import UserError
from draftsmith.export.gamma import chain_engines, recommended_gamma
from draftsmith.files import checkpoint_digest
from draftsmith.formats import Source
from draftsmith.formats.repo import TargetInfo
from draftsmith.heads import drafter_class
from draftsmith.target import TargetShape, config_json
from tests.helpers import DEMO, REFERENCE_TARGET, REPO, assert_one_line_error, save_drafter, sweep_row


def benchmark(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as `python benchmarks/<name>.py` has it
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as a script's `__main__` is: its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def exits(main, argv: list[str], monkeypatch, capsys) -> SimpleNamespace:
    """`main` run as its script with `argv`, as a finished process for assert_one_line_error."""
    monkeypatch.setattr(sys, "argv", ["script", *argv])
    with pytest.raises(SystemExit) as ended:
        main()
    return SimpleNamespace(returncode=ended.value.code, stderr=capsys.readouterr().err)


@pytest.fixture
def load_sweep(monkeypatch):
    return benchmark("load_sweep", monkeypatch)


def test_load_sweep_reads_relative_paths_from_the_current_directory(load_sweep, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out, drafters = load_sweep.paths("results/sweep", ["a=runs/a", f"b={tmp_path / 'elsewhere'}"])
    assert out == tmp_path / "results/sweep"
    assert drafters == {"a": tmp_path / "runs/a", "b": tmp_path / "elsewhere"}
    for specs, fragment in (([], "give at least one --drafter"), (["runs/a"], "give NAME=RUN_DIR")):
        with pytest.raises(UserError, match=fragment):
            load_sweep.paths("out", specs)


def test_load_sweep_resumes_a_drafters_rows_only_for_the_checkpoint_its_run_dir_holds(load_sweep, tmp_path):
    ours, other = "a" * 64, "b" * 64
    rows = [
        sweep_row("plain", 0, 1, 1.0),
        sweep_row("ngram", 2, 1, 1.0, [50, 20], 100),
        sweep_row("eagle3.1", 2, 1, 1.0, [50, 20], 100, source=ours),
        sweep_row("eagle3.1+schedule", 2, 1, 1.0, [50, 20], 100, source=ours),
        sweep_row("another", 2, 1, 1.0, [50, 20], 100, source=other),  # a drafter not swept now
    ]
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    load_sweep.require_same_checkpoints([path, tmp_path / "repeats.jsonl"], {"eagle3.1": ours})
    for name in ("eagle3.1", "eagle3.1+schedule"):  # a drafter retrained into the same RUN_DIR, or another's rows
        with path.open("a") as stream:
            stream.write(json.dumps(sweep_row(name, 3, 1, 1.0, [50, 20, 5], 100, source=other)) + "\n")
        with pytest.raises(UserError, match=rf"holds rows of eagle3.1 from another checkpoint \(sha256 {other[:12]}"):
            load_sweep.require_same_checkpoints([path], {"eagle3.1": ours})
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_load_sweep_resumes_rows_only_of_the_load_it_measures(load_sweep, tmp_path):
    """Rows that record their load (export/sweep.py Load.settings) resume only under the same settings, the
    refusal naming the flag; rows from before settings were recorded are taken as they are."""
    settings = {"target": "t", "dtype": "float32", "new_tokens": 64, "requests_per_slot": 2, "min_requests": 8,
                "threads": 2, "prompts_sha256": "p" * 64}  # fmt: skip
    path = tmp_path / "sweep.jsonl"
    rows = [sweep_row("plain", 0, 1, 1.0), sweep_row("plain", 0, 2, 1.0) | {"load": settings}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    load_sweep.require_same_load([path, tmp_path / "repeats.jsonl"], settings)
    with pytest.raises(UserError, match="measured with threads=2, this run's is 1: give --threads 2 to resume"):
        load_sweep.require_same_load([path], settings | {"threads": 1})
    with pytest.raises(UserError, match="measured with prompts_sha256=p+, this run's is q+: give the same prompts_sha"):
        load_sweep.require_same_load([path], settings | {"prompts_sha256": "q" * 64})


def test_load_sweep_refuses_before_it_writes_anything(load_sweep, tmp_path, monkeypatch, capsys):
    """Run from another directory than the repository's: RUN_DIR and --out are that directory's."""
    target = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=torch.float32)
    save_drafter("medusa", target, tmp_path / "run" / "final")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    row = sweep_row("medusa", 2, 1, 1.0, [50, 20], 100, source="c" * 64)
    (tmp_path / "out" / "sweep.jsonl").write_text(json.dumps(row) + "\n")
    argv = ["--vllm-python", "/no/python", "--drafter", "medusa=run", "--out", "out", "--stages", "report"]
    result = exits(load_sweep.main, argv, monkeypatch, capsys)
    digest = checkpoint_digest(tmp_path / "run" / "final")
    assert_one_line_error(result, 2, f"from another checkpoint (sha256 cccccccccccc, its RUN_DIR's is {digest[:12]}")
    argv = ["--vllm-python", "/no/python", "--drafter", "medusa=empty", "--out", "new", "--stages", "report"]
    assert_one_line_error(exits(load_sweep.main, argv, monkeypatch, capsys), 2, "empty holds no checkpoint")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]  # no new --out, no export
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["sweep.jsonl"]


def test_load_sweep_reuses_an_export_only_of_this_checkpoint_and_sweep(load_sweep, tmp_path):
    folder, sweep = tmp_path / "export_scheduled" / "vllm", tmp_path / "out" / "sweep.jsonl"
    assert not load_sweep.made_from(folder, "a" * 64)
    folder.mkdir(parents=True)
    info = {"source": {"sha256": "a" * 64}, "batch_schedule": {"sweep": str(sweep)}}
    (folder / "draftsmith_export.json").write_text(json.dumps(info))
    assert load_sweep.made_from(folder, "a" * 64) and load_sweep.made_from(folder, "a" * 64, sweep)
    assert not load_sweep.made_from(folder, "b" * 64)
    assert not load_sweep.made_from(folder, "a" * 64, tmp_path / "another" / "sweep.jsonl")


def test_peer_ablation_stops_in_one_line_without_the_speculators_checkpoint(tmp_path, monkeypatch, capsys):
    peer_ablation = benchmark("peer_ablation", monkeypatch)
    runs = tmp_path / "runs"
    checkpoint = tmp_path / "peer" / "speculators" / "1"
    argv = ["--runs", str(runs), "--speculators", str(checkpoint), "--variants", "base"]
    result = exits(peer_ablation.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, f"--speculators {checkpoint}: no speculators checkpoint there")
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"")
    result = exits(peer_ablation.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, "no train_command.txt beside it to run speculators' variants")
    argv = [*argv[:-1], "steps", "--speculators-variants", ""]
    result = exits(peer_ablation.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, "scored with the recipe of the base variant")
    assert not runs.exists()  # nothing trained, nothing written


def test_sampled_exactness_refuses_a_folder_without_a_serving_line_before_vllm_starts(tmp_path, monkeypatch, capsys):
    """benchmarks/vllm_sampled_exactness.py serves a folder as its card's `vllm serve` line says, or not at all."""
    sampled = benchmark("vllm_sampled_exactness", monkeypatch)
    (tmp_path / "README.md").write_text("# a card\n\nvllm serve a --x 1\nvllm serve b --x 2\n")
    argv = ["--vllm-python", "/no/python", "--folder", str(tmp_path), "--out", str(tmp_path / "rows.jsonl")]
    result = exits(sampled.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, f"{tmp_path} is not a vLLM export folder: its README.md has no one `vllm serve`")
    (tmp_path / "vllm").mkdir()  # export.output given: the line names the vLLM folder the export wrote in it
    result = exits(sampled.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, f"`vllm serve` line (give {tmp_path / 'vllm'}, the export's vLLM folder)")
    (tmp_path / "README.md").write_text("""vllm serve t --speculative-config '{"method": "eagle3"}'\n""")
    result = exits(sampled.main, [*argv, "--data", str(tmp_path / "none.jsonl")], monkeypatch, capsys)
    assert_one_line_error(result, 2, f"--data {tmp_path / 'none.jsonl'} is not a file")
    assert not (tmp_path / "rows.jsonl").exists()


def source_of(kind: str, target_dir, **config) -> Source:
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    cls = drafter_class(kind)
    drafter = cls.from_target(cls.Config(**config), model, str(target_dir))
    shape = TargetShape.of(model, str(target_dir))
    return Source(
        drafter, target_dir, model, TargetInfo(shape, model.config.to_dict(), str(target_dir), config_json(model))
    )


def test_the_recommended_gamma_names_only_the_engines_that_serve_the_drafters_chains():
    report = {
        "temperature": 0.0, "device": "cpu", "methods": {"chain": {"gamma": 3}},
        "domains": {"all": {"chain": {"per_position": [0.8, 0.5, 0.2], "target_forwards": 100,
                                      "draft_forwards_per_cycle": 3.0, "wall_s": 2.5}}},
        "baselines": {"all": {"plain": {"target_forwards": 100, "wall_s": 1.0}}},
    }  # fmt: skip
    mtp = chain_engines(source_of("mtp", DEMO / "mtp-target"))
    assert mtp == ["vllm"]  # SGLang's export of MTP is refused: no recommendation for it
    recommended = recommended_gamma(report, mtp)
    assert recommended["vllm"] == 1 and "sglang" not in recommended
    taps = [0, 1, 2]  # the demo recipe's: the default's are not distinct on a 4-layer target
    assert chain_engines(source_of("eagle3", REFERENCE_TARGET, aux_layers=taps)) == ["vllm", "sglang"]
    # SGLang's EAGLE-3 layer has no norm_before_residual: its export refuses the drafter
    assert chain_engines(source_of("eagle3", REFERENCE_TARGET, aux_layers=taps, norm_before_residual=True)) == ["vllm"]


def test_draftsmiths_acceptance_is_listed_at_every_position_up_to_gamma_as_vllm_counts_it():
    """draftsmith's chains stop at their first rejection, so its counters end at the deepest position a cycle
    reached; vLLM's count every position up to γ. An untrained drafter accepts next to nothing: its list
    still has γ entries, the unreached ones 0 (the card's table showed 2 where vLLM's showed 3)."""
    from draftsmith.export.verify import draftsmith_side

    source = source_of("medusa", REFERENCE_TARGET, num_heads=4)
    ours = draftsmith_side(source, [[1, 5, 9, 17], [1, 8, 40, 2]], 12, 4, frozenset())
    assert len(ours["at_least"]) == 4 and ours["at_least"][-1] == 0.0


def test_the_export_checks_loop_counts_a_requests_last_step_as_vllm_does():
    """vLLM drafts a whole chain at a request's last step and counts what it accepted past max_tokens, or past an EOS,
    before it cuts the output; the check's loop cut that chain at its own budget and stopped at the EOS (the Medusa-2
    demo folder's check: τ 1.454 against vLLM's 1.457). A drafter that is the target (all four of its layers) has
    every draft accepted: τ is γ + 1 in vLLM, and now in the check's loop too (3.75 before: 16 tokens, the last chain
    cut to 2), whether the request ends at max_tokens or at an EOS inside a chain."""
    from draftsmith.export.verify import draftsmith_side

    source = source_of("draft_model", REFERENCE_TARGET, num_layers=4)
    prompts = [[1, 5, 9, 17], [1, 8, 40, 2]]
    checked = draftsmith_side(source, prompts, 16, 3, frozenset())
    assert checked["tau"] == 4.0 and checked["at_least"] == [1.0, 1.0, 1.0]
    answer = checked["plain"][0]  # an EOS the first answer meets at its 7th token, inside the second chain
    firsts = {tokens[0] for tokens in checked["plain"]}
    eos = next(token for token in answer[6:] if token not in answer[:6] and token not in firsts)
    ended = draftsmith_side(source, prompts, 16, 3, frozenset({eos}))
    assert ended["plain"][0][-1] == eos and len(ended["plain"][0]) < 16, ended["plain"]
    assert ended["tau"] == 4.0 and ended["at_least"] == [1.0, 1.0, 1.0]


@pytest.mark.slow
def test_the_sampled_acceptance_benchmarks_loop_at_temperature_0_counts_as_the_export_check(monkeypatch):
    """benchmarks/vllm_sampled_acceptance.py's side in draftsmith's loop (the first token from the prefill, then the
    chains), greedy, is the export check's: the same τ and per-position rates on the same prompts."""
    from draftsmith.export.verify import draftsmith_side

    sampled = benchmark("vllm_sampled_acceptance", monkeypatch)
    source = source_of("draft_model", REFERENCE_TARGET)  # the target's first layer: drafts accepted and rejected
    prompts = [[1, 5, 9, 17], [1, 8, 40, 2], [1, 300, 301, 302]]
    checked = draftsmith_side(source, prompts, 16, 3, frozenset())
    with torch.no_grad():
        rows = sampled.draftsmith_side(source.target_model, source.drafter, prompts, 1, 16, 3, 0.0)
    ours = sampled.summary(rows)
    assert 1 < checked["tau"] < 4 and ours["tau"] == pytest.approx(checked["tau"])
    assert ours["accepted_at_position"] == pytest.approx(checked["at_least"])


def test_target_matrix_out_is_relative_to_the_current_directory(tmp_path, monkeypatch, capsys):
    """target_matrix.py reads and writes --out from the current directory, as every command does; without --out it
    keeps the repository's docs/results/target_matrix.jsonl."""
    matrix = benchmark("target_matrix", monkeypatch)
    rows = (REPO / "docs/results/target_matrix.jsonl").read_text().splitlines()
    (tmp_path / "rows.jsonl").write_text(rows[0] + "\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["target_matrix.py", "--markdown", "--out", "rows.jsonl"])
    matrix.main()
    assert capsys.readouterr().out.count("\n| ") == 1  # the one row in this directory's file, under the header
    monkeypatch.setattr(sys, "argv", ["target_matrix.py", "--markdown"])
    matrix.main()
    assert capsys.readouterr().out.count("\n| ") == len([row for row in rows if row])  # the repository's rows


@pytest.mark.slow  # two tiny targets written: about 4 s
def test_target_matrix_writes_a_row_for_a_target_the_eval_loop_refuses_and_goes_on(tmp_path, monkeypatch, capsys):
    """A family whose tiny target the eval loop refuses before any training (Mamba-2's linear layers alone; Jamba's
    before its tiny config had attention) ended the script with a traceback, exit 1, no row, the later families
    unmeasured: each kind gets a row with the refusal's line, and the next family is measured. (Mamba-2's tiny config
    was itself refused: its own heads were the release's 128 at the tiny width.)"""
    matrix = benchmark("target_matrix", monkeypatch)
    monkeypatch.setattr(matrix, "measure", lambda family, kind, *args: {"family": family, "kind": kind, "train": True})
    variety = matrix.target_variety  # the eval loop's, which refuses Mamba's target; Llama's decoding is not the point
    monkeypatch.setattr(matrix, "target_variety", lambda target: 0.5 if target.name == "llama" else variety(target))
    argv = ["--families", "mamba2,llama", "--kinds", "medusa,eagle3", "--target-steps", "0", "--out", "rows.jsonl",
            "--work", str(tmp_path / "work")]  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["target_matrix.py", *argv])
    matrix.main()
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    refused = "error: this target's layers are all linear attention"
    assert [(row["family"], row["kind"], row["train"]) for row in rows] == [
        ("mamba2", "medusa", False), ("mamba2", "eagle3", False), ("llama", "medusa", True), ("llama", "eagle3", True)
    ]  # fmt: skip
    assert all(row["error"].startswith(refused) for row in rows[:2])


def test_peer_ablation_reads_runs_and_speculators_from_the_current_directory(tmp_path, monkeypatch, capsys):
    peer_ablation = benchmark("peer_ablation", monkeypatch)
    monkeypatch.chdir(tmp_path)
    checkpoint = tmp_path / "peer" / "speculators" / "1"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"")
    argv = ["--runs", "runs", "--speculators", "peer/speculators/1", "--variants", "steps"]
    # the checkpoint is found here, then this directory's runs/base is looked for
    result = exits(peer_ablation.main, [*argv, "--speculators-variants", ""], monkeypatch, capsys)
    assert_one_line_error(result, 2, f"and {Path.cwd() / 'runs' / 'base'} holds none")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer"]


def test_standard_protocol_reads_its_paths_from_the_current_directory(tmp_path, monkeypatch, capsys):
    """--vllm-python is made absolute, not resolved: a venv's python is a link to the base interpreter, and only
    under the link's path is it the venv's."""
    protocol = benchmark("standard_protocol", monkeypatch)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "python").write_text("#!/bin/sh\necho False\n")  # a Python without arctic-inference
    (tmp_path / "base" / "python").chmod(0o755)
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(tmp_path / "base" / "python")
    argv = ["--vllm-python", "venv/bin/python", "--runs", "runs"]
    result = exits(protocol.main, [*argv, "--stages", "time"], monkeypatch, capsys)
    assert_one_line_error(result, 2, f"--vllm-python='{Path.cwd() / 'venv/bin/python'}' cannot run vLLM's suffix")
    argv = [*argv, "--stages", "regenerate", "--regenerated", "regenerated"]
    result = exits(protocol.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, "--regenerated regenerated: no such folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "venv"]  # no runs/


def test_train_throughput_refuses_the_options_its_mode_would_ignore(monkeypatch, capsys):
    """--compile, --seq, ... without --shape were ignored (the JSON said uncompiled); --data with it too."""
    main = benchmark("train_throughput", monkeypatch).main
    argv = ["--recipe", "eagle3", "--compile", "--seq", "64", "--kinds", "dflash", "--device", "cuda"]
    result = exits(main, [*argv, "--peak-tflops", "989"], monkeypatch, capsys)
    line = "--kinds, --seq, --device, --peak-tflops, --compile: with --shape only"
    assert_one_line_error(result, 2, line, prefix="script: error: ")
    result = exits(main, ["--shape", "tiny", "--data", "x.jsonl"], monkeypatch, capsys)
    assert_one_line_error(result, 2, "--data: without --shape only", prefix="script: error: ")
    result = exits(main, ["--shape", "tiny", "--kinds", "eagle3,medusa"], monkeypatch, capsys)
    assert_one_line_error(result, 2, "--kinds: medusa: not among eagle3, peagle, dflash", prefix="script: error: ")


@pytest.mark.slow
def test_train_throughput_times_a_recipes_run_end_to_end(small_data, token_cache):
    """The recipe mode built its run with the trainer's set_up in an output folder nobody had made: exit 1,
    FileNotFoundError on run/data_content.json.tmp, before the first step."""
    from tests.forked import run_forked

    args = ["--recipe", "medusa", "--data", str(small_data["train"]), "--steps", "1", "--warmup", "0",
            "--profile-steps", "1", "--threads", "1", f"data.cache_dir={token_cache}", "data.max_length=64",
            "train.micro_batch_size=2"]  # fmt: skip
    # forked, not run in this process (the script sets torch's threads, runs the profiler), nor started (6 s of imports)
    result = run_forked(["benchmarks/train_throughput.py", *args])
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout)
    assert measured["recipe"] == "medusa" and measured["timed_steps"] == 1 and measured["profiled_steps"] == 1
    assert measured["tokens_per_s"] > 0 and measured["tokens_per_s_together"] > 0
    assert len(measured["losses"]) == 3 and measured["part_s_median"]["optimizer"] > 0  # timed, together, profiled


@pytest.mark.slow
def test_step_operators_counts_what_each_part_of_a_trainer_step_dispatches():
    """The trainer's step on a tiny random target: every part dispatches operators, the drafter's forward and
    backward most (its draft layer named among their sources), and the same run counts the same again."""
    from tests.forked import run_forked

    args = ["benchmarks/step_operators.py", "--shape", "tiny", "--seq", "32", "--top", "40", "drafter.ttt_steps=2"]
    counted = []
    for _ in range(2):
        result = run_forked(args)
        assert result.returncode == 0, result.stderr[-3000:]
        counted.append(json.loads(result.stdout))
    operators = counted[0]["operators"]
    assert {"target_forward", "drafter_forward_backward", "optimizer"} <= set(operators)
    assert operators["drafter_forward_backward"] == max(v for k, v in operators.items() if k != "total")
    assert operators["total"] == sum(v for k, v in operators.items() if k != "total")
    assert "heads/eagle3.py:forward" in dict(counted[0]["drafter_sources"])
    assert counted[1]["operators"] == operators and counted[0]["versions"]["torch"] == torch.__version__


def test_step_operators_refuses_the_compile_settings_it_would_ignore(monkeypatch, capsys):
    main = benchmark("step_operators", monkeypatch).main
    ended = exits(main, ["train.compile_drafter=true"], monkeypatch, capsys)
    assert_one_line_error(ended, 2, "train.compile_drafter=true: torch.compile does not run under the counting")


@pytest.mark.slow  # the loop as it ran before: about 10 s of 256-token scans
def test_mamba2_scan_compares_the_loop_before_and_now_on_the_same_outputs():
    from tests.forked import run_forked

    result = run_forked(["benchmarks/mamba2_scan.py", "--prompts", "1", "--new-tokens", "24", "--gamma", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {row["loop"]: row for row in json.loads(result.stdout)["rows"]}
    assert list(rows) == ["before", "narrow chunks", "fed again", "now"]
    assert all(row["outputs_equal"] for row in rows.values())
    assert rows["now"]["widest_forward"] == 1 + 3 < rows["fed again"]["widest_forward"] <= 16 + 1 + 3
    assert 16 + 1 + 3 < rows["before"]["widest_forward"]
    assert rows["fed again"]["chain_tok_s"] > rows["before"]["chain_tok_s"]


@pytest.mark.slow
def test_packing_trains_a_step_each_way_on_the_same_micro_batch():
    """docs/data.md's packing table: the script crashed since the trainer's micro_batches gives its collator the
    run's draw seed (dataclasses.replace on the script's lambda)."""
    from tests.forked import run_forked

    result = run_forked(
        ["benchmarks/packing.py", "--recipes", "medusa", "--steps", "1", "--warmup", "0", "--threads", "1"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = json.loads(result.stdout)["recipes"]
    assert row["packed"]["padding_fraction"] < row["padded"]["padding_fraction"]
    assert row["packed"]["rows_per_step"] < row["padded"]["rows_per_step"] == row["micro_batch_size"]
    assert row["max_rel_loss_difference"] < 1e-4  # the same conversations' loss, however laid into rows


@pytest.mark.slow  # two targets, two drafters, both rollbacks: about 4 s
def test_recurrent_rollback_compares_states_kept_per_position_with_tokens_fed_again_on_the_same_outputs():
    from tests.forked import run_forked

    result = run_forked(["benchmarks/recurrent_rollback.py", "--prompts", "1", "--new-tokens", "12", "--gamma", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(result.stdout)["rows"]
    assert [(row["target"], row["drafter"] is None) for row in rows if row["rollback"] is None] == [
        ("bamba", True),
        ("qwen3_next", True),
    ]
    chains = {(row["target"], row["drafter"], row["rollback"]): row for row in rows if row["rollback"]}
    assert len(chains) == 8 and all(row["outputs_equal"] for row in chains.values())
    for target in ("bamba", "qwen3_next"):
        kept, fed = (chains[target, "untrained Medusa", rollback] for rollback in ("kept per position", "fed again"))
        assert kept["widest_forward"] == 1 + 3 < fed["widest_forward"]
        assert kept["target_forwards"] == 1 + 12  # the prefill, then a forward a token: every draft rejected


def test_drafters_refuses_an_unknown_name_before_any_drafter_trains(tmp_path, monkeypatch, capsys):
    drafters = benchmark("drafters", monkeypatch)
    argv = ["--only", "medusa,foo", "--runs", str(tmp_path / "runs")]
    result = exits(drafters.main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, "argument --only: foo: not among medusa, ", prefix="script: error: ")
    assert not (tmp_path / "runs").exists()


def test_step_compare_refuses_zero_rounds_and_a_missing_baseline_before_it_runs(tmp_path, monkeypatch, capsys):
    main = benchmark("step_compare", monkeypatch).main
    result = exits(main, ["--rounds", "0", "--", "--shape", "tiny"], monkeypatch, capsys)
    assert_one_line_error(result, 2, "--rounds 0: at least 1 run of each tree", prefix="script: error: ")
    missing = tmp_path / "baseline"
    result = exits(main, ["--baseline-dir", str(missing), "--", "--shape", "tiny"], monkeypatch, capsys)
    fragment = f"--baseline-dir {missing}: no benchmarks/train_throughput.py there"
    assert_one_line_error(result, 2, fragment, prefix="script: error: ")


def test_speculators_cpu_helps_anywhere_and_names_the_python_to_run_it_with(monkeypatch, capsys):
    """Outside the speculators venv (this one has no speculators): --help is the script's doc, a run one line."""
    if importlib.util.find_spec("speculators") is not None:
        pytest.skip("speculators is installed here")
    script = str(REPO / "benchmarks" / "speculators_cpu.py")
    for argv, code in ((["--help"], 0), (["--verifier-name-or-path", "x"], 2)):
        monkeypatch.setattr(sys, "argv", [script, *argv])
        with pytest.raises(SystemExit) as ended:
            runpy.run_path(script, run_name="__main__")
        assert ended.value.code == code
    out, err = capsys.readouterr()
    assert "speculators 0.9.0's trainer on a CPU" in out
    result = SimpleNamespace(returncode=2, stderr=err)
    assert_one_line_error(result, 2, "has no speculators: run this with the speculators venv's Python", alone=True)


def test_every_benchmarks_json_says_where_its_numbers_came_from(monkeypatch):
    provenance = benchmark("provenance", monkeypatch).provenance
    fields = provenance(3, time.perf_counter())
    assert fields["threads"] == 3 and fields["wall_s"] >= 0
    assert fields["machine"]["cores"] >= 1 and fields["machine"]["cpu"] and fields["machine"]["platform"]
    assert fields["versions"]["torch"] == torch.__version__ and fields["versions"]["transformers"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0 and Path(importlib.util.find_spec("draftsmith").origin).is_relative_to(REPO):
        assert fields["versions"]["draftsmith_checkout"]["commit"] == head.stdout.strip()  # an editable install


def test_load_sweeps_summary_says_where_its_numbers_came_from(load_sweep, tmp_path, monkeypatch):
    """The report stage's summary.json carries benchmarks/provenance.py's fields (it had a machine of its own)."""
    target = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=torch.float32)
    digest = checkpoint_digest(save_drafter("medusa", target, tmp_path / "run" / "final"))
    monkeypatch.setattr(load_sweep, "recipe_of", lambda run_dir: {"target": str(REFERENCE_TARGET)})
    monkeypatch.setattr(load_sweep, "mt_bench_prompts", lambda target: [[1, 2, 3]])
    engine = {"vllm_version": "0.32.0"}
    rows = [
        sweep_row("plain", 0, 1, 1.0)
        | {"tok_s": 10.0, "speedup": 1.0, "tau": None, "lossless": True, "engine": engine},
        sweep_row("medusa", 2, 1, 0.8, [50, 20], 100, source=digest)
        | {"tok_s": 12.5, "speedup": 1.25, "tau": 1.7, "lossless": True, "engine": engine},
    ]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "sweep.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["--vllm-python", "/no/python", "--drafter", f"medusa={tmp_path / 'run'}", "--out", str(tmp_path / "out"),
            "--stages", "report", "--threads", "3"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", ["load_sweep.py", *argv])
    load_sweep.main()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["threads"] == 3 and summary["machine"]["platform"] and summary["versions"]["torch"]
    assert summary["wall_s"] >= 0 and "wall_s_this_invocation" not in summary


def test_standard_protocols_time_stage_times_plain_again_last_as_its_noise(tmp_path, monkeypatch):
    """As load_sweep.py's plain-rerun: plain served once more after every other method, and its speed over the
    first plain run per category (`plain_rerun_over_plain`), the drift a speed-up must clear on this machine."""
    protocol = benchmark("standard_protocol", monkeypatch)
    by_category = {"coding": [[1, 2]], "writing": [[3, 4], [5]]}
    served = []

    def generate(python, prompts, new_tokens, config, threads):
        served.append(config["method"] if config else "plain")
        seconds = 1.0 if len(served) == 1 else 0.8  # the rerun of plain 25% faster than the first run
        one = {"seconds": seconds, "tokens": 10, "metrics": {"num_drafts": 0, "num_accepted_tokens": 0,
                                                             "accepted_per_position": []}}  # fmt: skip
        return {"vllm_version": "0.32.0", "per_prompt": [one] * len(prompts), "outputs": [[7]] * len(prompts)}

    monkeypatch.setattr(protocol, "prompts_of", lambda source, per_domain, max_length: by_category)
    monkeypatch.setattr(protocol, "vllm_generate", generate)
    monkeypatch.setattr(protocol, "drafter_config", lambda kind_dir, gamma, export="export": {"method": "eagle3"})
    args = SimpleNamespace(prompts=10, vllm_python="python", new_tokens=8, threads=2, time_gammas=[])
    timing = protocol.stage_time(args, tmp_path, ["eagle3"], {"eagle3": 3}, tmp_path / "log")
    assert served == ["plain", "ngram", "suffix", "eagle3", "plain"]  # the rerun last
    assert timing["plain_rerun_over_plain"] == {"coding": 1.25, "writing": 1.25, "all": 1.25}
    assert {row["method"] for row in timing["rows"]} >= {"plain", "plain_rerun"}


VLLM_BENCHMARKS = ("export_vllm", "load_sweep", "parallel_drafting", "peer_speculators", "regenerate_engines",
                   "standard_protocol", "vllm_gemma4_assistant", "vllm_mla_rope", "capture_engines",
                   "vllm_sampled_exactness", "vllm_sampled_acceptance")  # fmt: skip
# a benchmark's other required arguments
OTHER_REQUIRED = {name: ["--folder", "export"] for name in ("vllm_sampled_exactness", "vllm_sampled_acceptance")}


def test_every_benchmark_that_runs_vllm_reads_its_python_alike(tmp_path, monkeypatch):
    """One --vllm-python (benchmarks/vllm_probe.py's add_vllm_python): required, and relative to the current
    directory, made absolute, not resolved. load_sweep.py and the two vLLM probes took the text as given."""
    monkeypatch.chdir(tmp_path)
    parse_args, parsed = argparse.ArgumentParser.parse_args, {}

    def parse_and_stop(parser, args=None, namespace=None):
        parsed.update(vars(parse_args(parser, args, namespace)))
        raise SystemExit(0)  # before the benchmark does anything

    for name in VLLM_BENCHMARKS:
        main = benchmark(name, monkeypatch).main
        parsed.clear()
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
        other = OTHER_REQUIRED.get(name, [])
        monkeypatch.setattr(sys, "argv", [f"{name}.py", "--vllm-python", "venv/bin/python", *other])
        with pytest.raises(SystemExit):
            main()
        assert parsed["vllm_python"] == str(tmp_path / "venv/bin/python"), name
        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
        monkeypatch.setattr(sys, "argv", [f"{name}.py", *other])
        with pytest.raises(SystemExit) as ended:
            main()
        assert ended.value.code == 2, name  # argparse: the required argument missing


def test_a_benchmark_trains_a_recipe_only_where_its_run_holds_no_checkpoint(tmp_path, monkeypatch):
    commands = benchmark("draftsmith_commands", monkeypatch)
    ran = []
    monkeypatch.setattr(commands, "run_python", lambda args: ran.append(args) or 12.34)
    assert commands.train_unless_trained(["recipe=draft"], tmp_path / "run") == 12.3
    assert ran == [["train.py", "recipe=draft", f"output_dir={tmp_path / 'run'}", "eval.enabled=false",
                    "train.overwrite=true"]]  # fmt: skip
    (tmp_path / "run" / "final").mkdir(parents=True)
    (tmp_path / "run" / "final" / "model.safetensors").write_bytes(b"")
    assert commands.train_unless_trained(["recipe=draft"], tmp_path / "run") is None and len(ran) == 1


@pytest.mark.slow
def test_a_failed_draftsmith_command_stops_the_benchmark_with_its_error(monkeypatch):
    run_python = benchmark("draftsmith_commands", monkeypatch).run_python
    assert isinstance(run_python(["-c", "pass"]), float)  # its wall time; a failure stops the benchmark
    with pytest.raises(SystemExit) as ended:
        run_python(["-c", "import sys; sys.exit('no such recipe: nope')"])
    assert str(ended.value.code).startswith("`python -c import sys; sys.exit('no such recipe: nope')` failed (exit 1)")
    assert str(ended.value.code).endswith("no such recipe: nope\n")


def test_batch_sweeps_json_says_where_its_numbers_came_from(tmp_path, monkeypatch, capsys):
    """batch_sweep.py (as assisted.py, parallel_drafting.py, regenerate_engines.py and the others) carries
    benchmarks/provenance.py's fields; it had a `cpu` line of its own, no versions."""
    import draftsmith.eval.report
    import draftsmith.recipe

    sweep = benchmark("batch_sweep", monkeypatch)
    rows = {"all": {"plain": {"tau": 1.0, "tokens_per_s": 10.0, "speedup": 1.0, "lossless": True}}}
    monkeypatch.setattr(sweep, "train_unless_trained", lambda overrides, output_dir: None)
    monkeypatch.setattr(draftsmith.recipe, "load_recipe", lambda overrides: overrides)
    monkeypatch.setattr(draftsmith.eval.report, "run_eval", lambda cfg: {"batch_sweep": {"rows": {1: rows}}})
    threads = torch.get_num_threads()
    monkeypatch.setattr(sys, "argv", ["batch_sweep.py", "--only", "medusa", "--batch-sizes", "1", "--runs",
                                      str(tmp_path), "--threads", str(threads)])  # fmt: skip
    sweep.main()
    summary = json.loads(capsys.readouterr().out)
    assert summary["threads"] == threads and summary["machine"]["cores"] and summary["versions"]["torch"]
    assert summary["wall_s"] >= 0 and "cpu" not in summary and summary["drafters"]["medusa"]["train_s"] is None


@pytest.mark.parametrize(
    ("name", "argv", "fragment"),
    [
        ("export_vllm", ["--vllm-python", "x", "--only", "medusa,eagel"], "--only: eagel: no trained run in "),
        ("real_target", ["--only", "eagle3,medusa3"], "argument --only: medusa3: not among medusa, "),
        ("standard_protocol", ["--vllm-python", "x", "--stages", "train,evl"], "argument --stages: evl: not among "),
        (
            "standard_protocol",
            ["--vllm-python", "x", "--kinds", "eagle"],
            "argument --kinds: eagle: not among eagle3, ",
        ),
        ("peer_speculators", ["--vllm-python", "x", "--stages", "prepare,mesure"], "argument --stages: mesure: "),
        ("load_sweep", ["--vllm-python", "x", "--drafter", "a=b", "--stages", "sweeps"], "argument --stages: sweeps: "),
        ("vllm_spec_lossless", ["--vllm-python", "x", "--target", "t", "--methods", "ngram,sufix"], "sufix: not among"),
        ("capture", ["--dtypes", "float8,float32"], "argument --dtypes: float32: not among bfloat16, float16, float8"),
        ("batch_sweep", ["--only", "medusa,eagle4"], "argument --only: eagle4: not among dflash, "),
        ("parallel_drafting", ["--vllm-python", "x", "--variants", "pard,peagle"], "--variants: peagle: not among "),
        ("packing", ["--recipes", "medusa,eagle3,eagle", "--steps", "3,2"], "--steps 3,2: one count for all recipes"),
        # these two exited 1, the code of a failed run, for bad input
        ("redigest_regenerations", ["sharegpt_smollm3"], "no recorded input for sharegpt_smollm3 (known: "),
        ("mark_cut_answers", ["demo"], "demo holds no regenerate.settings: not a regeneration"),
    ],
)
def test_a_misspelt_name_in_a_benchmarks_list_is_refused_before_any_work(name, argv, fragment, monkeypatch, capsys):
    """A name a benchmark's --only, --kinds, --stages, --methods or --dtypes does not know used to stop the run with a
    traceback after the earlier names' work (export_vllm, real_target, standard_protocol's kinds, vllm_spec_lossless,
    capture, batch_sweep), or to be skipped without a word (the stages); packing.py ran the recipes its --steps had
    counts for. Each is one line at parse, exit 2 (benchmarks/names.py)."""
    result = exits(benchmark(name, monkeypatch).main, argv, monkeypatch, capsys)
    assert_one_line_error(result, 2, fragment, prefix="script: error: ")


def test_long_rows_measures_a_cut_row_beside_the_whole_text(monkeypatch, capsys):
    """docs/faults.md's figures for an answer of megabytes: the cut row holds data.max_length + 1 tokens, the whole
    text all of them; refused sizes stop before any process starts."""
    long_rows = benchmark("long_rows", monkeypatch)
    cut, whole = long_rows.measured(0.02, 16), long_rows.measured(0.02, None)
    assert cut["tokens"] == 17 < 1000 < whole["tokens"] and cut["peak_rss_gb"] > 0
    refused = exits(long_rows.main, ["--megabytes", "0"], monkeypatch, capsys)
    assert refused.returncode == 2 and "--megabytes must be above 0" in refused.stderr
