"""A training run whose eval stage has no prompts is refused before anything is loaded or written, not after
the run has trained."""

from __future__ import annotations

import subprocess

import pytest

from draftsmith.cli import entry_point
from draftsmith.trainer import main as train_command
from tests.helpers import assert_one_line_error


def test_train_with_the_eval_stage_and_no_eval_data_is_refused_before_training(tmp_path, capsys):
    args = [
        "recipe=medusa",
        "data.train=[/nowhere/train.jsonl]",
        "data.eval=[]",
        "eval.data=[]",
        f"output_dir={tmp_path}/run",
    ]
    with pytest.raises(SystemExit) as exited:
        entry_point(train_command.main, train_command.__doc__, args, "train")
    _, err = capsys.readouterr()
    line = assert_one_line_error(subprocess.CompletedProcess(args, exited.value.code, "", err), 2, alone=True)
    assert line.startswith("error: no eval data: eval.enabled=true reports on eval.data or data.eval after training")
    assert not (tmp_path / "run").exists()
    # without the eval stage, the same recipe goes on to its data (whose missing file is its own line)
    with pytest.raises(SystemExit) as exited:
        entry_point(train_command.main, train_command.__doc__, [*args, "eval.enabled=false"], "train")
    assert "no eval data" not in capsys.readouterr().err
