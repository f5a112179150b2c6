"""`python -m export recipe=NAME checkpoint=DIR [export.engines=[vllm,sglang]] [export.output=DIR] ...`

Without `checkpoint` it is `<output_dir>/final`, what train.py writes (a run's saved recipe exports
the weights the run trained). Prints one line per engine folder written (and pushed).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from draftsmith.cli import entry_point


def main(argv: Sequence[str]) -> None:
    # imported here, under entry_point's run_cli: Ctrl-C or SIGTERM during their imports (torch's) ends as later
    from draftsmith.recipe import checkpoint_to_read, load_recipe
    from draftsmith.recipe_checks import require_export_settings_read

    cfg = load_recipe(argv, "export")  # checked before the export's modules (torch's: seconds) load
    require_export_settings_read(cfg.export)
    from draftsmith.export.run import export_checkpoint
    from draftsmith.formats.folder import require_target_before_load, require_weights_as_configured, served_settings

    served = served_settings(argv, cfg)
    require_weights_as_configured(checkpoint_to_read(cfg))
    require_target_before_load(checkpoint_to_read(cfg), cfg.target)
    for engine, folder in export_checkpoint(cfg, checkpoint_to_read(cfg), served=served).items():
        print(f"{engine}: {folder}")
        print(f"{engine}: {engine_check_line(folder, engine)}", file=sys.stderr)  # stdout holds the folders alone


def engine_check_line(folder, engine: str = "vllm") -> str:
    """What the folder's engine check measured (its draftsmith_export.json `verified`), or why none ran: the export's
    output named the folders alone, whether or not the engine had served the drafter."""
    from draftsmith.files import read_json
    from draftsmith.formats.repo import EXPORT_INFO

    checked = read_json(folder / EXPORT_INFO).get("verified")
    if not checked and engine != "vllm":  # the line blamed an unset export.vllm_python that was set
        return f"not checked in an engine ({engine} does not run here: its format is checked against its source)"
    if not checked:
        return "not checked in an engine (export.vllm_python unset)"
    said = "engine engine_version prompts lossless tau_engine tau_draftsmith relative_difference tolerance".split()
    if any(checked.get(key) is None for key in said):
        return f"checked in an engine: {folder / EXPORT_INFO} says what it measured"
    # a check that passed with outputs parting at bfloat16 near ties (`verified.partings`; a check in float32 has
    # none) was said "NOT lossless" though it passed: its card says "yes but N bfloat16 near-tie flip(s)"
    ties = len(checked.get("partings") or [])
    flips = f"lossless but for {ties} bfloat16 near-tie flip(s), which the check allows" if ties else "NOT lossless"
    lossless = "lossless" if checked["lossless"] else flips
    return (
        f"checked in {checked['engine']} {checked['engine_version']} on {checked['prompts']} prompts: "
        f"{lossless}, τ {checked['tau_engine']:.3f} "
        f"against draftsmith's {checked['tau_draftsmith']:.3f} ({checked['relative_difference']:+.1%}, tolerance "
        f"{checked['tolerance']:.0%})"
    )


if __name__ == "__main__":
    from draftsmith.cli import configure_logging

    configure_logging()
    entry_point(main, __doc__, command="export")
