"""benchmarks/target_matrix.py trains each family's target once: the `mtp` rows' target is that trained target given
the MTP layer, bit for bit the target a second training of the release form wrote before (the rows' drafter runs are
stubbed here: what is tested is the targets they get); a release that is another model than the plain target
(Kimi-K2.5's wrapper) is trained apart, as before."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

import draftsmith.random_target as random_target
from tests.helpers import assert_one_line_error, benchmark_module

MATRIX = benchmark_module("target_matrix")
STEPS = 2  # the targets' training steps: enough to tell a trained target from a seeded one
# what a training here reads: which targets are trained and what they are given is tested, not what they learn
SMALL_TRAINING = random_target.DemoTraining(rows=2, tokens=64)


def run_matrix(family: str, kinds: str, tmp_path: Path, monkeypatch) -> tuple[dict, int, list[dict]]:
    """The matrix's main on `family` and `kinds`: (kind -> the tensors and config.json its row's target had, the
    targets' trainings, the rows)."""
    seen: dict = {}
    trainings = []
    train = random_target.train_on_demo

    def measure(family, kind, target, *rest) -> dict:
        seen[kind] = (load_file(str(target / "model.safetensors")), json.loads((target / "config.json").read_text()))
        return {"family": family, "kind": kind}

    def counted_training(model, steps, training):
        trainings.append(steps)
        train(model, steps, SMALL_TRAINING)

    monkeypatch.setattr(MATRIX, "measure", measure)
    monkeypatch.setattr(MATRIX, "target_variety", lambda target: 0.5)  # decoding is not what is tested
    monkeypatch.setattr(random_target, "train_on_demo", counted_training)
    out = tmp_path / "rows.jsonl"
    argv = ["target_matrix.py", "--families", family, "--kinds", kinds, "--target-steps", str(STEPS), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    MATRIX.main()
    return seen, len(trainings), [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.slow
def test_a_family_target_is_trained_once_and_its_mtp_target_is_unchanged(tmp_path, monkeypatch):
    seen, trainings, rows = run_matrix("deepseek_v3", "eagle3,mtp", tmp_path, monkeypatch)
    assert trainings == 1
    assert [(row["kind"], row["target_train_steps"], row["target_variety"]) for row in rows] == [
        ("eagle3", STEPS, 0.5),
        ("mtp", STEPS, 0.5),
    ]
    (plain, _), (with_layer, config) = seen["eagle3"], seen["mtp"]
    assert config["num_nextn_predict_layers"] == 1
    layer = [name for name in with_layer if name not in plain]
    assert layer and all(name.startswith("model.layers.4.") for name in layer)  # the layer after the 4 layers
    assert all(with_layer[name].equal(tensor) for name, tensor in plain.items())
    # what the matrix wrote before: the release form trained again, then given the layer
    before = random_target.write_random_target(
        "deepseek_v3", tmp_path / "before", released=True, seed_from=random_target.demo_tokenizer_dir(),
        train_steps=STEPS,
    )  # fmt: skip
    MATRIX.with_mtp_layer(before)
    assert json.loads((before / "config.json").read_text()) == config
    written = load_file(str(before / "model.safetensors"))
    assert written.keys() == with_layer.keys()
    assert all(written[name].equal(tensor) for name, tensor in with_layer.items())


@pytest.mark.slow
def test_a_release_of_another_model_is_trained_apart(tmp_path, monkeypatch):
    """Kimi-K2.5's plain target is its DeepSeek-V3 language model alone; its release, which the `mtp` row serves, the
    wrapper whole, whose language model's random weights are other ones: trained apart."""
    assert MATRIX.released_apart("kimi_k25") and not MATRIX.released_apart("deepseek_v3")
    seen, trainings, _ = run_matrix("kimi_k25", "eagle3,mtp", tmp_path, monkeypatch)
    assert trainings == 2
    assert seen["eagle3"][1]["architectures"] == ["DeepseekV3ForCausalLM"]
    assert seen["mtp"][1]["architectures"] == ["Kimi_K25ForConditionalGeneration"]


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--kinds", "eagle3,medusa3"], "--kinds: medusa3 not among eagle3, "),
        (["--families", "llama,qwen9"], "--families: transformers has no model type 'qwen9' (closest: qwen3"),
        (["--set", "train.lrr=1"], "--set/--export-set with --kinds eagle3: unknown recipe key 'train.lrr'"),
        (["--export-set", "export.tolerance=x"], "with --kinds eagle3: override export.tolerance='x'"),
    ],
)
def test_a_bad_family_kind_or_override_is_refused_before_any_target_is_written(
    argv, fragment, tmp_path, monkeypatch, capsys
):
    """A misspelt family used to stop the run with a traceback after the earlier families' minutes, and an override
    no recipe takes appended a row of failed runs per family and kind: both are one line, exit 2, nothing written."""
    monkeypatch.setattr(random_target, "write_random_target", lambda *args, **kwargs: pytest.fail("a target written"))
    out, work = tmp_path / "rows.jsonl", tmp_path / "work"
    defaults = {"--families": "llama", "--kinds": "eagle3"}
    given = dict(zip(argv[::2], argv[1::2]))
    args = [
        *(x for key, value in (defaults | given).items() for x in (key, value)),
        "--out",
        str(out),
        "--work",
        str(work),
    ]
    monkeypatch.setattr(sys, "argv", ["script", *args])
    with pytest.raises(SystemExit) as ended:
        MATRIX.main()
    result = SimpleNamespace(returncode=ended.value.code, stderr=capsys.readouterr().err)
    assert_one_line_error(result, 2, fragment, prefix="script: error: ")
    assert not out.exists() and not work.exists()


def test_without_vllm_python_a_row_has_no_export(tmp_path, monkeypatch):
    """--vllm-python is optional: without it the row ends after the resumed run, where it used to record the export
    as refused for a Python named 'None'."""
    commands = []
    monkeypatch.setattr(MATRIX, "run", lambda args, env: commands.append(args) or (0, "", 1.0))
    monkeypatch.setattr(MATRIX, "eval_row", lambda run_dir: {"lossless": True, "tau_draftsmith": 2.0})
    row = MATRIX.measure("llama", "eagle3", tmp_path / "target", tmp_path, None, {}, [], [])
    assert [args[0] for args in commands] == ["train.py", "train.py"]
    assert row == {"family": "llama", "kind": "eagle3", "train": True, "train_s": 1.0, "resume": True} | {
        "lossless": True,
        "tau_draftsmith": 2.0,
    }
