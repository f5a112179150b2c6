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
the resolved recipe and exit without running); `draftsmith --version` prints the installed version.
`checkpoint=DIR` names the drafter a read-only command reads: eval and export read it (without it,
`<output_dir>/final`), monitor watches it; train refuses it and starts from `train.init_from=DIR` (a
warm start).

Exit codes (one line on stderr; docs/faults.md): 0 done, 2 bad input, 3 a lossless or export check
failed, 4 training diverged, 69 an engine or the Hugging Face Hub the job needs is down (retry), 70 a
draftsmith bug (the traceback in a log file, or on stderr with DRAFTSMITH_DEBUG=1), 71 out of memory, 74 a full disk or
I/O error, 75 stopped on SIGTERM (requeue; training saves a checkpoint first: train.resume=true), 130
interrupted with Ctrl-C; `monitor check` adds its outcomes 10, 11, 12, 13.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

from draftsmith.errors import EXIT_USER_ERROR, Preempted, UserError, run_cli

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


LOG_FORMAT, LOG_DATE_FORMAT = "%(asctime)s %(name)s: %(message)s", "%H:%M:%S"  # every command's log line, on stderr

STOPS = (signal.SIGINT, signal.SIGTERM)  # the signals that stop a command (draftsmith.errors.run_cli)

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
    from draftsmith.recipe import compose
    from draftsmith.recipe_input import split_argv
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
    main: Callable[[Sequence[str]], object],
    usage: str,
    argv: Sequence[str] | None = None,
    command: str = "",
    positional: int = 0,
) -> NoReturn:
    """Run a command the way every entry point does: `--help`/`-h` prints `help_text` (the `command`'s
    own sections first), `--cfg` the resolved recipe, both with exit 0; otherwise `main(argv)` under
    run_cli (errors -> exit codes, the lines' advice the `command`'s). `positional`: how many arguments
    before the recipe's the command takes (data_prep.speculators_features' OUTPUT), left out of the recipe
    `--cfg` resolves."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = invoked_usage(usage)
    if "--help" in argv or "-h" in argv:
        run_cli(
            lambda args: print(help_text(usage, args, COMMAND_SECTIONS.get(command, ()))),
            [arg for arg in argv if arg not in ("--help", "-h")],
        )
    if "--cfg" in argv:  # the arguments the command itself would take, refused as it refuses them

        def print_resolved(args: Sequence[str]) -> None:
            resolved = resolved_yaml(recipe_part(args, positional), command)  # every rank refuses a bad recipe
            if os.environ.get("RANK", "0") == "0":  # once under a launcher (accelerate launch, torchrun)
                print(resolved, end="")

        run_cli(print_resolved, [arg for arg in argv if arg != "--cfg"])
    stop_with_the_launcher()
    run_cli(main, argv, command)


PR_SET_PDEATHSIG = 1  # prctl(2)'s option: the signal the kernel sends a process when its parent dies


def stop_with_the_launcher() -> None:
    """A rank that torch-elastic started (`accelerate launch --multi_gpu`, `torchrun`) is sent SIGTERM by the kernel
    when its launcher dies, which stops it as a scheduler's SIGTERM does (training: a checkpoint, exit 75).
    torch-elastic starts each rank in a session of its own, so a launcher killed with its process group (`kill -9`,
    a scheduler's) left the ranks training, holding output_dir, and the requeued run was refused. Linux only; the
    launcher starts its ranks from its main thread, whose end is what the kernel signals."""
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def run_module(module: str, usage: str, command: str = "", positional: int = 0) -> NoReturn:
    """`python -m` of a command module whose imports take seconds (torch's), called from its `__main__` block at its
    top, before them: its `main` runs in the module imported anew by its installed name `module`, under
    `entry_point`'s run_cli, so Ctrl-C and SIGTERM have their handlers from the start (nothing below that block runs in
    the `__main__` copy); its recipe is validated before those imports (`refuse_bad_settings_first`)."""
    configure_logging()

    def main(argv: Sequence[str]) -> None:
        refuse_bad_settings_first(argv, command, positional)
        importlib.import_module(module).main(argv)

    entry_point(main, usage, command=command, positional=positional)


def refuse_bad_settings_first(argv: Sequence[str], command: str, positional: int = 0) -> None:
    """The recipe `argv` gives validated as the `command` validates it (what `--cfg` prints), before the command's
    module and its imports (torch's: seconds) load: bad settings are one line at once, not seconds later. Without
    recipe arguments, or asked for `--help`/`--cfg`, the command itself says what it lacks, as monitor does of a
    sub-command it does not have."""
    if command == "monitor" and list(argv[:1]) not in SUBCOMMANDS:
        return
    args = recipe_part(argv, positional)
    if args and not {"--help", "-h", "--cfg"} & set(args):
        from draftsmith.recipe import validated

        validated(args, command or "train")


def resolved_yaml(args: Sequence[str], command: str) -> str:
    """`--cfg`'s output: the recipe `args` resolve to, as `command` validates it. Its modules are imported here, under
    run_cli, as every command's are: Ctrl-C or SIGTERM meanwhile ends with its line."""
    from omegaconf import OmegaConf

    from draftsmith.recipe import validated

    return OmegaConf.to_yaml(validated(args, command or "train"), resolve=True)


def recipe_part(argv: Sequence[str], positional: int = 0) -> list[str]:
    """A command's arguments without those before the recipe's: monitor's sub-command, and the first
    `positional` arguments that are not key=value (a missing one is the command's to refuse)."""
    args = list(argv[1:] if argv[:1] in SUBCOMMANDS else argv)
    leading = 0
    while leading < min(positional, len(args)) and "=" not in args[leading] and not args[leading].startswith("-"):
        leading += 1
    return args[leading:]


def invoked_usage(usage: str) -> str:
    """A module's usage as it was run: its docstring names the checkout's form (`python -m
    data_prep.capture ...`), which a module run by its installed name (`python -m draftsmith.data_prep.capture`)
    replaces; a script or the `draftsmith` command leaves it as it is (`installed_usage`)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    invoked = spec.name.removesuffix(".__main__") if spec is not None else ""
    checkout = invoked.removeprefix("draftsmith.")
    if not invoked or checkout == invoked:
        return usage
    return usage.replace(f"python -m {checkout} ", f"python -m {invoked} ")


def configure_logging() -> None:
    if not sys.stderr.isatty():  # a log file: datasets' and the Hub's bars redraw on one line (draftsmith/progress.py)
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # stderr: stdout holds a command's printed result alone, for `P=$(draftsmith export ...)`
    to_stderr = logging.StreamHandler(sys.stderr)
    to_stderr.addFilter(DATA_LINES_SAID)
    logging.basicConfig(handlers=[to_stderr], level=logging.INFO, format=LOG_FORMAT, datefmt=LOG_DATE_FORMAT)
    # DeepSpeed logs to stdout, through a handler its import adds to its own logger (which transformers imports as it
    # loads a model; on a machine without a GPU its first record is a warning): a filter on that logger, which the
    # import keeps, hands its records to stderr's handlers instead
    logging.getLogger("DeepSpeed").addFilter(on_stderr)


class SaidOnce(logging.Filter):
    """A handler filter: a data stage's information or warning line said already (`forget` clears them) is not said
    again. One run reads a file once per purpose (the training set, the held-out rows, the eval's prompts and their
    overlap with the training set), and each read would say the same "loaded 8 conversations from ..." (and a
    folder's files not read, five times). Errors always pass; so does every record handled by another handler,
    pytest's caplog's among them."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != DATA_LOGGER or record.levelno > logging.WARNING:
            return True
        line = record.getMessage()
        if line in self.said:
            return False
        self.said.add(line)
        return True

    def forget(self) -> None:
        self.said.clear()


DATA_LOGGER = "draftsmith.data"
DATA_LINES_SAID = SaidOnce()  # one per process: the stderr handler's (configure_logging)


def on_stderr(record: logging.LogRecord) -> bool:
    """A logger filter: the record handled by the root logger's handlers (stderr), not by its logger's own. DeepSpeed's
    import on a machine without a GPU says it "was unable to detect" one on every command that loads a model: the
    CPU run draftsmith was asked for, not a fault, so it is not said."""
    if record.getMessage().startswith("Setting accelerator to CPU"):
        return False
    for handler in logging.getLogger().handlers:
        if record.levelno >= handler.level:
            handler.handle(record)
    return False


def main(argv: Sequence[str] | None = None) -> NoReturn:
    """The `draftsmith` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"], ["help"]):  # run_cli: a reader that stops reading (`| head -1`) ends it quietly
        run_cli(lambda args: print(__doc__), [])
    if argv[:1] == ["--version"]:
        from importlib.metadata import version  # here: every command's start, before run_cli, is kept short

        run_cli(lambda args: print(f"draftsmith {version('draftsmith')}"), [])
    if not argv:  # a usage error: said on stderr too, as every refusal is
        print(__doc__)
        print(f"error: no command given; commands: {', '.join(COMMANDS)} (draftsmith --help)", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    configure_logging()
    # The command's module imports torch, which takes seconds: under run_cli, so that Ctrl-C or SIGTERM meanwhile
    # ends the command as it would later (one line, 130 or 75), not with a traceback or a kill.
    run_cli(lambda args: run_command(command, args), rest, command)


def run_command(command: str, argv: Sequence[str]) -> NoReturn:
    """Import the `command`'s module and run it through `entry_point`."""
    module, function = COMMANDS[command]
    refuse_bad_settings_first(argv, command)
    with signals_held() as held:
        loaded = importlib.import_module(module)
    if signal.SIGINT in held:
        raise KeyboardInterrupt
    if signal.SIGTERM in held:
        raise Preempted(f"stopped on SIGTERM before {command} started; nothing was written: run the same command again")
    entry_point(getattr(loaded, function), installed_usage(loaded.__doc__, module, command), argv, command)


@contextmanager
def signals_held() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM while inside: noted in the list yielded, for the caller to act on after. Raised inside
    an import (torch's: seconds), the stop could be swallowed by a library's `except Exception` around an
    optional import, or leave a module half-initialised for the next import to fail on."""
    held: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: held.append(signum)) for signum in STOPS}
    try:
        yield held
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def installed_usage(usage: str, module: str, command: str) -> str:
    """A command's usage as the `draftsmith` script runs it: the module's docstring names the checkout's
    form (`python -m export ...`), which an installed package cannot run; one naming both forms is kept."""
    if f"draftsmith {command} " in usage:
        return usage
    checkout = "python -m " + module.removeprefix("draftsmith.").removesuffix(".__main__")
    return usage.replace(f"{checkout} ", f"draftsmith {command} ")


class OneLineArguments(argparse.ArgumentParser):
    """argparse's refusals as every command's: one line, exit 2 (its usage block is --help's)."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} ({self.prog} --help lists the arguments)")


if __name__ == "__main__":  # `python -m draftsmith.cli COMMAND ...` runs as `python -m draftsmith COMMAND ...` does
    main()
