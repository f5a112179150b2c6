"""The command line. Installed: `draftsmith COMMAND recipe=NAME [key=value ...]`; from a checkout the
same commands run as `python train.py`, `python -m eval`, `python -m data_prep.capture`, ...

    train       train the recipe's drafter, then evaluate it (eval-split accuracy and the report)
    eval        the speculative-decoding report of a checkpoint (drafter.path=DIR)
    capture     capture the target's features over data.train to shards
    regenerate  rewrite data.train's assistant turns with the target itself
    export      write engine-ready repos (vLLM, SGLang) from a checkpoint, optionally push them
    monitor     check a serving engine's acceptance for drift, retrain when it drops

Exit codes: 0 done, 2 bad input (one line on stderr), 75 stopped on SIGTERM after saving a
checkpoint (requeue with train.resume=true), 130 interrupted.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence

from draftsmith.errors import EXIT_USER_ERROR, run_cli

# command -> (module, function taking the arguments after the command)
COMMANDS = {
    "train": ("draftsmith.cli", "train_main"),
    "eval": ("draftsmith.eval.__main__", "main"),
    "capture": ("draftsmith.data_prep.capture", "main"),
    "regenerate": ("draftsmith.data_prep.regenerate", "main"),
    "export": ("draftsmith.export.__main__", "main"),
    "monitor": ("draftsmith.monitor.__main__", "main"),
}


def configure_logging() -> None:
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def train_main(argv: Sequence[str]) -> None:
    """Train, then (main process) evaluate: eval-split accuracy when data.eval is set, the
    speculative-decoding report when eval.enabled. The output directory is held throughout."""
    import torch
    from accelerate import PartialState

    from draftsmith.recipe import load_recipe

    cfg = load_recipe(argv)  # validate before any model or data is touched
    from draftsmith.trainer import claim_output_dir, train

    state = PartialState(cpu=not torch.cuda.is_available())
    with claim_output_dir(cfg, state):
        final = train(cfg)
        if state.is_main_process:
            from draftsmith.eval.report import evaluate_trained_run

            evaluate_trained_run(cfg, final)


def main(argv: Sequence[str] | None = None) -> None:
    """The `draftsmith` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        sys.exit(0 if argv else EXIT_USER_ERROR)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    module, function = COMMANDS[command]
    configure_logging()
    run_cli(getattr(importlib.import_module(module), function), rest)
