"""speculators 0.9.0's trainer on a CPU, patched from outside: run by the speculators venv's Python in
place of `speculators train`, with the same arguments (benchmarks/peer_speculators.py starts it).

    <speculators venv>/bin/python benchmarks/speculators_cpu.py --verifier-name-or-path ... [speculators train args]

Its Trainer assumes a CUDA device; the changes, made before its CLI runs, nothing in speculators' files:
1. device: the model and every batch go to `local_rank` (0, a CUDA index); the Trainer's module gets a
   `get_local_rank` that answers "cpu".
2. autocast: `torch.autocast(<accelerator or "cuda">, dtype=--hidden-states-dtype)`; on a machine
   without an accelerator that is CUDA autocast, which cannot run. The Trainer's device type is set
   to "cpu" and its autocast to a no-op: training runs in float32 (--hidden-states-dtype float32).
3. the per-step synchronize: its step timer calls `torch.accelerator.synchronize()`, which has no
   accelerator to wait for; made a no-op.
The arguments the benchmark adds for the same reason (speculators' own options): `--loss-implementation
eager` (the fused loss imports Triton), `--draft-attn-impl sdpa` (its default flex attention compiles
block masks for CUDA), `--num-workers 0`. `--help` prints this, then (in the speculators venv) speculators'
own options; a Python without speculators is told which to use, exit 2.
"""

import contextlib
import importlib.util
import sys
from pathlib import Path

PATCHES = [
    "device: Trainer's local_rank -> 'cpu'",
    "autocast: a no-op (float32)",
    "torch.accelerator.synchronize: a no-op",
]
# Where benchmarks/peer_speculators.py builds the venv (its --speculators-python default)
SPECULATORS_PYTHON = Path.home() / ".cache/draftsmith/engines/speculators-0.9.0/bin/python"


def patched():
    """speculators' train CLI and its config, the Trainer patched for the CPU (PATCHES)."""
    import speculators.train.trainer as trainer_module
    import torch
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    trainer_module.get_local_rank = lambda: "cpu"
    original_init = trainer_module.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer_module.Trainer.__init__ = cpu_init
    trainer_module.torch.autocast = lambda *args, **kwargs: contextlib.nullcontext()
    torch.accelerator.synchronize = lambda *args, **kwargs: None
    return main, TrainConfig


if __name__ == "__main__":
    installed = importlib.util.find_spec("speculators") is not None
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)  # then, where speculators is installed, its own options
        if not installed:
            sys.exit(0)
    if not installed:
        print(
            f"error: {sys.executable} has no speculators: run this with the speculators venv's Python "
            f"({SPECULATORS_PYTHON}, benchmarks/peer_speculators.py --speculators-python)",
            file=sys.stderr,
        )
        sys.exit(2)
    main, TrainConfig = patched()
    main(TrainConfig.resolve())
