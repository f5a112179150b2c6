"""The draft-verify loop (chain and tree, greedy and exact sampling: eval/loop.py), the n-gram and suffix
baselines and the per-domain report (eval/report.py). `draftsmith eval recipe=NAME checkpoint=DIR ...`,
or `run_eval(cfg)` after training. Never imports `trainer`: it reads drafters through formats/folder.py.
Nothing is imported here, so that `draftsmith eval` checks its recipe before the loop's modules load."""
