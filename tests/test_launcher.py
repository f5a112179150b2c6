"""What `accelerate launch` decides beside the recipe (trainer/launcher.py): a launcher's step settings that differ
from the recipe's are refused before anything loads, DeepSpeed's unset ones are the recipe's, and a DeepSpeed run
resumes on the number of processes that saved it, its saved drafter holding the weights its optimizer steps."""

from __future__ import annotations

import pytest
from accelerate.utils import DeepSpeedPlugin
from omegaconf import OmegaConf

from draftsmith.errors import UserError
from draftsmith.trainer.launcher import require_resumable_split, take_recipes_step
from tests.helpers import assert_one_line_error, run_entry_in_process, train_args

# what `accelerate launch` exports from a DeepSpeed config that gives the two keys (the shipped ones gave 1 and 1.0)
GIVEN_BY_THE_LAUNCH_CONFIG = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "ACCELERATE_GRADIENT_CLIPPING": "1.0"}


def recipe(grad_accum: int = 4, max_grad_norm: float = 0.5):
    return OmegaConf.create(
        {"train": {"grad_accum": grad_accum, "max_grad_norm": max_grad_norm, "micro_batch_size": 2}}
    )


def test_a_launch_accumulating_otherwise_than_the_recipe_is_refused_before_anything_loads(
    tmp_path, small_data, token_cache, capsys, monkeypatch
):
    """accelerate prefers ACCELERATE_GRADIENT_ACCUMULATION_STEPS to the Accelerator's argument: the shipped DeepSpeed
    configs' `gradient_accumulation_steps: 1` had a recipe of grad_accum 4 step its optimizer on every micro-batch,
    drawing and dropping the step's other micro-batches, without a word."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
    out = tmp_path / "run"
    args = train_args(out, small_data, token_cache, "train.max_steps=1", "train.grad_accum=2")
    result = run_entry_in_process(["train.py", *args], capsys)
    assert_one_line_error(result, 2, "accelerate would accumulate 1 micro-batches a step (ACCELERATE_GRADIENT_ACCUM")
    assert "the recipe's train.grad_accum 2: leave gradient_accumulation_steps out of the accelerate config" in (
        result.stderr
    )
    assert not out.exists()


def test_deepspeeds_unset_step_settings_are_the_recipes(monkeypatch):
    """The shipped configs leave both keys out: accelerate's plugin holds them as "auto", and would fill the
    clipping with 1.0 (under DeepSpeed clip_grad_norm_ only reads the norm; the engine clips)."""
    for name in GIVEN_BY_THE_LAUNCH_CONFIG:
        monkeypatch.delenv(name, raising=False)
    config = DeepSpeedPlugin(zero_stage=2).deepspeed_config
    assert config["gradient_accumulation_steps"] == config["gradient_clipping"] == "auto"
    take_recipes_step(recipe(), 4, config)
    assert (config["gradient_accumulation_steps"], config["gradient_clipping"]) == (4, 0.5)
    assert config["train_micro_batch_size_per_gpu"] == 2


@pytest.mark.parametrize(
    ("grad_accum", "max_grad_norm", "said"),
    [
        (4, 1.0, "the DeepSpeed config's gradient_accumulation_steps is 1 and the recipe's train.grad_accum 4: "),
        (1, 0.5, "the DeepSpeed config's gradient_clipping is 1.0 and the recipe's train.max_grad_norm 0.5: "),
    ],
)
def test_deepspeeds_given_step_settings_must_be_the_recipes(grad_accum, max_grad_norm, said, monkeypatch):
    for name, value in GIVEN_BY_THE_LAUNCH_CONFIG.items():
        monkeypatch.setenv(name, value)
    config = DeepSpeedPlugin(zero_stage=2).deepspeed_config
    with pytest.raises(UserError, match=f"^{said}DeepSpeed would train with "):
        take_recipes_step(recipe(grad_accum, max_grad_norm), grad_accum, config)
    take_recipes_step(recipe(1, 1.0), 1, config)  # the same values: taken as they are


def test_a_deepspeed_checkpoint_resumes_on_the_processes_that_saved_it_only():
    """DeepSpeed's engine raises on another data-parallel world size after the target and data have loaded; DDP
    resumes on any split of the same step (trainer/checkpoint.py resplit)."""
    saved = {"processes": 8, "micro_batch_size": 1, "grad_accum": 1}
    now = {"processes": 4, "micro_batch_size": 1, "grad_accum": 2}
    with pytest.raises(UserError, match="^train.resume: this run's checkpoint was saved by DeepSpeed on 8 processes"):
        require_resumable_split(saved, now, deepspeed=True)
    require_resumable_split(saved, now, deepspeed=False)
    require_resumable_split(saved, {**now, "processes": 8, "grad_accum": 1}, deepspeed=True)


def _group_timeout_s() -> int:
    """On a forked rank: the seconds the process group ranks_state forms waits in a collective, as the exit code's
    minutes."""
    import torch
    import torch.distributed as dist

    from draftsmith.sharding import end_process_group, ranks_state

    ranks_state()
    waits = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout
    end_process_group()
    return int(waits.total_seconds()) // 60


def test_the_ranks_wait_for_rank_0s_work_alone_longer_than_torchs_default():
    """torch's default is 10 minutes for NCCL (30 for gloo), and rank 0 tokenizes the data, or reads a whole target
    to shard it, while the others wait in a barrier or a broadcast: past it the ranks' watchdog ends the run."""
    from draftsmith.sharding import RANKS_TIMEOUT_S
    from tests.forked import forked_ranks

    ranks = forked_ranks(_group_timeout_s, world=2)
    assert [rank.wait() for rank in ranks] == [RANKS_TIMEOUT_S // 60] * 2 == [240, 240]


def test_a_trainable_parameter_in_no_loss_stops_the_first_step_as_a_bug():
    """DDP (a multi-process launch) refuses a trainable parameter that got no gradient at its next step, after the run
    started; the loop names it at this process's first step, on one process too, so a test of every kind finds it."""
    from types import SimpleNamespace

    import torch

    from draftsmith.trainer.loop import require_every_parameter_trained

    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    module[0](torch.ones(1, 2)).sum().backward()
    run = SimpleNamespace(module=module, accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)))
    with pytest.raises(RuntimeError, match=r"^the drafter's trainable parameters 1.weight, 1.bias got no gradient"):
        require_every_parameter_trained(run)
    assert run.gradients_checked
    module[1].requires_grad_(False)
    require_every_parameter_trained(run)
    module[1].requires_grad_(True)
    run.accelerator.state.deepspeed_plugin = object()  # its gradients are in its engine's buffers: not read
    require_every_parameter_trained(run)


def test_deepspeeds_saved_drafter_is_its_optimizers_float32_weights_under_every_name(tmp_path, monkeypatch):
    """DeepSpeed cannot run here (it needs CUDA): a stand-in accelerator and `safe_get_full_fp32_param` that gives
    each trainable parameter's master, the module in bfloat16 as DeepSpeed's bf16 leaves it. The saved drafter holds
    the masters, read once per parameter in the module's order (the collective every rank runs alike), under the
    names the state dict had: the module's (Medusa's hooks give vLLM's names) or, as ZeRO-3 gathers it, the
    parameters' own; frozen weights stay as they were. The GPU tier runs the engine."""
    from types import SimpleNamespace

    import deepspeed.utils
    import torch
    from safetensors.torch import load_file

    from draftsmith.heads import drafter_class
    from draftsmith.target import load_target
    from draftsmith.trainer.checkpoint import save_drafter
    from tests.helpers import REFERENCE_TARGET

    medusa = drafter_class("medusa")
    drafter = medusa.from_target(medusa.Config(num_heads=2), load_target(str(REFERENCE_TARGET)), "tiny")
    drafter.lm_heads[0].requires_grad_(False)
    masters = {id(p): torch.randn(p.shape) for p in drafter.parameters() if p.requires_grad}
    drafter.to(torch.bfloat16)
    asked = []

    def master(param):
        asked.append(id(param))
        return masters.get(id(param))

    monkeypatch.setattr(deepspeed.utils, "safe_get_full_fp32_param", master)
    zero3 = {name: param.detach().clone() for name, param in drafter.named_parameters()}  # gathered, hooks not run
    for gathered, hooked in ((lambda module: module.state_dict(), True), (lambda module: zero3, False)):
        accelerator = SimpleNamespace(
            state=SimpleNamespace(deepspeed_plugin=object()), mixed_precision="bf16", is_main_process=True,
            get_state_dict=gathered, unwrap_model=lambda module: module,
        )  # fmt: skip
        asked.clear()
        save_drafter(accelerator, drafter, tmp_path / str(hooked))
        saved = load_file(tmp_path / str(hooked) / "model.safetensors")
        held = drafter.state_dict(keep_vars=True) if hooked else dict(drafter.named_parameters())
        assert set(saved) == set(held) and any(".linear." in name for name in saved) != hooked
        for name, tensor in saved.items():
            expected = masters[id(held[name])] if held[name].requires_grad else held[name].detach()
            assert torch.equal(tensor, expected), name
        assert asked == [id(p) for p in drafter.parameters() if p.requires_grad]
