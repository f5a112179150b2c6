"""How many threads torch computes with in a training run on CPU, chosen by draftsmith and logged.

A launcher sets OMP_NUM_THREADS for the processes it starts: `accelerate launch` to the value it found
in its own environment, else to 1 (so `accelerate launch train.py` on a CPU machine would run on one
core); torchrun to 1 when it starts several processes. Its 1 cannot be told apart from a 1 the user
exported. So, on a CPU run (no CUDA):

- `train.cpu_threads=N` (the recipe key) is the explicit choice, and always wins;
- otherwise OMP_NUM_THREADS is followed where it must be the user's: without a launcher, or under one
  with a value other than 1;
- otherwise (no OMP_NUM_THREADS, or a launcher's 1): the cores this process may run on
  (`os.sched_getaffinity`) divided by the processes of the run on this machine (LOCAL_WORLD_SIZE, or
  the MPI launchers' local size), at least 1.

A GPU run keeps torch's default. One log line says what was chosen and why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger("draftsmith.train")

# The processes of the run on this machine, as torchrun (and accelerate launch through it) and MPI say.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE")
# Set in every process `accelerate launch` starts, whichever launcher it uses (its default OMP_NUM_THREADS: 1).
ACCELERATE_VARS = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU", "ACCELERATE_DYNAMO_BACKEND")
# Set by torchrun (torch.distributed.run) in its processes (its default OMP_NUM_THREADS with several: 1).
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")


@dataclass
class ThreadChoice:
    threads: Optional[int]  # what to give torch.set_num_threads; None: leave torch's own number
    reason: str  # for the log line


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, which taskset, cgroups' cpusets and
    SLURM narrow), or every core where the platform has no affinity mask."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def local_processes(env: Mapping[str, str]) -> int:
    for name in LOCAL_SIZE_VARS:
        value = env.get(name, "").strip()
        if value.isdigit() and int(value) >= 1:
            return int(value)
    return 1


def launcher(env: Mapping[str, str]) -> Optional[str]:
    """Which launcher started this process, if any."""
    if any(name in env for name in ACCELERATE_VARS):
        return "accelerate launch"
    if any(name in env for name in TORCHRUN_VARS):
        return "torchrun"
    return None


def choose_cpu_threads(setting: Optional[int], env: Mapping[str, str], cores: int, cuda: bool) -> ThreadChoice:
    """The module's rule, over a given environment (`setting`: train.cpu_threads; `cores`: available)."""
    if setting is not None:
        return ThreadChoice(int(setting), f"train.cpu_threads={setting}")
    if cuda:
        return ThreadChoice(None, "a GPU run: torch's default; train.cpu_threads=N sets them")
    omp, started_by = env.get("OMP_NUM_THREADS", "").strip(), launcher(env)
    if omp.isdigit() and int(omp) >= 1 and (started_by is None or omp != "1"):
        return ThreadChoice(None, f"OMP_NUM_THREADS={omp} from the environment; train.cpu_threads=N overrides it")
    local = local_processes(env)
    reason = (
        f"{cores} core{'s' if cores > 1 else ''} available / {local} process{'es' if local > 1 else ''} on this machine"
    )
    if omp:
        # a launcher's default cannot be told from the same value exported by the user
        by = f"{started_by}'s default, or yours: the same" if started_by else "not a number of threads"
        reason += f"; OMP_NUM_THREADS={omp} ignored ({by}): train.cpu_threads=N sets them"
    return ThreadChoice(max(1, cores // local), reason)


def set_cpu_threads(setting: Optional[int]) -> int:
    """Apply the rule to this process (train.cpu_threads = `setting`) and log the choice; returns the
    number of threads torch now uses."""
    import torch

    choice = choose_cpu_threads(setting, os.environ, available_cores(), torch.cuda.is_available())
    if choice.threads is not None:
        torch.set_num_threads(choice.threads)
    threads = torch.get_num_threads()
    log.info("CPU threads: %d (%s)", threads, choice.reason)
    cores, local = available_cores(), local_processes(os.environ)
    if not torch.cuda.is_available() and threads * local > cores:  # they take turns on the cores: slower, not faster
        log.warning(
            "%d threads x %d process%s on this machine's %d available core%s: oversubscribed, each step slower",
            threads, local, "es" if local > 1 else "", cores, "s" if cores > 1 else "",
        )  # fmt: skip
    return threads
