"""`python -m eval recipe=NAME [drafter.path=CHECKPOINT_DIR] [key=value ...]`

`drafter.path` is not a recipe key (the drafter section belongs to the drafter type's schema), so
it is taken out of the arguments before the recipe is parsed. Without it the checkpoint is
`<output_dir>/final`, where train.py writes it. The report goes to `<output_dir>/eval/`; its
markdown table is printed to stdout.
"""

from __future__ import annotations

from typing import Optional, Sequence

from draftsmith.errors import UserError, run_cli
from draftsmith.recipe import load_recipe

PATH_ARG = "drafter.path="


def split_drafter_path(argv: Sequence[str]) -> tuple[Optional[str], list[str]]:
    paths = [arg[len(PATH_ARG) :] for arg in argv if arg.startswith(PATH_ARG)]
    if len(paths) > 1 or (paths and not paths[0]):
        raise UserError("give drafter.path=<checkpoint dir> once, with a value")
    return (paths[0] if paths else None), [arg for arg in argv if not arg.startswith(PATH_ARG)]


def main(argv: Sequence[str]) -> None:
    import datasets
    import transformers

    from draftsmith.eval.report import render_markdown, run_eval

    # The eval's own progress bar is the one worth watching; weight loading and data set
    # preparation would otherwise print theirs on stderr too.
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    drafter_path, overrides = split_drafter_path(argv)
    report = run_eval(load_recipe(overrides), drafter_path)
    print(render_markdown(report))


if __name__ == "__main__":
    run_cli(main)
