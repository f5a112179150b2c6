"""Train a drafter: `accelerate launch train.py recipe=medusa [key=value ...]`.

Also runs as `python train.py ...`, `torchrun --nproc-per-node N train.py ...` and, installed,
`draftsmith train ...` (see draftsmith/cli.py).
"""

from draftsmith.cli import TRAIN_USAGE, configure_logging, entry_point, train_main

if __name__ == "__main__":
    configure_logging()
    entry_point(train_main, TRAIN_USAGE, command="train")
