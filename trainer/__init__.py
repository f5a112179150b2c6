"""The training loop on accelerate (trainer/loop.py) and its checkpoints (trainer/checkpoint.py)."""
from trainer.loop import train

__all__ = ["train"]
