"""The training loop on accelerate (trainer/loop.py), its checkpoints and output directory (trainer/checkpoint.py)."""

from draftsmith.trainer.checkpoint import claim_output_dir
from draftsmith.trainer.loop import train

__all__ = ["claim_output_dir", "train"]
