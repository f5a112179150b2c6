"""One command grammar: every entry point answers --help (the recipe keys, with a recipe's values when
recipe=NAME is given) and --cfg (the resolved recipe) with exit 0, without running anything; the
recipe reference in docs/ is generated from the schema and cannot go stale; every key is described."""

from __future__ import annotations

import importlib
import signal
import subprocess
import sys
import time

import pytest
import yaml
from omegaconf import OmegaConf

from draftsmith.cli import COMMAND_SECTIONS, COMMANDS, entry_point
from draftsmith.heads import drafters
from draftsmith.recipe import load_recipe
from draftsmith.recipe_keys import drafter_section, recipe_sections, render_markdown
from tests.helpers import REPO, assert_one_line_error, run_entry_in_process, stops_handled

ENTRIES = {name: (importlib.import_module(module), function) for name, (module, function) in COMMANDS.items()}


def run(command: str, argv: list[str], capsys) -> tuple[int, str, str]:
    module, function = ENTRIES[command]
    with pytest.raises(SystemExit) as exited:
        entry_point(getattr(module, function), module.__doc__, argv, command)
    out, err = capsys.readouterr()
    return exited.value.code, out, err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_answers_help_without_running(command, capsys):
    code, out, _ = run(command, ["--help"], capsys)
    assert code == 0 and "--cfg" in out and "data.max_length (int) = 1024" in out and "give recipe=NAME --help" in out
    own, others = out.split("\nOther sections:\n")  # the command's own sections first
    assert f"\n{COMMAND_SECTIONS[command][-1]}:" in own or f"\n{COMMAND_SECTIONS[command][0]}:" in own
    assert "\nmonitor:" in (own if command == "monitor" else others)
    code, out, _ = run(command, ["recipe=eagle3_sharegpt_smollm2", "-h"], capsys)
    assert code == 0
    assert (
        "data.max_conversations (Optional[int]) = 2400 (default null)" in out
    )  # the recipe's value beside the default
    assert "drafter.ttt_steps (int) = 3 (default 7)" in out  # the recipe's drafter type's keys


def test_a_recipe_whose_package_is_not_installed_is_listed_and_overridable(capsys, tmp_path):
    """A recipe whose target is a package not installed here (as recipe=*_smollm2 without the extra):
    --help lists its keys with that value as written, running it is the one-line error, and overriding
    the target runs it."""
    recipe = (
        (REPO / "recipes" / "medusa.yaml")
        .read_text()
        .replace("${bundled:demo/target}", "${package:no_such_package_here}")
    )
    (tmp_path / "elsewhere.yaml").write_text(recipe)
    args = [f"recipe={tmp_path / 'elsewhere.yaml'}", f"output_dir={tmp_path / 'run'}"]
    code, out, _ = run("train", [*args, "--help"], capsys)
    assert code == 0 and "target.name_or_path (str) = ${package:no_such_package_here}" in out
    code, _, err = run("train", [*args, "--cfg"], capsys)
    assert code == 2 and "'no_such_package_here', which is not installed" in err
    code, out, _ = run("train", [*args, f"target.name_or_path={REPO / 'demo' / 'target'}", "--cfg"], capsys)
    assert code == 0 and yaml.safe_load(out)["target"]["name_or_path"] == str(REPO / "demo" / "target")


def test_cfg_prints_the_resolved_recipe_and_a_bad_one_is_one_line(capsys, tmp_path):
    args = ["recipe=medusa", "train.lr=0.5", f"output_dir={tmp_path}", "checkpoint=/anything"]
    code, out, _ = run("eval", [*args, "--cfg"], capsys)
    assert code == 0 and yaml.safe_load(out) == OmegaConf.to_container(load_recipe(args), resolve=True)
    assert not any(tmp_path.iterdir())  # nothing ran
    code, out, err = run("train", ["recipe=medusa", "train.nope=1", "--cfg"], capsys)
    line = assert_one_line_error(subprocess.CompletedProcess([], code, out, err), 2, alone=True)
    assert line == "error: unknown recipe key 'train.nope' (override train.nope=1)"
    # what the command refuses, --cfg refuses (it printed the recipe without them); monitor's sub-command passes
    for refused in (["train.lr", "1e-3"], ["~train.lr"], ["=5"]):  # `=5` was "a section: set its keys (.drafter, ...)"
        code, out, err = run("train", ["recipe=medusa", *refused, "--cfg"], capsys)
        assert code == 2 and not out and f"argument {refused[0]!r} is not key=value" in err
    code, out, _ = run("monitor", ["check", "recipe=medusa", "--cfg"], capsys)
    assert code == 0 and yaml.safe_load(out)["drafter"]["type"] == "medusa"


@pytest.mark.parametrize("old", ["drafter.path", "monitor.deployed"])
def test_the_keys_that_became_checkpoint_say_so(old, capsys, tmp_path):
    """Three names meant "a checkpoint to read"; the old ones are one line naming the new key, and a
    run's recipe saved by an earlier draftsmith (which wrote them as null) still loads."""
    code, out, err = run("eval", ["recipe=medusa", f"{old}=/a/checkpoint", "--cfg"], capsys)
    line = assert_one_line_error(subprocess.CompletedProcess([], code, out, err), 2, alone=True)
    assert line == f"error: {old} is now the recipe key checkpoint: rename it in the override {old}=..."
    saved = yaml.safe_load(run("train", ["recipe=medusa", "--cfg"], capsys)[1])
    section, key = old.split(".")
    saved.pop("checkpoint")
    saved.setdefault(section, {})[key] = None
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(saved))
    code, out, _ = run("eval", [f"recipe={tmp_path / 'recipe.yaml'}", "--cfg"], capsys)
    assert code == 0 and yaml.safe_load(out)["checkpoint"] is None


def test_train_refuses_checkpoint_and_names_its_start_key(capsys, tmp_path):
    """`checkpoint` is what eval, export and monitor read; a training run starts from train.init_from.
    train with checkpoint= is one line naming that key, before anything is loaded or written."""
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", "checkpoint=/a/drafter"]
    code, out, err = run("train", args, capsys)
    line = assert_one_line_error(subprocess.CompletedProcess([], code, out, err), 2, alone=True)
    assert line.startswith("error: checkpoint=/a/drafter names the drafter eval, export and monitor read")
    assert line.endswith("pass train.init_from=/a/drafter") and not (tmp_path / "run").exists()


def test_every_key_is_described_and_the_reference_is_current():
    sections = [*recipe_sections(), *(drafter_section(kind) for kind in sorted(drafters()))]
    undescribed = [key.name for section in sections for key in section.keys if not key.help]
    assert not undescribed, f"describe these keys with a comment in the schema: {undescribed}"
    assert (REPO / "docs" / "recipe.md").read_text() == render_markdown(), (
        "regenerate: python -m draftsmith.recipe_keys > docs/recipe.md"
    )


def test_the_scripts_answer_help(capsys):
    """The scripts' own `__main__` wiring; what real processes print besides (nothing on import) is
    tests/test_recipes.py's, one process per entry point."""
    for args in (
        ["train.py", "--help"],
        ["-m", "draftsmith", "monitor", "--help"],
        ["-m", "draftsmith.cli", "monitor", "--help"],  # it printed nothing: cli.py had no `__main__` wiring
        ["-m", "data_prep.regenerate", "recipe=medusa", "--help"],
    ):
        done = run_entry_in_process(args, capsys)
        assert done.returncode == 0 and "Recipe keys" in done.stdout and not done.stderr.strip(), (
            args,
            done.stderr[-500:],
        )


@pytest.mark.slow
@pytest.mark.parametrize("args", [["train.py", "--help"], ["-m", "draftsmith", "--help"]])
def test_help_into_a_reader_that_stops_reading_is_not_an_error(tmp_path, args):
    """`train.py --help | head -1`: stdout's reader gone before the help is written (a broken pipe) ends
    the command quietly, exit 0, without the internal-error line and its log file (#62, fault 7); `draftsmith
    --help | head -1` too (it was a BrokenPipeError traceback, exit 1)."""
    import os

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the child writes
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # where an internal error would write its log
    done = subprocess.run([sys.executable, *args], cwd=REPO, stdout=write, stderr=subprocess.PIPE, text=True, env=env)
    os.close(write)
    assert done.returncode == 0 and "internal error" not in done.stderr, done.stderr[-500:]
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_the_recipe_layer_and_a_misspelt_recipes_exit_import_no_torch():
    """draftsmith.recipe imported torch (draftsmith.sharding, .target: about 2 s) before it read anything, so a
    misspelt recipe or override waited for it; torch comes with the drafter's schema, once the recipe is read."""
    code = "import sys, draftsmith.recipe, draftsmith.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "False\n", done.stderr[-2000:]
    code = (
        "import atexit, runpy, sys; atexit.register(lambda: print('torch' in sys.modules)); "
        "sys.argv = ['train.py', 'recipe=medusaa']; runpy.run_path('train.py', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert_one_line_error(done, 2, "error: recipe 'medusaa' not found", alone=True)
    assert done.stdout == "False\n"
    # every command's bad setting, refused before the command's module loads (capture's, regenerate's and sweep's
    # modules import torch at their top: their line came 2.4 s late)
    bad = {"train": "train.micro_batch_size=0", "eval": "eval.top_k=-1", "capture": "data.capture.shard_tokens=0",
           "regenerate": "data.regenerate.max_new_tokens=0", "export": "export.tolerance=-1",
           "sweep": "export.tolerance=-1", "monitor": "monitor.min_drafts=0"}  # fmt: skip
    assert set(bad) == set(COMMANDS)
    runs = [[command, *(["check"] if command == "monitor" else []), "recipe=medusa", setting, "output_dir=/nonexistent"]
            for command, setting in bad.items()]  # fmt: skip
    code = (
        "import sys\nfrom draftsmith.cli import main\n"
        f"for args in {runs!r}:\n"
        "    try:\n        main(args)\n"
        "    except SystemExit as end:\n        print(args[0], end.code, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.stdout.splitlines() == [f"{command} 2 False" for command in bad], done.stderr[-2000:]
    lines = done.stderr.splitlines()  # one line each, naming the setting
    assert len(lines) == len(bad) and all(
        line.startswith("error: ") and setting.split("=")[0].split(".")[-1] in line
        for line, setting in zip(lines, bad.values())
    ), done.stderr


def test_a_missing_warm_start_is_refused_before_anything_loads(capsys, tmp_path):
    args = ["recipe=medusa", f"output_dir={tmp_path / 'run'}", f"train.init_from={tmp_path / 'no_such_run'}"]
    code, out, err = run("train", args, capsys)
    line = assert_one_line_error(subprocess.CompletedProcess([], code, out, err), 2, alone=True)
    assert line.startswith(f"error: train.init_from={tmp_path / 'no_such_run'} does not exist: give a drafter")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_installed_command_help_names_itself(command, capsys):
    """`draftsmith export --help` showed `python -m export ...`, a form only a checkout runs."""
    from draftsmith.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    usage = capsys.readouterr().out.split("\n\nOptions:")[0]
    assert exited.value.code == 0 and f"draftsmith {command} " in usage
    assert "python -m " not in usage.split("\n")[0]


def test_a_command_that_reads_a_checkpoint_does_not_check_the_recipes_drafter_against_the_target(tmp_path, capsys):
    """A hand-written recipe naming the kind only (`drafter: {type: eagle3}`) was refused by eval, export, sweep and
    monitor on EAGLE-3's default aux layers, which the demo's 4-layer target lacks; those commands read the
    checkpoint's settings. train, and a monitor that retrains, build a drafter from the section: refused."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        yaml.safe_dump({"drafter": {"type": "eagle3"}, "target": {"name_or_path": str(REPO / "demo" / "target")}})
    )
    args = [f"recipe={recipe}", f"output_dir={tmp_path / 'run'}", "--cfg"]
    reading = (("eval", []), ("export", []), ("sweep", []), ("monitor", ["check", "monitor.retrain=false"]))
    for command, extra in reading:
        code, out, err = run(command, [*extra, *args], capsys)
        assert code == 0 and "type: eagle3" in out, (command, err)
    for command, extra in (("train", []), ("monitor", ["check"])):
        code, _, err = run(command, [*extra, *args], capsys)
        assert code == 2 and "EAGLE-3's default aux layers" in err, command
    code, _, err = run("eval", [*args, f"target.name_or_path={tmp_path / 'nope'}"], capsys)  # still checked
    assert code == 2 and "no such folder" in err
    assert not (tmp_path / "run").exists()


def test_a_read_only_command_checks_the_eval_chain_against_the_checkpoints_own_settings(tmp_path, capsys):
    """A 2-head Medusa checkpoint proposes 2 tokens whatever the recipe's num_heads: γ 3 refused from its config,
    naming its kind; a checkpoint of another kind than the recipe's is left to the command, which names both."""
    from draftsmith.target import load_target
    from tests.helpers import KINDS, REFERENCE_TARGET, save_drafter

    target = load_target(str(REFERENCE_TARGET))
    checkpoint = save_drafter("medusa", target, tmp_path / "ckpt", num_heads=2, **{"eval.num_speculative_tokens": 2})
    args = [f"checkpoint={checkpoint}", f"output_dir={tmp_path / 'run'}", "eval.num_speculative_tokens=3", "--cfg"]
    code, _, err = run("eval", [f"recipe={KINDS['medusa']}", "eval.tree=0", *args], capsys)
    assert code == 2 and "eval.num_speculative_tokens=3 but a medusa drafter with this config proposes at most 2" in err
    code, _, err = run("eval", [f"recipe={KINDS['eagle3']}", *args], capsys)
    assert code == 0, err


def test_a_recipe_file_without_output_dir_takes_it_from_the_command_line(tmp_path, capsys):
    """output_dir, required and left out of a hand-written recipe, was refused as an unknown key when given."""
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(
        yaml.safe_dump({"drafter": {"type": "medusa"}, "target": {"name_or_path": str(REPO / "demo" / "target")}})
    )
    code, out, err = run("train", [f"recipe={recipe}", f"output_dir={tmp_path / 'run'}", "--cfg"], capsys)
    assert code == 0 and f"output_dir: {tmp_path / 'run'}" in out, err


@pytest.mark.slow
@pytest.mark.parametrize(
    "signum, code, line", [(signal.SIGTERM, 75, "preempted: stopped on SIGTERM"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stop_while_the_command_loads_is_its_one_line(tmp_path, signum, code, line):
    """`draftsmith eval` stopped as soon as it handles SIGTERM, while it checks its recipe or imports its modules
    (torch: seconds): a SIGTERM killed it (-15, 143 in a shell) and a Ctrl-C printed a KeyboardInterrupt traceback;
    now each is its line and exit code, as later in the run. An import stopped finishes first (a stop raised inside it
    was swallowed by a library's `except Exception`, or left numpy half-imported:
    tests/test_signals_start.py). Where the stop lands decides the rest of the line."""
    output_dir = tmp_path / "run"
    command = [sys.executable, "-m", "draftsmith", "eval", "recipe=medusa", f"output_dir={output_dir}"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not stops_handled(process.pid) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert_one_line_error(
        subprocess.CompletedProcess(command, process.returncode, out, err), code, prefix=line, alone=True
    )
    assert not output_dir.exists()


def test_a_ctrl_c_while_the_stop_handlers_go_in_is_its_one_line(monkeypatch, capsys):
    """Python's own Ctrl-C handler raises wherever the command is; landing while run_cli put its handlers in (CI
    caught it once: the wait above ends once SIGTERM is handled), it was a KeyboardInterrupt traceback (-2)."""
    from draftsmith.errors import EXIT_INTERRUPTED, run_cli

    def ctrl_c_lands(signum):
        raise KeyboardInterrupt

    interrupt = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(signal, "getsignal", ctrl_c_lands)
    try:
        with pytest.raises(SystemExit) as exited:
            run_cli(lambda args: pytest.fail("the command ran"), [])
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert exited.value.code == EXIT_INTERRUPTED and capsys.readouterr().err == "interrupted\n"


def test_version_prints_the_installed_version(capsys):
    """`draftsmith --version` was `unknown command '--version'`, exit 2."""
    from importlib.metadata import version

    from draftsmith.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"draftsmith {version('draftsmith')}\n"


def test_a_command_with_an_output_argument_prints_its_recipe_and_names_itself_as_run(tmp_path, capsys):
    """`python -m data_prep.speculators_features OUTPUT recipe=eagle3 --cfg` refused OUTPUT (`is not key=value`);
    run by its installed name, its usage line named the checkout's form, which an installed package cannot run."""
    output = tmp_path / "features"
    done = run_entry_in_process(["-m", "data_prep.speculators_features", str(output), "recipe=eagle3", "--cfg"], capsys)
    assert done.returncode == 0 and yaml.safe_load(done.stdout)["drafter"]["type"] == "eagle3", done.stderr[-500:]
    assert not output.exists()
    done = run_entry_in_process(
        ["-m", "data_prep.speculators_features", str(output), "recipe=eagle3", "bogus", "--cfg"], capsys
    )
    assert_one_line_error(done, 2, "argument 'bogus' is not key=value")
    done = run_entry_in_process(["-m", "data_prep.speculators_features", "", "recipe=eagle3"], capsys)
    assert_one_line_error(done, 2, "OUTPUT is empty: give the folder to write the features to")  # it wrote into .
    done = run_entry_in_process(["-m", "draftsmith.data_prep.speculators_features", "recipe=eagle3"], capsys)
    assert_one_line_error(done, 2, "usage: python -m draftsmith.data_prep.speculators_features OUTPUT recipe=NAME")
    done = run_entry_in_process(["-m", "draftsmith.data_prep.speculators_features", "--help"], capsys)
    assert done.returncode == 0 and "    python -m draftsmith.data_prep.speculators_features OUTPUT" in done.stdout


def test_deepspeeds_line_that_it_found_no_gpu_is_not_said_and_its_other_records_are(caplog):
    """DeepSpeed's import says "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to
    detect it." on every command that loads a model on a machine without a GPU: the run asked for, not a fault."""
    import logging

    from draftsmith.cli import configure_logging

    configure_logging()
    deepspeed = logging.getLogger("DeepSpeed")
    with caplog.at_level(logging.INFO), caplog.at_level(logging.INFO, logger="DeepSpeed"):  # as its import sets it
        deepspeed.info("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
        deepspeed.info("DeepSpeed info: version=0.18.0")
    assert [record.getMessage() for record in caplog.records] == ["DeepSpeed info: version=0.18.0"]


@pytest.mark.slow
def test_a_folders_files_not_read_are_said_once_a_run(tmp_path, small_data, token_cache, capsys):
    """A run reads data.train for several purposes (its rows, the eval prompts' overlap): the warning naming a
    folder's files not read was said five times in one run."""
    import shutil

    from tests.helpers import train_args

    folder = tmp_path / "chats"
    folder.mkdir()
    shutil.copy(small_data["train"], folder / "train.jsonl")
    (folder / "README.txt").write_text("not data")
    args = train_args(tmp_path / "run", small_data, token_cache, "train.max_steps=1", f"data.train=[{folder}]")
    done = run_entry_in_process(["train.py", *args], capsys)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("1 file(s) not read, their suffix not") == 1


def test_cfg_under_a_launcher_prints_the_recipe_once(monkeypatch, capsys):
    """`accelerate launch --num_processes 8 train.py ... --cfg` printed eight copies: rank 0's alone now, every rank
    still refusing a bad recipe."""
    monkeypatch.setenv("RANK", "1")
    done = run_entry_in_process(["train.py", "recipe=medusa", "--cfg"], capsys)
    assert (done.returncode, done.stdout) == (0, "")
    assert_one_line_error(run_entry_in_process(["train.py", "recipe=medusaa", "--cfg"], capsys), 2)
    monkeypatch.setenv("RANK", "0")
    done = run_entry_in_process(["train.py", "recipe=medusa", "--cfg"], capsys)
    assert done.returncode == 0 and yaml.safe_load(done.stdout)["drafter"]["type"] == "medusa"
