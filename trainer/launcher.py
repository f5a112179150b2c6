"""The run's Accelerator, and what `accelerate launch` decides beside the recipe: its mixed precision, and under
DeepSpeed the step's accumulation and clipping.

The recipe says how a step trains (train.grad_accum, train.max_grad_norm, train.micro_batch_size); a launcher's
config can say it again, and then wins without a word: accelerate prefers ACCELERATE_GRADIENT_ACCUMULATION_STEPS
(which `accelerate launch` exports from a DeepSpeed config's gradient_accumulation_steps) over the Accelerator's
argument, and under DeepSpeed clips in its engine at the config's gradient_clipping (accelerate fills an unset one
with 1.0), where clip_grad_norm_ only reads the norm. A step of grad_accum 4 would then step the optimizer on every
micro-batch. So the launcher's value, where it gives one, must be the recipe's (one line, exit 2, before any model
or data is touched), and DeepSpeed's unset ("auto") values are filled from the recipe. Under DeepSpeed's mixed
precision the saved drafter is read from its optimizer's float32 weights (`with_fp32_masters`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import parse_flag_from_env
from omegaconf import DictConfig, OmegaConf
from torch.nn import Parameter

from draftsmith.errors import UserError
from draftsmith.outputs import RECIPE_NAME
from draftsmith.recipe import derived
from draftsmith.recipe_schema import CHOICES

log = logging.getLogger("draftsmith.train")


def make_accelerator(cfg: DictConfig, output_dir: Path) -> Accelerator:
    """The run's Accelerator: train.grad_accum, train.mixed_precision, TensorBoard under the output directory."""
    require_deepspeed_on_cuda()
    accelerator = Accelerator(
        gradient_accumulation_steps=cfg.train.grad_accum,
        mixed_precision=mixed_precision(cfg.train.mixed_precision),
        log_with="tensorboard",
        project_dir=str(output_dir),
        # The schedule counts optimizer steps; we step it ourselves once per optimizer step.
        step_scheduler_with_optimizer=False,
        # Without a GPU, accelerate only forms a process group (gloo) when told the run is on CPU;
        # this makes `torchrun`/`accelerate launch --multi_gpu` with N processes real DDP on CPU.
        cpu=not torch.cuda.is_available(),
    )
    plugin = accelerator.state.deepspeed_plugin
    take_recipes_step(cfg, accelerator.gradient_accumulation_steps, plugin.deepspeed_config if plugin else None)
    return accelerator


def require_deepspeed_on_cuda() -> None:
    """accelerate launch's DeepSpeed configs (its environment variable) need CUDA: without it, the Accelerator's
    cpu=True drops the DeepSpeed plugin and the run is plain DDP without a word. Refused before the ranks form their
    process group (trainer/main.py): a rank that leaves one formed aborted at exit, named as the launch's cause."""
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") and not torch.cuda.is_available():
        raise UserError(
            "accelerate launch with a DeepSpeed config needs a CUDA GPU (on a CPU accelerate would run plain DDP): "
            "launch with recipes/accelerate/multi_gpu.yaml on a CPU"
        )


def take_recipes_step(cfg: DictConfig, accumulated: int, deepspeed_config: Optional[dict[str, Any]]) -> None:
    """Refuse a launcher that would train steps other than the recipe's; fill DeepSpeed's config (in place) where it
    leaves the recipe's values unset. `accumulated`: the Accelerator's micro-batches a step."""
    train = cfg.train
    if accumulated != train.grad_accum:
        raise UserError(
            f"accelerate would accumulate {accumulated} micro-batches a step (ACCELERATE_GRADIENT_ACCUMULATION_STEPS="
            f"{os.environ.get('ACCELERATE_GRADIENT_ACCUMULATION_STEPS')}, from accelerate launch's config), the "
            f"recipe's train.grad_accum {train.grad_accum}: leave gradient_accumulation_steps out of the accelerate "
            "config (draftsmith sets it from the recipe), or set train.grad_accum to it"
        )
    if deepspeed_config is None:
        return
    for key, recipe_key, value in (
        ("gradient_accumulation_steps", "train.grad_accum", int(train.grad_accum)),
        ("gradient_clipping", "train.max_grad_norm", float(train.max_grad_norm)),
    ):
        given = deepspeed_config.get(key, "auto")
        if given == "auto":
            deepspeed_config[key] = value
        elif float(given) != value:
            raise UserError(
                f"the DeepSpeed config's {key} is {given} and the recipe's {recipe_key} {value}: DeepSpeed would "
                f'train with {given}; leave {key} out of the accelerate config ("auto" in a DeepSpeed JSON file: '
                f"draftsmith sets it from the recipe), or set {recipe_key}={given}"
            )
    # DeepSpeed wants its micro-batch size up front; accelerate reads it off a prepared DataLoader, and ours is not
    # prepared (each rank streams its own micro-batches): without this, prepare() fails
    deepspeed_config["train_micro_batch_size_per_gpu"] = int(train.micro_batch_size)


def require_resumable_split(saved: dict[str, int], split: dict[str, int], deepspeed: bool) -> None:
    """DeepSpeed's ZeRO checkpoint resumes on the number of processes that saved it only (its engine raises after the
    target and data have loaded): refused first. DDP's optimizer state is whole, and resumes on any split."""
    if deepspeed and saved.get("processes", split["processes"]) != split["processes"]:
        raise UserError(
            f"train.resume: this run's checkpoint was saved by DeepSpeed on {saved['processes']} processes, which "
            f"it resumes on only (this launch has {split['processes']}): resume on {saved['processes']}, or start a "
            "new run from its checkpoint with train.init_from"
        )


def mixed_precision(setting: str):
    """`auto`: whatever `accelerate launch` was told, else bf16 on a GPU that has it, else none. fp16 needs a
    CUDA GPU: on a CPU accelerate runs it as float32 without a word."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION") if setting == "auto" else None
    # accelerate also takes fp8, which the recipe cannot record (and needs TransformerEngine or MS-AMP on a GPU)
    if launched and launched not in CHOICES["train.mixed_precision"]:
        raise UserError(
            f"mixed precision {launched} is not supported: train.mixed_precision takes "
            f"{', '.join(CHOICES['train.mixed_precision'])} (accelerate launch --mixed_precision {launched} gave it)"
        )
    if "fp16" in (setting, launched) and not torch.cuda.is_available():
        given = "train.mixed_precision=fp16" if setting == "fp16" else "accelerate launch --mixed_precision fp16"
        raise UserError(f"{given} needs a CUDA GPU; use bf16 or no on a CPU")
    if setting != "auto":
        return setting
    if launched:
        return None
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def precision_source(given: str) -> str:
    """Where the run's precision came from, for its log line and a refused resume: the recipe's
    train.mixed_precision, or under `auto` accelerate launch's setting or the device."""
    if given != "auto":
        return f"train.mixed_precision={given}"
    if os.environ.get("ACCELERATE_MIXED_PRECISION"):
        return "accelerate launch's mixed_precision, under train.mixed_precision=auto"
    return "train.mixed_precision=auto on this device"


def with_precision_used(cfg: DictConfig, accelerator: Accelerator) -> DictConfig:
    """The recipe with train.mixed_precision the precision the run computes in (`auto` resolved: accelerate launch's
    bundled configs say bf16, applied on a CPU too), logged: the recipe.yaml the run saves says what ran, and a
    resume under another precision is refused (require_precision_as_begun)."""
    used, given = accelerator.mixed_precision, cfg.train.mixed_precision
    log.info("mixed precision: %s (%s)", used, precision_source(given))
    return derived(cfg, {"train.mixed_precision": used}) if used != given else cfg


def require_precision_as_begun(used: str, given: str, output_dir: Path) -> None:
    """One line when a resume computes in another precision than the run began in (its recipe.yaml's resolved
    train.mixed_precision): its losses would differ from the run's without a word."""
    if not (output_dir / RECIPE_NAME).is_file():  # a checkpoint given by path, of a run elsewhere
        return
    began = OmegaConf.load(output_dir / RECIPE_NAME).train.get("mixed_precision", "auto")
    if began not in ("auto", used):  # auto: saved by an earlier draftsmith, which did not record what ran
        raise UserError(
            f"train.resume continues the run in {output_dir} as it began, in mixed precision {began}, and this launch "
            f"runs {used} ({precision_source(given)}): resume with train.mixed_precision={began}"
        )


def with_fp32_masters(accelerator, drafter, state_dict: dict) -> dict:
    """`state_dict` as `accelerator.get_state_dict` gave it, with each trainable parameter's 16-bit copy replaced by
    the float32 weight DeepSpeed's optimizer keeps and steps, in a DeepSpeed run computing in bf16 or fp16 (the
    module holds those copies); as it is otherwise. Its names are kept: under ZeRO-3 DeepSpeed gathers the
    parameters under their own names, else it is the module's state dict, under the names a kind's hooks give
    (Medusa's vLLM names). Every rank calls it: each weight is assembled from the ranks' partitions with a
    collective, in the module's order of parameters on every rank. A parameter DeepSpeed keeps no master of (ZeRO
    stage 0) keeps its copy, and a warning says so."""
    if accelerator.state.deepspeed_plugin is None or accelerator.mixed_precision == "no":
        return state_dict
    from deepspeed.utils import safe_get_full_fp32_param

    module = accelerator.unwrap_model(drafter)
    masters = {}
    for param in module.parameters():  # each parameter once (a tied one too)
        if param.requires_grad:
            master = safe_get_full_fp32_param(param)  # a collective: on every rank
            if master is not None and accelerator.is_main_process:
                masters[id(param)] = master.cpu()
    named = dict(module.named_parameters(remove_duplicate=False))  # ZeRO-3's names
    named |= {name: value for name, value in module.state_dict(keep_vars=True).items() if isinstance(value, Parameter)}
    if not accelerator.is_main_process:
        return state_dict
    trained = [name for name in state_dict if name in named and named[name].requires_grad]
    if kept := [name for name in trained if id(named[name]) not in masters]:
        log.warning("DeepSpeed keeps no float32 weight of %s: saved as the module's 16-bit copies", ", ".join(kept[:3]))
    return {name: masters.get(id(named[name]), value) if name in named else value for name, value in state_dict.items()}
