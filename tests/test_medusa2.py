"""Medusa-2 on the reference target: heads and LoRA adapters train together while the target's own
weights stay untouched (and shared, not copied); the checkpoint holds heads + adapters only; the
eval verifies with the adapted target, losslessly; resume restores adapters and continues the heads' ramp
from the run's step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    REFERENCE_TARGET,
    assert_one_line_error,
    first_records,
    read_log,
    run_entry_in_process,
    train_args,
    train_in_process,
)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def medusa2_args(output_dir: Path, data, cache, *extra: str) -> list[str]:
    # A faster-moving backbone than the recipe's, so 24 steps change the adapters measurably.
    args = train_args(
        output_dir,
        data,
        cache,
        "drafter.heads_warmup=4",
        "train.lr=5e-4",
        "drafter.heads_lr_scale=4",
        "drafter.heads_weight=0.2",
        *extra,
    )
    args[0] = "recipe=medusa2"
    return args


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_data, token_cache):
    output_dir = tmp_path_factory.mktemp("medusa2") / "run"
    _, target = train_in_process(
        medusa2_args(output_dir, small_data, token_cache, "train.max_steps=24", "train.save_every=18")
    )
    return output_dir, target


def load(output_dir: Path, target):
    from draftsmith.heads.base import TargetShape, load_drafter

    return load_drafter(output_dir / "final", TargetShape.of(target, str(REFERENCE_TARGET)), target).eval()


def test_heads_learn_while_the_backbone_keeps_its_behaviour(run):
    output_dir, _ = run
    table = json.loads((output_dir / "eval_accuracy.json").read_text())
    trained, untrained = table["trained"]["all"], table["untrained"]["all"]
    assert trained["head1/top1"] > untrained["head1/top1"] + 0.02, (trained, untrained)
    assert untrained["backbone/kl"] == pytest.approx(0.0, abs=1e-6)  # fresh adapters change nothing
    assert 0 < trained["backbone/kl"] < 0.2 and trained["backbone/top1"] > 0.9, trained
    log = read_log(output_dir)
    assert log[24]["train/head1/loss"] < log[1]["train/head1/loss"]


def test_target_untouched_weights_shared_checkpoint_holds_heads_and_adapters(run):
    output_dir, target = run
    on_disk = load_file(str(REFERENCE_TARGET / "model.safetensors"))
    for name, param in target.state_dict().items():
        assert torch.equal(param, on_disk[name].to(param.dtype)), name
    assert not any(p.requires_grad for p in target.parameters())

    saved = load_file(str(output_dir / "final" / "model.safetensors"))
    assert all(k.startswith(("blocks.", "lm_heads.")) or ".lora_" in k for k in saved), sorted(saved)[:5]
    lora_b = [v for k, v in saved.items() if ".lora_B." in k]
    assert lora_b and any(v.abs().sum() > 0 for v in lora_b), "adapters never trained"

    drafter = load(output_dir, target)
    # the heads' weight ramps over the trainer's optimizer steps (heads_warmup=4), whatever a step's split
    weights = []
    for step in (0, 1, 3, 10):
        drafter.optimizer_step = step
        weights.append(drafter.heads_weight_now())
    assert weights == pytest.approx([0.2 * math.sin(math.pi / 8), 0.2 * math.sin(math.pi / 4), 0.2, 0.2])
    # an earlier draftsmith's checkpoint held a micro-batch counter for the ramp: it still loads
    assert drafter.load_state_dict({**saved, "forward_calls": torch.tensor(24)}, strict=True)
    adapted = drafter.proposer().verifier
    assert adapted is not target
    # The adapted target reads the target's own tensors: no second copy of the weights.
    assert adapted.get_input_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert (
        adapted.model.layers[0].self_attn.q_proj.base_layer.weight.data_ptr()
        == target.model.layers[0].self_attn.q_proj.weight.data_ptr()
    )

    # adapter/ is a standard peft adapter of the target: applied to a fresh target it computes the same logits.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(REFERENCE_TARGET, dtype=torch.float32)
    served = PeftModel.from_pretrained(fresh, output_dir / "final" / "adapter").eval()
    ids = torch.randint(3, 4000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, original = adapted(ids).logits, served(ids).logits, target(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
    assert (ours - original).abs().max() > 1e-4  # the adapters are active in the verifier


def test_eval_verifies_with_the_adapted_target_losslessly(run, small_data, tmp_path, capsys):
    output_dir, _ = run
    one_prompt = first_records(small_data["eval"], tmp_path / "eval.jsonl", 1)  # one domain, one prompt
    result = run_entry_in_process(
        [
            "-m",
            "eval",
            "recipe=medusa2",
            f"target.name_or_path={REFERENCE_TARGET}",
            f"checkpoint={output_dir / 'final'}",
            f"eval.data=[{one_prompt}]",
            "eval.max_new_tokens=24",
            f"output_dir={tmp_path}",
        ],
        capsys,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert "medusa2" in report["verifier"] and "adapters" in report["verifier"]
    for domain, rows in report["domains"].items():
        assert rows["chain"]["lossless"] is True and rows["tree"]["lossless"] is True, domain
    original = report["baselines"]["all"]["original"]
    assert original["lossless"] is None and 0.0 <= original["same_output"] <= 1.0
    assert "verified by the target with the medusa2" in (tmp_path / "eval" / "report.md").read_text()


def test_resume_restores_adapters_and_the_heads_ramp(run, small_data, token_cache, tmp_path):
    output_dir, _ = run
    resumed = tmp_path / "resumed"
    checkpoint = output_dir / "checkpoints" / "step_0000018"  # past the heads' ramp's warmup, as step 12 would be
    train_in_process(
        medusa2_args(
            resumed,
            small_data,
            token_cache,
            "train.max_steps=24",
            "train.save_every=18",
            f"train.resume={checkpoint}",
            "data.eval=[]",  # the resumed losses and weights are compared, not its eval stage
        )
    )
    a, b = read_log(output_dir), read_log(resumed)
    for step in range(19, 25):
        assert b[step]["train/loss"] == pytest.approx(a[step]["train/loss"], rel=1e-5, abs=1e-6), step
    final_a = load_file(str(output_dir / "final" / "model.safetensors"))
    final_b = load_file(str(resumed / "final" / "model.safetensors"))
    assert set(final_a) == set(final_b)
    for name in final_a:
        torch.testing.assert_close(final_b[name], final_a[name], rtol=1e-5, atol=1e-6)


def test_lora_that_does_not_fit_the_target_is_one_line_exit_2(small_data, token_cache, tmp_path, capsys):
    out = tmp_path / "bad"
    result = run_entry_in_process(
        [
            "train.py",
            *medusa2_args(out, small_data, token_cache, "train.max_steps=1", "drafter.lora.target_modules=[nope_proj]"),
        ],
        capsys,
    )
    assert_one_line_error(result, 2, prefix="error: drafter.lora does not fit LlamaForCausalLM")
    assert not (out / "final").exists()
