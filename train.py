"""Train a drafter: `accelerate launch train.py recipe=medusa [key=value ...]`.

Also runs as `python train.py ...` and `torchrun --nproc-per-node N train.py ...`.
"""
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run from a checkout without installing

from draftsmith.errors import run_cli  # noqa: E402


def main(argv):
    from draftsmith.recipe import load_recipe
    from trainer import train

    cfg = load_recipe(argv)  # validate before any model or data is touched
    train(cfg)


if __name__ == "__main__":
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    run_cli(main)
