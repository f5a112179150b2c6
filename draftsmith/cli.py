"""The command line. Installed: `draftsmith COMMAND recipe=NAME [key=value ...]`; from a checkout the
same commands run as `python train.py`, `python -m eval`, `python -m data_prep.capture`, ...; several
processes: `accelerate launch -m draftsmith train ...` (or `accelerate launch train.py ...`).

    train       train the recipe's drafter, then evaluate it (eval-split accuracy and the report)
    eval        the speculative-decoding report of a drafter (checkpoint=DIR)
    capture     capture the target's features over data.train to shards
    regenerate  rewrite data.train's assistant turns with the target itself
    export      write engine-ready repos (vLLM, SGLang) from a checkpoint, optionally push them
    sweep       serve a checkpoint's export in vLLM under load: the rows export.batch_sweep reads
    monitor     check a serving engine's acceptance for drift, retrain when it drops

Every command takes `--help` (with recipe=NAME: that recipe's keys and values) and `--cfg` (print
the resolved recipe and exit without running). `checkpoint=DIR` names the drafter a read-only command
reads: eval and export read it (without it, `<output_dir>/final`), monitor watches it; train refuses it
and starts from `train.init_from=DIR` (a warm start).

Exit codes (one line on stderr; docs/faults.md): 0 done, 2 bad input, 3 a lossless or export check
failed, 4 training diverged, 69 an engine the job needs is down (retry), 70 a draftsmith bug (the
traceback in a log file, or on stderr with DRAFTSMITH_DEBUG=1), 74 a full disk or I/O error, 75
stopped on SIGTERM after saving a checkpoint (requeue with train.resume=true), 130 interrupted;
`monitor check` adds its outcomes 10, 11, 12, 13.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from draftsmith.errors import EXIT_USER_ERROR, run_cli

# command -> (module, function taking the arguments after the command)
COMMANDS = {
    "train": ("draftsmith.trainer.main", "main"),
    "eval": ("draftsmith.eval.__main__", "main"),
    "capture": ("draftsmith.data_prep.capture", "main"),
    "regenerate": ("draftsmith.data_prep.regenerate", "main"),
    "export": ("draftsmith.export.__main__", "main"),
    "sweep": ("draftsmith.export.sweep", "main"),
    "monitor": ("draftsmith.monitor.__main__", "main"),
}


SUBCOMMANDS = (["check"], ["watch"])  # monitor's, before its recipe arguments

# command -> its own recipe sections, shown first by --help (the others follow)
COMMAND_SECTIONS = {
    "train": ("drafter", "target", "data", "train"),
    "eval": ("eval", "drafter", "target"),
    "capture": ("data", "target"),
    "regenerate": ("data", "target"),
    "export": ("export", "target", "eval"),
    "sweep": ("export", "eval", "target"),
    "monitor": ("monitor", "target", "export"),
}


def recipe_args(argv: Sequence[str]) -> list[str]:
    """The recipe's arguments among a command's: recipe=NAME and key=value (not a sub-command such as
    monitor's check|watch, not an option)."""
    return [arg for arg in argv if "=" in arg and not arg.startswith("-")]


def help_text(usage: str, argv: Sequence[str], own: Sequence[str] = ()) -> str:
    """The command's usage, the common options, and the recipe keys (the given recipe's values when
    recipe=NAME is among the arguments), the command's `own` sections first."""
    from draftsmith.recipe import compose, split_argv
    from draftsmith.recipe_keys import render_text

    args = recipe_args(argv)
    # composed, not validated: the keys of a recipe that cannot run on this machine are listed too
    cfg = compose(*split_argv(args)) if any(arg.startswith("recipe=") for arg in args) else None
    options = (
        "Options:\n  --help  this text (with recipe=NAME: that recipe's keys and values)\n"
        "  --cfg   print the resolved recipe (YAML) and exit without running"
    )
    keys = "Recipe keys" + (
        " and the recipe's values" if cfg is not None else " (schema defaults; recipe=NAME --help shows a recipe's)"
    )
    return f"{usage.strip()}\n\n{options}\n\n{keys}:\n{render_text(cfg, own)}"


def entry_point(
    main: Callable[[Sequence[str]], object], usage: str, argv: Sequence[str] | None = None, command: str = ""
) -> NoReturn:
    """Run a command the way every entry point does: `--help`/`-h` prints `help_text` (the `command`'s
    own sections first), `--cfg` the resolved recipe, both with exit 0; otherwise `main(argv)` under
    run_cli (errors -> exit codes)."""
    from omegaconf import OmegaConf

    from draftsmith.recipe import validated

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        run_cli(
            lambda args: print(help_text(usage, args, COMMAND_SECTIONS.get(command, ()))),
            [arg for arg in argv if arg not in ("--help", "-h")],
        )
    if "--cfg" in argv:  # the arguments the command itself would take, refused as it refuses them
        run_cli(
            lambda args: print(
                OmegaConf.to_yaml(
                    validated(args[1:] if args[:1] in SUBCOMMANDS else args, command or "train"), resolve=True
                ),
                end="",
            ),
            [arg for arg in argv if arg != "--cfg"],
        )
    run_cli(main, argv)


def configure_logging() -> None:
    logging.basicConfig(
        stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )


def main(argv: Sequence[str] | None = None) -> None:
    """The `draftsmith` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        if not argv:  # a usage error: said on stderr too, as every refusal is
            print(f"error: no command given; commands: {', '.join(COMMANDS)} (draftsmith --help)", file=sys.stderr)
            sys.exit(EXIT_USER_ERROR)
        sys.exit(0)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    module, function = COMMANDS[command]
    configure_logging()
    loaded = importlib.import_module(module)
    entry_point(getattr(loaded, function), installed_usage(loaded.__doc__, module, command), rest, command)


def installed_usage(usage: str, module: str, command: str) -> str:
    """A command's usage as the `draftsmith` script runs it: the module's docstring names the checkout's
    form (`python -m export ...`), which an installed package cannot run; one naming both forms is kept."""
    if f"draftsmith {command} " in usage:
        return usage
    checkout = "python -m " + module.removeprefix("draftsmith.").removesuffix(".__main__")
    return usage.replace(f"{checkout} ", f"draftsmith {command} ")
