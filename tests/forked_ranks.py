"""An entry point run as the ranks of a one-node CPU launch, forked from the test process: each rank runs the script
or module as `__main__` (`run_entry_in_process`) with the variables a launcher gives it (RANK, WORLD_SIZE, MASTER_*:
torch's env:// rendezvous over gloo), sharing the test process's imports. A launched rank imports torch,
transformers, accelerate and draftsmith again (about 6-8 s of CPU a rank, and the launcher's own 3 s): a test that
compares a launch with a reference run of the same entry point launches what it tests and forks the reference."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def _rank(rank: int, world: int, port: int, args: list[str], log: str) -> None:
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from tests.helpers import run_entry_in_process

    with open(log, "w") as out:  # this rank's output, not the test's capture
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
    )  # fmt: skip
    torch.set_num_threads(1)
    assert not torch.distributed.is_initialized()  # forked from a test process that holds no group
    AcceleratorState._reset_state(reset_partial_state=True)  # nor its parent's Accelerator: this rank's own
    GradientState._reset_state()
    sys.exit(run_entry_in_process(args).returncode)


def run_forked_ranks(args: list[str], logs: Path, world: int = 2, timeout: float = 180) -> subprocess.CompletedProcess:
    """`args` as `run_entry_in_process` takes them, on `world` forked ranks; the worst exit code, rank 0's output as
    stdout and every rank's as stderr. A fork copies the locks other threads held: ranks still running after
    `timeout` are killed (exit -9) rather than left to hang the suite."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs.mkdir(parents=True, exist_ok=True)
    paths = [logs / f"rank{rank}.log" for rank in range(world)]
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank, args=(rank, world, port, args, str(paths[rank]))) for rank in range(world)]
    for process in ranks:
        process.start()
    deadline = time.monotonic() + timeout
    for process in ranks:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in ranks:
        if process.is_alive():
            process.kill()
            process.join()
    codes = [process.exitcode for process in ranks]
    texts = [path.read_text() for path in paths]
    code = max(codes, key=abs)
    return subprocess.CompletedProcess(args, code, texts[0], "".join(texts))
