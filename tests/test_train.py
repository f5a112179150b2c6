"""The real train.py on the reference target: heads learn, the target stays frozen, checkpoints are
complete (two processes training one set of heads on different data: tests/test_sharding.py; a killed
run resuming into the same losses and weights: tests/test_faults.py; `train.resume=true` and
`train.overwrite=true`: tests/test_reliability.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.helpers import (
    REFERENCE_TARGET,
    assert_one_line_error,
    read_log,
    run_entry_in_process,
    train_args,
    train_in_process,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_data, token_cache):
    """One in-process training run, with the target captured to check it stays frozen."""
    output_dir = tmp_path_factory.mktemp("train") / "run"
    _, target = train_in_process(
        train_args(output_dir, small_data, token_cache, "train.max_steps=40", "train.save_every=20")
    )
    return output_dir, target


def test_heads_learn_and_beat_untrained(trained_run):
    output_dir, _ = trained_run
    table = json.loads((output_dir / "eval_accuracy.json").read_text())
    for head in ("head1", "head2", "head3"):
        trained, untrained = table["trained"]["all"][f"{head}/top1"], table["untrained"]["all"][f"{head}/top1"]
        assert trained > untrained + 0.02, (head, trained, untrained)
    assert set(table["trained"]) == {"all", "code", "docs", "math", "packages"}
    log = read_log(output_dir)
    assert log[40]["train/loss"] < log[1]["train/loss"]


def test_target_is_frozen_and_unchanged(trained_run):
    _, target = trained_run
    assert not target.training
    assert not any(p.requires_grad for p in target.parameters())
    on_disk = load_file(str(REFERENCE_TARGET / "model.safetensors"))
    for name, param in target.state_dict().items():
        assert torch.equal(param, on_disk[name].to(param.dtype)), name


def test_checkpoint_files_and_logs(trained_run):
    output_dir, _ = trained_run
    final = output_dir / "final"
    assert (final / "config.json").is_file() and (final / "model.safetensors").is_file()
    weights = load_file(str(final / "model.safetensors"))
    # vLLM's Medusa layout, so export is a config rewrite.
    assert {"blocks.0.layers.0.weight", "blocks.0.layers.0.bias", "lm_heads.2.weight"} <= set(weights)
    assert any(w.abs().sum() > 0 for k, w in weights.items() if k.startswith("blocks.")), "blocks never trained"
    config = json.loads((final / "config.json").read_text())
    assert config["target"]["hidden_size"] == 256
    assert "eval_split_metrics" not in config["learned"]  # the eval's measurement is the eval's own file
    accuracy = json.loads((output_dir / "eval_accuracy.json").read_text())
    assert accuracy["checkpoint"] == str(final.resolve()) and accuracy["trained"]["all"]["head1/top1"] > 0
    for step in (20, 40):
        ckpt = output_dir / "checkpoints" / f"step_{step:07d}"
        assert (ckpt / "trainer_state.json").is_file() and (ckpt / "drafter" / "model.safetensors").is_file()
        assert any(ckpt.glob("optimizer*")) and any(ckpt.glob("random_states*")), sorted(p.name for p in ckpt.iterdir())
    assert list((output_dir / "tb").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    assert (output_dir / "recipe.yaml").is_file()


def test_a_warm_start_begins_at_its_start_and_its_saved_recipe_reads_what_it_trained(
    trained_run, tmp_path, small_data, token_cache, capsys
):
    """`train.init_from=` starts the run from that drafter's weights: one step at a learning rate of 1e-5
    moves each by at most about 1e-5 (AdamW's first step), where a cold run's differ by more than 1e-2.
    The run's saved recipe alone (no checkpoint=) then points eval and export at the weights the run
    trained, its final/, never at its start."""
    output_dir, _ = trained_run
    start = load_file(str(output_dir / "final" / "model.safetensors"))
    warm = tmp_path / "warm"
    args = train_args(warm, small_data, token_cache, f"train.init_from={output_dir / 'final'}", "train.max_steps=1",
                      "train.lr=1e-5", "train.warmup_steps=0", "data.eval=[]", "train.save_every=1")  # fmt: skip
    final, _ = train_in_process(args)
    weights = load_file(str(final / "model.safetensors"))
    assert weights.keys() == start.keys()
    assert 0 < max(float((weights[k] - start[k]).abs().max()) for k in start) < 1e-4
    cold, _ = train_in_process(
        [a for a in args if not a.startswith(("train.init_from=", "output_dir="))] + [f"output_dir={tmp_path / 'cold'}"]
    )
    assert max(float((load_file(str(cold / "model.safetensors"))[k] - start[k]).abs().max()) for k in start) > 1e-2

    saved = f"recipe={warm / 'recipe.yaml'}"
    quick = [f"eval.data=[{small_data['eval']}]", "eval.max_prompts=1", "eval.max_new_tokens=8"]
    assert run_entry_in_process(["-m", "eval", saved, *quick], capsys).returncode == 0
    report = json.loads((warm / "eval" / "report.json").read_text())
    assert report["drafter"]["path"] == str(final.resolve())
    assert run_entry_in_process(["-m", "export", saved], capsys).returncode == 0
    info = json.loads((warm / "export" / "vllm" / "draftsmith_export.json").read_text())
    assert info["source"]["checkpoint"] == str(final.resolve())
    assert report["drafter"]["sha256"] == info["source"]["sha256"]  # the report names the weights it measured
    exported = load_file(str(warm / "export" / "vllm" / "model.safetensors"))
    assert exported and all(torch.equal(tensor, weights[name]) for name, tensor in exported.items())
    assert any(not torch.equal(tensor, start[name]) for name, tensor in exported.items())

    # Resumed, the run keeps the start it began from (the checkpoint holds the weights): another start is not
    # read, and its recipe.yaml still names the first
    resume = [a for a in args if not a.startswith("train.init_from=")]
    resume += ["train.resume=true", f"train.init_from={tmp_path / 'cold'}"]
    done = run_entry_in_process(["train.py", *resume], capsys)
    assert done.returncode == 0 and f"this run began from {output_dir / 'final'} (its recipe.yaml)" in done.stderr
    assert yaml.safe_load((warm / "recipe.yaml").read_text())["train"]["init_from"] == str(output_dir / "final")


def test_a_warm_starts_accuracy_is_measured_against_its_start(trained_run, tmp_path, small_data, token_cache):
    """The eval split's table compared a warm start's weights with a drafter built from the target, which no run
    trained: `0.000 → 0.406` for a fine-tune of an export that scores 0.356. Its baseline is now the start."""
    from draftsmith.eval.accuracy import accuracy_table

    output_dir, _ = trained_run
    warm = tmp_path / "warm"
    train_in_process(train_args(warm, small_data, token_cache, f"train.init_from={output_dir / 'final'}",
                                "train.max_steps=1", "train.lr=1e-5", "train.warmup_steps=0"))  # fmt: skip
    start = json.loads((output_dir / "eval_accuracy.json").read_text())["trained"]
    table = json.loads((warm / "eval_accuracy.json").read_text())
    assert table["untrained"] == start and table["start"] == str(output_dir / "final")
    assert "head1 top-1 (warm start → trained)" in accuracy_table(table)


def test_a_kinds_released_start_is_named_for_the_accuracy_tables_baseline():
    """The eval split's table labelled the weights a released start loads (a draft model's `name_or_path`, Gemma-4's
    released assistant, a released DFlash drafter) "untrained"; each kind names its own (tests/test_gemma4_assistant.py
    runs it through a fine-tune)."""
    from draftsmith.eval.accuracy import accuracy_table
    from draftsmith.heads import config_class

    assert config_class("draft_model")(name_or_path="org/small").released_start() == "drafter.name_or_path=org/small"
    assert config_class("dflash")(released_drafter="/r").released_start() == "drafter.released_drafter=/r"
    assert config_class("gemma4_assistant")().released_start() is None
    assert config_class("eagle3")().released_start() is None
    means = {"all": {"head1/top1": 0.5}}
    table = {"trained": means, "untrained": means, "start": None, "released_start": "drafter.name_or_path=org/small"}
    assert "head1 top-1 (released start → trained)" in accuracy_table(table)
    assert "head1 top-1 (untrained → trained)" in accuracy_table({**table, "released_start": None})


@pytest.mark.skipif(torch.cuda.is_available(), reason="DeepSpeed is refused only without a CUDA GPU")
def test_a_deepspeed_launch_without_a_gpu_is_refused_before_the_run_starts(
    tmp_path, small_data, token_cache, capsys, monkeypatch
):
    """accelerate launch's DeepSpeed configs (ACCELERATE_USE_DEEPSPEED) on a CPU ran plain DDP without a word:
    refused in one line, nothing written."""
    out = tmp_path / "run"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    result = run_entry_in_process(["train.py", *train_args(out, small_data, token_cache, "train.max_steps=1")], capsys)
    assert_one_line_error(result, 2, "accelerate launch with a DeepSpeed config needs a CUDA GPU")
    assert "multi_gpu.yaml" in result.stderr
    assert not out.exists()


def test_the_precision_a_run_computes_in_is_logged_recorded_and_kept_by_its_resume(
    tmp_path, small_data, token_cache, capsys, monkeypatch
):
    """The bundled accelerate configs' bf16 under train.mixed_precision=auto is applied on a CPU too: the run says
    so, its recipe.yaml records bf16 (not auto), and a resume that would compute in float32 is refused in one line;
    resumed with the run's precision it goes on."""
    from accelerate.state import AcceleratorState

    out = tmp_path / "run"
    args = ["train.py", *train_args(out, small_data, token_cache, "train.max_steps=1", "data.eval=[]")]  # no eval stage
    try:
        AcceleratorState._reset_state(reset_partial_state=True)  # in-process: an earlier run's precision is kept
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch's config sets
        began = run_entry_in_process(args, capsys)
        assert began.returncode == 0, began.stderr[-2000:]
        assert "mixed precision: bf16 (accelerate launch's mixed_precision, under train.mixed_precision=auto)" in (
            began.stderr
        )
        assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["mixed_precision"] == "bf16"
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
        AcceleratorState._reset_state(reset_partial_state=True)
        resume = [*args, "train.resume=true"]
        refused = run_entry_in_process(resume, capsys)
        assert_one_line_error(refused, 2, "in mixed precision bf16, and this launch runs no")
        assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["mixed_precision"] == "bf16"
        AcceleratorState._reset_state(reset_partial_state=True)
        resumed = run_entry_in_process([*resume, "train.mixed_precision=bf16"], capsys)
        assert resumed.returncode == 0, resumed.stderr[-2000:]
        assert "mixed precision: bf16 (train.mixed_precision=bf16)" in resumed.stderr
    finally:  # later in-process runs start from a fresh state, as a process does
        AcceleratorState._reset_state(reset_partial_state=True)
