"""`python -m export recipe=NAME drafter.path=CHECKPOINT [export.engines=[vllm,sglang]] [export.output=DIR] ...`

Without drafter.path the checkpoint is `<output_dir>/final` (what train.py writes). Prints one line
per engine folder written (and pushed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from draftsmith.cli import entry_point, split_drafter_path
from draftsmith.recipe import load_recipe


def main(argv: Sequence[str]) -> None:
    from draftsmith.export import export_checkpoint

    drafter_path, overrides = split_drafter_path(argv)
    cfg = load_recipe(overrides)
    checkpoint = Path(drafter_path) if drafter_path else Path(cfg.output_dir) / "final"
    for engine, folder in export_checkpoint(cfg, checkpoint).items():
        print(f"{engine}: {folder}")


if __name__ == "__main__":
    from draftsmith.cli import configure_logging

    configure_logging()
    entry_point(main, __doc__, command="export")
