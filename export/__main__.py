"""`python -m export recipe=NAME checkpoint=DIR [export.engines=[vllm,sglang]] [export.output=DIR] ...`

Without `checkpoint` it is `<output_dir>/final`, what train.py writes (a run's saved recipe exports
the weights the run trained). Prints one line per engine folder written (and pushed).
"""

from __future__ import annotations

from collections.abc import Sequence

from draftsmith.cli import entry_point


def main(argv: Sequence[str]) -> None:
    # imported here, under entry_point's run_cli: Ctrl-C or SIGTERM during their imports (torch's) ends as later
    from draftsmith.recipe import checkpoint_to_read, load_recipe
    from draftsmith.recipe_checks import require_export_settings_read

    cfg = load_recipe(argv, "export")  # checked before the export's modules (torch's: seconds) load
    require_export_settings_read(cfg.export)
    from draftsmith.export.run import export_checkpoint
    from draftsmith.formats.folder import require_weights_as_configured, served_settings

    served = served_settings(argv, cfg)
    require_weights_as_configured(checkpoint_to_read(cfg))
    for engine, folder in export_checkpoint(cfg, checkpoint_to_read(cfg), served=served).items():
        print(f"{engine}: {folder}")


if __name__ == "__main__":
    from draftsmith.cli import configure_logging

    configure_logging()
    entry_point(main, __doc__, command="export")
