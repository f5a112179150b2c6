"""The training stage: the `train` command (trainer/main.py), the loop on accelerate (trainer/loop.py)
and its set-up (trainer/setup.py; what a resume keeps as the run began: trainer/resume_checks.py), its
checkpoints and output directory (trainer/checkpoint.py). Nothing is imported here, so that `train.py --help`
loads no model code."""
