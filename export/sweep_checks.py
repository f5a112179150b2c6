"""What `draftsmith sweep` (export/sweep.py) refuses before it measures, each in one line (exit 2): an output
folder another stage published, γs beyond what the drafter proposes, suffix decoding asked of an engine that cannot
serve it on the target, and a resume onto rows of another checkpoint or measured with other settings (their summary
would report this run's settings for all)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from draftsmith.errors import UserError
from draftsmith.formats.folder import require_outside_published
from draftsmith.formats.repo import EXPORT_INFO

OUTPUT_KEY = "export.sweep.output"
# a row's load setting (export/sweep.py's Load.settings) -> the recipe key that sets it
LOAD_KEYS = {
    "target": "target.name_or_path",
    "dtype": "target.dtype",
    "new_tokens": "eval.max_new_tokens",
    "requests_per_slot": "export.sweep.requests_per_slot",
    "min_requests": "export.sweep.min_requests",
    "threads": "export.sweep.cpu_threads",
}


def require_own_output(output: Path, checkpoint: Path) -> None:
    """`output` neither in the checkpoint (its files count in the sha256 the rows are matched by) nor in an export's
    engine folder (export/run.py publishes one with its draftsmith_export.json: the rows and the sweep's own export
    would be served and pushed with it), nor an export.output holding such folders."""
    require_outside_published(output, checkpoint, f"{OUTPUT_KEY}={str(output)!r}", "the rows are matched by")
    resolved = output.resolve()
    held = sorted(child for child in resolved.iterdir() if (child / EXPORT_INFO).is_file()) if resolved.is_dir() else []
    if held:
        raise UserError(
            f"{OUTPUT_KEY}={str(output)!r} writes into the export {held[0]} (its {EXPORT_INFO}): the sweep's "
            "rows and its own export would be served and pushed with it; give a folder of its own (unset: "
            "<output_dir>/sweep)"
        )


def require_proposes(gammas: Sequence[int], longest: Optional[int], method: str, checkpoint: Path) -> None:
    """Every γ of the sweep within the checkpoint's longest chain (its own config: a read-only command does not
    hold the recipe's drafter section to the checkpoint's), or the first γ beyond it fails in vLLM only after
    the plain and n-gram levels have run, minutes in."""
    if longest is not None and max(gammas) > longest:
        within = ",".join(map(str, range(1, longest + 1)))
        raise UserError(
            f"export.sweep.gammas={list(gammas)} but the {method} drafter in {checkpoint} proposes at most {longest} "
            f"tokens a step: give γs up to {longest} (export.sweep.gammas=[{within}])"
        )


def varied_drafts(target_config, python: str, settings) -> Optional[str]:
    """Why the vLLM of `python` cannot serve drafts of varying length on this target (None: it can), or the one-line
    refusal of export.sweep.suffix=true there. vLLM's n-gram proposer and suffix decoding draft fewer than γ tokens
    on some steps, and the drafter at γ 0 (a schedule) drafts nothing on every step: some builds serve neither on
    some targets (a crash mid-level, or outputs that are not the target's: formats/versions.py's
    varied_drafts_limit), which is said before anything is served. Asked for by name (`true`: "required", as
    without arctic-inference) suffix decoding is refused; by default those levels are left out and the summary says
    why, as for a baseline the engine failed to serve: the drafter's rows are what the sweep is for."""
    from draftsmith.formats.versions import varied_drafts_limit

    limit = varied_drafts_limit(target_config, python)
    if limit and settings.suffix:
        raise UserError(
            f"export.sweep.suffix=true: {limit}; leave export.sweep.suffix unset (the sweep then leaves it out and "
            "says why) or sweep with a GPU build of vLLM"
        )
    return limit


def require_same_checkpoint(path: Path, rows: list[dict[str, Any]], digest: str) -> None:
    """No drafter rows of another checkpoint in the sweep resumed."""
    others = {row.get("source_sha256") for row in rows if row.get("source_sha256") not in (None, digest)}
    if others:
        raise UserError(
            f"{path} holds a sweep of another checkpoint (sha256 {min(others)[:12]}); "
            f"give this one another {OUTPUT_KEY}"
        )


def require_same_load(path: Path, rows: list[dict[str, Any]], settings: dict[str, Any], vllm_version: str) -> None:
    """The rows resumed measured as this run measures: `settings` (Load.settings) and the vLLM. A row is measured
    once (export/sweep.py's `measure`), so one of other settings would stand in the summary for this run's."""
    again = f"give this sweep another {OUTPUT_KEY}"
    for row in rows:
        if "load" not in row or "vllm_version" not in row.get("engine", {}):  # read_sweep has checked their kinds
            raise UserError(
                f"{path} holds rows that do not record the settings they were measured with (written before "
                f"draftsmith recorded them): {again}"
            )
        if row["engine"]["vllm_version"] != vllm_version:
            raise UserError(
                f"{path} holds rows measured in vLLM {row['engine']['vllm_version']}, and export.vllm_python is vLLM "
                f"{vllm_version}: resume with that vLLM, or {again}"
            )
        for name, value in settings.items():
            # engine arguments not recorded: the sweep passed none before 2026-12-01 (prefix caching at vLLM's default)
            measured = row["load"].get(name, {} if name == "engine_arguments" else None)
            if measured == value or (name == "drafter" and name not in row["load"]):  # not recorded before 2026-12
                continue
            if name == "engine_arguments":
                raise UserError(
                    f"{path} holds rows served with {arguments(measured, value)}: the table would compare rows served "
                    f"both ways; no setting resumes them (the sweep passes these for the target itself): {again}"
                )
            if name == "drafter":
                raise UserError(
                    f"{path} holds rows of the drafter served with {json.dumps(measured)}, and this sweep serves it "
                    f"with {json.dumps(value)}: give those drafter.* settings to resume them, or {again}"
                )
            if name == "prompts_sha256":
                raise UserError(
                    f"{path} holds rows measured on other eval prompts (eval.data or data.eval, eval.max_prompts, "
                    f"data.max_length, the target's tokenizer): resume with those, or {again}"
                )
            key = LOAD_KEYS[name]
            raise UserError(
                f"{path} holds rows measured at {key}={measured}, and this sweep's is {value}: set "
                f"{key}={measured} to resume them, or {again}"
            )


def arguments(measured: dict[str, Any], given: dict[str, Any]) -> str:
    """The engine arguments the rows and this run differ in, each as `KEY=VALUE` or unset (vLLM's default)."""

    def shown(served: dict[str, Any], key: str) -> str:
        return f"{key}={json.dumps(served[key])}" if key in served else f"{key} unset (vLLM's default)"

    keys = sorted(key for key in measured.keys() | given.keys() if measured.get(key, ...) != given.get(key, ...))
    rows, this = (", ".join(shown(served, key) for key in keys) for served in (measured, given))
    return f"{rows}, and this sweep serves this target with {this}"
