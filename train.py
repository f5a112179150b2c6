"""Train a drafter: `accelerate launch train.py recipe=medusa [key=value ...]`.

Also runs as `python train.py ...`, `torchrun --nproc-per-node N train.py ...` and, installed,
`draftsmith train ...` (see draftsmith/cli.py).
"""

from draftsmith.cli import configure_logging, entry_point
from draftsmith.trainer import main as train_command

if __name__ == "__main__":
    configure_logging()
    entry_point(train_command.main, train_command.__doc__, command="train")
