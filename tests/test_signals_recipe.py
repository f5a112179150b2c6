"""SIGTERM wherever a command is, a library call included: the stop passes a library's `except Exception` (it was
caught by the recipe reader's, and a SIGTERM while any command read its recipe said `error: ... not valid YAML`, exit
2), and the preempted line's advice is the command's (a sweep, an export, a monitor were told `train.resume=true`)."""

from __future__ import annotations

import signal

import pytest
import yaml
from omegaconf import OmegaConf

from draftsmith.errors import EXIT_PREEMPTED, Preempted, run_cli
from draftsmith.recipe import file_sections, on_schema, parsed_recipe
from tests.helpers import assert_one_line_error, run_entry_in_process

KEPT = "preempted: stopped on SIGTERM; what was finished is kept: "


@pytest.mark.parametrize(
    "command, reader, advice",
    [
        (["train.py"], "compose", "run the same command with train.resume=true to continue"),
        (["-m", "export"], "load", "run the same command again to continue"),
        (
            ["-m", "monitor", "check"],
            "compose",
            "run the same command again to continue (a retraining it stopped, if any, resumes)",
        ),
    ],
    ids=["train-yaml", "export-omegaconf", "monitor-yaml"],
)
def test_sigterm_while_the_recipe_is_read_is_preempted_with_the_command_s_advice(
    command, reader, advice, tmp_path, monkeypatch, capsys
):
    """The signal lands inside the YAML parser (`compose`: the recipe reader's check for a key given twice; `load`:
    OmegaConf's read of the file), each called under the reader's `except Exception`; nothing is written."""
    real = getattr(yaml, reader)

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # to this thread: its handler runs before the next line
        raise AssertionError("SIGTERM did not stop the read")

    monkeypatch.setattr(yaml, reader, terminated)
    for cached in (parsed_recipe, file_sections, on_schema):  # a recipe is read once a process: this test must read it
        cached.cache_clear()
    output_dir = tmp_path / "run"
    result = run_entry_in_process([*command, "recipe=medusa", f"output_dir={output_dir}"], capsys)
    monkeypatch.setattr(yaml, reader, real)
    line = assert_one_line_error(result, EXIT_PREEMPTED, prefix="preempted: ")
    assert line == KEPT + advice
    assert not output_dir.exists()


def test_sigterm_inside_omegaconf_is_not_wrapped_in_its_error(capsys):
    """OmegaConf re-raises what an Exception raised inside it as its own error (`... full_key: ...`); the stop passes
    it unchanged, and run_cli turns it into the preempted line."""
    cfg = OmegaConf.create({"value": "${terminated:}"})

    def terminated():
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("SIGTERM did not stop the resolver")

    OmegaConf.register_new_resolver("terminated", terminated)
    try:
        with pytest.raises(SystemExit) as stopped:
            run_cli(lambda args: cfg.value, [], "sweep")
    finally:
        OmegaConf.clear_resolver("terminated")
    assert stopped.value.code == EXIT_PREEMPTED
    assert capsys.readouterr().err.splitlines() == [KEPT + "run the same command again to continue"]
    assert not issubclass(Preempted, Exception)


def test_a_stop_while_a_failed_hub_request_is_handled_is_the_stop_not_the_hub(monkeypatch, capsys):
    """A SIGTERM that lands while huggingface_hub handles a request that failed (its cache lookup) has the Hub's miss
    in its context: the line said `Hub unavailable`, exit 69, a retry later, for a job that was asked to stop."""
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # a request was made, and failed

    def stopped_in_the_hub_s_fallback(args):
        try:
            raise LocalEntryNotFoundError("not in the cache") from ConnectionError("no network")
        except LocalEntryNotFoundError:
            signal.raise_signal(signal.SIGTERM)
            raise AssertionError("SIGTERM did not stop the lookup") from None

    with pytest.raises(SystemExit) as stopped:
        run_cli(stopped_in_the_hub_s_fallback, [], "capture")
    assert stopped.value.code == EXIT_PREEMPTED
    assert capsys.readouterr().err.splitlines() == [KEPT + "run the same command again to continue"]
