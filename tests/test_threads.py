"""The CPU threads of a training run: chosen by draftsmith/threads.py (train.cpu_threads, else
OMP_NUM_THREADS where it is the user's, else cores / local processes), never a launcher's default of 1."""

from __future__ import annotations

import logging

import pytest
import torch

from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe
from draftsmith.threads import choose_cpu_threads, set_cpu_threads

# What `accelerate launch` puts in the environment of the process it starts (one process, no --cpu).
ACCELERATE_ONE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False", "OMP_NUM_THREADS": "1"}
# ... and of each of two processes (--multi_gpu --num_processes 2, through torchrun's elastic agent).
ACCELERATE_TWO = {**ACCELERATE_ONE, "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none"}
TORCHRUN_TWO = {"LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize(
    ("setting", "env", "cores", "cuda", "threads", "reason"),
    [
        (None, ACCELERATE_ONE, 2, False, 2, "2 cores available / 1 process on this machine; OMP_NUM_THREADS=1 "
         "ignored (accelerate launch's default, or yours: the same): train.cpu_threads=N sets them"),
        (None, ACCELERATE_TWO, 8, False, 4, "8 cores available / 2 processes on this machine"),
        (None, TORCHRUN_TWO, 4, False, 2, "(torchrun's default, or yours: the same)"),
        (None, {**TORCHRUN_TWO, "LOCAL_WORLD_SIZE": "4"}, 2, False, 1, "2 cores available / 4 processes"),
        (3, ACCELERATE_ONE, 2, False, 3, "train.cpu_threads=3"),
        (1, {}, 16, True, 1, "train.cpu_threads=1"),
        (None, {**ACCELERATE_ONE, "OMP_NUM_THREADS": "6"}, 8, False, None, "OMP_NUM_THREADS=6 from the environment"),
        (None, {"OMP_NUM_THREADS": "1"}, 8, False, None, "OMP_NUM_THREADS=1 from the environment"),
        (None, {}, 2, False, 2, "2 cores available / 1 process on this machine"),
        (None, ACCELERATE_ONE, 8, True, None, "a GPU run"),
    ],
    ids=[
        "accelerate-launch",
        "accelerate-two-processes",
        "torchrun",
        "more-processes-than-cores",
        "recipe-key",
        "recipe-key-on-gpu",
        "users-omp-under-accelerate",
        "users-omp-without-launcher",
        "plain-python",
        "gpu",
    ],
)  # fmt: skip
def test_the_threads_are_chosen_by_the_recipe_the_user_or_the_cores(setting, env, cores, cuda, threads, reason):
    choice = choose_cpu_threads(setting, env, cores, cuda)
    assert choice.threads == threads and reason in choice.reason, choice


def test_the_choice_is_applied_and_logged(monkeypatch, caplog):
    before = torch.get_num_threads()
    for name, value in ACCELERATE_ONE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("draftsmith.threads.available_cores", lambda: 1)
    try:
        with caplog.at_level(logging.INFO, logger="draftsmith.train"):
            assert set_cpu_threads(None) == torch.get_num_threads() == 1
            assert "CPU threads: 1 (1 core available / 1 process on this machine; OMP_NUM_THREADS=1" in caplog.text
            assert "oversubscribed" not in caplog.text
            assert set_cpu_threads(2) == torch.get_num_threads() == 2
            assert "CPU threads: 2 (train.cpu_threads=2)" in caplog.text
            # more threads than the cores the run's processes share: said, since each step gets slower
            assert "2 threads x 1 process on this machine's 1 available core: oversubscribed" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_a_bad_setting_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"train\.cpu_threads=0 must be >= 1, or null"):
        load_recipe(["recipe=medusa", "train.cpu_threads=0", f"output_dir={tmp_path}"])
