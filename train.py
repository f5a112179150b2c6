"""Train a drafter: `accelerate launch train.py recipe=medusa [key=value ...]`.

Also runs as `python train.py ...`, `torchrun --nproc-per-node N train.py ...` and, installed,
`draftsmith train ...` (see draftsmith/cli.py).
"""

from draftsmith.cli import configure_logging, train_main
from draftsmith.errors import run_cli

if __name__ == "__main__":
    configure_logging()
    run_cli(train_main)
