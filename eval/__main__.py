"""`python -m eval recipe=NAME [checkpoint=DIR] [key=value ...]`

`checkpoint` is a draftsmith checkpoint or a folder an export wrote; without it the eval reads
`<output_dir>/final`, where train.py writes it (a run's saved recipe evaluates the weights the run
trained). The report goes to `<output_dir>/eval/`; its markdown table is printed to stdout. Exit code
3 when a greedy row failed the lossless check (its tokens differ from plain greedy decoding's): the
report is still written, with the row marked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from draftsmith.cli import entry_point


def main(argv: Sequence[str]) -> None:
    # imported here, under entry_point's run_cli: Ctrl-C or SIGTERM during their imports (torch's) ends as later
    from draftsmith.recipe import checkpoint_to_read, load_recipe

    cfg = load_recipe(argv, "eval")  # checked before the loop's and the libraries' modules (torch's: seconds) load
    from draftsmith.formats.folder import (
        require_outside_published,
        require_target_before_load,
        require_weights_as_configured,
        served_settings,
    )

    served = served_settings(argv, cfg)
    warn_eval_disabled(argv)
    checkpoint = checkpoint_to_read(cfg)
    require_weights_as_configured(checkpoint)
    require_target_before_load(checkpoint, cfg.target)
    report_dir = Path(cfg.output_dir) / "eval"  # export and the monitor would refuse it as of other weights
    named = f"the eval's report folder {report_dir} (output_dir/eval)"
    require_outside_published(report_dir, checkpoint, named, "the report identifies it by", give="an output_dir")
    import datasets
    import transformers

    from draftsmith.eval.render import render_markdown
    from draftsmith.eval.report import require_lossless, run_eval

    # The eval's own progress bar is the one worth watching; weight loading and data set
    # preparation would otherwise print theirs on stderr too.
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    report = run_eval(cfg, served=served)
    print(render_markdown(report))
    require_lossless(report)


def warn_eval_disabled(argv: Sequence[str]) -> None:
    """`eval.enabled=false` on this command's line is read by nothing: it is train's setting (no report after
    training), and the eval command reports regardless. Said, not refused: a shared list of overrides may hold it."""
    import logging

    from draftsmith.recipe_input import parse_overrides, split_argv

    if ("eval.enabled", False) in parse_overrides(split_argv(argv)[1]):
        logging.getLogger("draftsmith.eval").warning(
            "eval.enabled=false: not read: it says whether train reports after training; the eval command reports"
        )


if __name__ == "__main__":
    entry_point(main, __doc__, command="eval")
