"""The `train` section's values checked, and those of its settings that depend on the `data` section, before any
model or data is touched (`draftsmith.recipe.validate` calls `check_train`; the other sections' checks are in
draftsmith/recipe_checks.py)."""

from __future__ import annotations

import os
from pathlib import Path

from draftsmith.recipe_checks import (
    FLOAT32_MAX,
    LATEST_INTACT,
    require,
    require_at_least_one,
    require_seed,
    resolve_bool_or_path,
)

# the longest range train.profile_steps may name: a trace of a few steps shows a step's parts, and the profiler keeps
# every step's events in memory until it writes them
MAX_PROFILED_STEPS = 20


def check_train(train, data, trains: bool = True) -> None:
    """The `train` section, and its settings that depend on the `data` section; what only a command that
    `trains` reads is checked for such a command (a run's saved recipe.yaml, read by eval, is not refused over it)."""
    from draftsmith.recipe_schema import TrainSection

    require(train.lr > 0, f"train.lr={train.lr} must be > 0")
    require(train.optimizer in ("adamw", "muon"), f"train.optimizer={train.optimizer!r} must be adamw or muon")
    require(
        train.max_steps == -1 or train.max_steps >= 1,
        f"train.max_steps={train.max_steps} must be >= 1, or -1 to run train.epochs epochs",
    )
    require(train.epochs >= 1, f"train.epochs={train.epochs} must be >= 1")
    # the run's length is max_steps when set (trainer/setup.py): other epochs were ignored without a word. A value
    # equal to the default cannot be told from an unset one here, and changes nothing.
    require(
        not trains or train.max_steps == -1 or train.epochs == TrainSection.epochs,
        f"train.epochs={train.epochs} is not read while train.max_steps={train.max_steps} sets the run's length: give "
        f"train.max_steps=-1 with it, or train.epochs={TrainSection.epochs}",
    )
    # a value that is no keyword was read as a checkpoint's path (`yes`: "not a complete checkpoint"); one that names
    # a folder, or is written as a path, is left to the resume, which says what is wrong with it
    resume = resolve_bool_or_path(train.resume)
    require(
        resume in (None, "latest", LATEST_INTACT) or os.sep in resume or Path(resume).expanduser().exists(),
        f"train.resume={train.resume} is none of true, false, {LATEST_INTACT} or a checkpoint's path (no such "
        "path here)",
    )
    require(
        train.cpu_threads is None or train.cpu_threads >= 1,
        f"train.cpu_threads={train.cpu_threads} must be >= 1, or null to let draftsmith choose",
    )
    require_at_least_one(train, "train", "micro_batch_size", "grad_accum", "log_every", "vocab_chunk_mb")
    require_seed(train.seed, "train.seed")
    for key in (
        "warmup_steps",
        "save_every",
        "keep_checkpoints",
        "num_workers",
        "max_nonfinite",
        "weight_decay",
        "heldout",
        "eval_every",
        "patience",
    ):
        require(train[key] >= 0, f"train.{key}={train[key]} must be >= 0")
    require(train.max_grad_norm > 0, f"train.max_grad_norm={train.max_grad_norm} must be > 0")
    require(
        train.peak_tflops is None or train.peak_tflops > 0,
        f"train.peak_tflops={train.peak_tflops} must be > 0 (the device's peak TFLOP/s), or null to report no MFU",
    )
    steps = None if train.profile_steps is None else list(train.profile_steps)
    require(
        steps is None or (len(steps) == 2 and 1 <= steps[0] <= steps[1]),
        f"train.profile_steps={steps} must be [first, last] optimizer steps with 1 <= first <= last, or null",
    )
    require(  # [1, 120] ran out of memory at step 88 on the 5M-parameter demo drafter, then crashed (SIGSEGV)
        steps is None or steps[1] - steps[0] < MAX_PROFILED_STEPS,
        f"train.profile_steps={steps} profiles {steps[1] - steps[0] + 1 if steps else 0} steps: the profiler holds "
        "every step's events in memory until its trace is written (about 25 MB a step of the demo drafter, more a "
        f"larger model): profile at most {MAX_PROFILED_STEPS}",
    )
    require(  # the run ended with nothing profiled, and no word; a resumed run's recipe is its own
        not trains or steps is None or train.max_steps == -1 or steps[0] <= train.max_steps or resume is not None,
        f"train.profile_steps={steps} starts after the run's last step (train.max_steps={train.max_steps}): nothing "
        "would be profiled",
    )
    require(
        train.eval_every == 0 or train.heldout > 0,
        f"train.eval_every={train.eval_every} needs train.heldout > 0 "
        "(conversations of data.train to evaluate on, never trained on)",
    )
    require(
        train.heldout == 0 or data.features is None,
        f"train.heldout={train.heldout} is not supported with data.features yet (it holds out tokenized data.train); "
        "set train.heldout=0",
    )
    require(
        not (trains and train.compile_target) or data.features is None,
        "train.compile_target=true compiles the target's layers, which a run on data.features never runs; drop one",
    )
    require(
        train.patience == 0 or train.eval_every > 0,
        f"train.patience={train.patience} needs train.eval_every > 0 (it counts held-out evaluations without a "
        "new best)",
    )
    betas = list(train.adam_betas)
    require(
        len(betas) == 2 and all(0 <= b < 1 for b in betas), f"train.adam_betas={betas} must be two values in [0, 1)"
    )
    # AdamW's first step moves each weight by up to lr / (1 - beta1), a float32 number: beyond float32's range
    # the optimizer fails in that step (a finite weight update past it ends the run as diverged instead).
    first_step = train.lr / (1 - betas[0])
    require(
        first_step <= FLOAT32_MAX,
        f"train.lr={train.lr} is beyond float32: AdamW's first step, lr / (1 - adam_betas[0]) = {first_step:.3g}, "
        f"exceeds {FLOAT32_MAX:.3g}",
    )
    require(
        not (train.overwrite and resolve_bool_or_path(train.resume)),
        "train.overwrite=true and train.resume are both set: continue the earlier run or start over, not both",
    )
