"""The draft-verify loop (chain and tree, greedy and exact sampling), the n-gram baseline and the
per-domain report. `python -m eval recipe=NAME checkpoint=DIR ...`, or `run_eval(cfg)` from train.py.
Never imports `trainer`: it reads drafters through formats/folder.py."""

from draftsmith.eval.loop import Generation, generate
from draftsmith.eval.ngram import NGramDrafter
from draftsmith.eval.report import run_eval
from draftsmith.eval.sampling import Sampling

__all__ = ["Generation", "NGramDrafter", "Sampling", "generate", "run_eval"]
