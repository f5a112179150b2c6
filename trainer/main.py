"""`draftsmith train recipe=NAME [key=value ...]`, `python train.py ...`, or on several processes
`accelerate launch [-m draftsmith] train[.py] recipe=NAME ...` (torchrun works too): train the recipe's
drafter into <output_dir> (checkpoints, final/, log.jsonl, TensorBoard), then evaluate it (eval.enabled).
SIGTERM saves a checkpoint and exits 75; train.resume=true continues bit-identically.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path


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
    from draftsmith.trainer.checkpoint import after_interrupt, claim_output_dir, rerun_advice
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
                if not (advice := rerun_advice(Path(cfg.output_dir), str(err))):
                    raise
                raise UserError(f"{err}{advice}") from None
            if state.is_main_process:
                from draftsmith.eval.report import evaluate_trained_run

                evaluate_trained_run(cfg, trained.prompt_count)
    except KeyboardInterrupt:  # Ctrl-C: the line says how to continue (run_cli prints it), as SIGTERM's does
        raise KeyboardInterrupt(after_interrupt(Path(cfg.output_dir), trained is not None)) from None
    except PreemptedWhereItWas:  # SIGTERM outside the loop (the data's tokenizing, the eval stage): as Ctrl-C there
        advice = after_interrupt(Path(cfg.output_dir), trained is not None)
        raise PreemptedWhereItWas(f"stopped on SIGTERM; {advice}") from None
