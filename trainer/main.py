"""`draftsmith train recipe=NAME [key=value ...]`, `python train.py ...`, or on several processes
`accelerate launch [-m draftsmith] train[.py] recipe=NAME ...` (torchrun works too): train the recipe's
drafter into <output_dir> (checkpoints, final/, log.jsonl, TensorBoard), then evaluate it (eval.enabled).
SIGTERM saves a checkpoint and exits 75; train.resume=true continues bit-identically.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig


def main(argv: Sequence[str]) -> None:
    """Train, then (main process) evaluate: eval-split accuracy when data.eval is set, the
    speculative-decoding report when eval.enabled. The output directory is held throughout."""
    from draftsmith.recipe import load_train_recipe

    cfg = load_train_recipe(argv)  # validate before any model or data is touched
    from draftsmith.formats.folder import require_drafter_folder

    require_drafter_folder(cfg)
    from draftsmith.errors import PreemptedWhereItWas, UserError
    from draftsmith.sharding import ranks_state
    from draftsmith.threads import set_cpu_threads
    from draftsmith.trainer.checkpoint import claim_output_dir
    from draftsmith.trainer.launcher import require_deepspeed_on_cuda
    from draftsmith.trainer.loop import train

    set_cpu_threads(cfg.train.cpu_threads)  # accelerate launch's OMP_NUM_THREADS=1 is not a choice (threads.py)

    require_deepspeed_on_cuda()
    state = ranks_state()
    if not state.is_main_process:  # a run's information once, not once per rank; each rank's warnings stay
        logging.getLogger("draftsmith").setLevel(logging.WARNING)
    trained = None
    try:
        with claim_output_dir(cfg, state):
            try:
                trained = train(cfg)
            except UserError as err:  # found once the run had written its start (a feature shard's checksum)
                if not (advice := rerun_advice(cfg, str(err))):
                    raise
                raise type(err)(f"{err}{advice}") from None
            if state.is_main_process:
                from draftsmith.eval.report import evaluate_trained_run

                evaluate_trained_run(cfg, trained.prompt_count)
    except KeyboardInterrupt:  # Ctrl-C: the line says how to continue (run_cli prints it), as SIGTERM's does
        raise KeyboardInterrupt(after_interrupt(cfg, trained is not None)) from None
    except PreemptedWhereItWas:  # SIGTERM outside the loop (the data's tokenizing, the eval stage): as Ctrl-C there
        advice = after_interrupt(cfg, trained is not None)
        raise PreemptedWhereItWas(f"stopped on SIGTERM; {advice}") from None


def after_interrupt(cfg: DictConfig, trained: bool = False) -> str:
    """What to do after Ctrl-C stopped a run, for its `interrupted` line, or a SIGTERM outside its training loop (the
    data's tokenizing, the eval stage: `trained`), for its `preempted` one: once the run has written anything, the
    same command alone is refused (`check_earlier_run`)."""
    from draftsmith.trainer.checkpoint import FINAL_DIR, completed_checkpoints, earlier_run, follows_training

    output_dir = Path(cfg.output_dir)
    steps, final = completed_checkpoints(output_dir), output_dir / FINAL_DIR
    if trained and steps:  # in the eval stage: a resume writes final/ again from the last checkpoint, then evaluates
        return (
            f"training finished ({final} is written): run the same command with train.resume=true to run what "
            f"follows training ({follows_training(cfg)})"
        )
    if steps:
        return f"checkpoint {steps[-1]} is kept: run the same command with train.resume=true to continue from it"
    if final.exists():  # train.resume=true refuses a finished run without a checkpoint
        return f"the trained drafter is in {final}: evaluate it with the eval command and checkpoint={final}"
    if earlier_run(output_dir):
        return "no checkpoint was saved yet: run the same command with train.resume=true to start again from step 0"
    return "nothing was written: run the same command again"


def rerun_advice(cfg: DictConfig, said: str) -> str:
    """What a line of bad input found in training (`said`) adds when the run wrote its start and saved no checkpoint,
    which the same command alone is refused as (`check_earlier_run`); nothing to a resumed run's line, or to one
    that says how to go on."""
    from draftsmith.recipe_checks import resolve_bool_or_path
    from draftsmith.trainer.checkpoint import completed_checkpoints, earlier_run

    if resolve_bool_or_path(cfg.train.resume) is not None or "train.resume" in said:
        return ""
    try:
        if completed_checkpoints(Path(cfg.output_dir)) or not earlier_run(Path(cfg.output_dir)):
            return ""
    except OSError:  # a folder that cannot be listed: the line is the error's alone
        return ""
    return " (the run saved no checkpoint: once that is fixed, start it over with train.overwrite=true)"
