"""Acceptance drift of a deployed drafter, and the retraining that answers it.

    python -m monitor check recipe=NAME checkpoint=EXPORT/vllm monitor.metrics=[http://host:8000/metrics] \\
        monitor.traffic=LOGS
    python -m monitor watch recipe=NAME ...          (checks every monitor.interval_s seconds)

A check reads the engine's speculative-decoding counters (monitor/metrics.py) and evaluates the
deployed drafter on a sample of recent traffic (monitor/traffic.py), tests both against the baseline
recorded with the deployed export (monitor/drift.py), and on a persistent drift runs the retraining
pipeline (monitor/pipeline.py); an engine other than the one the export was checked in is no drift
but a reason to check the export in it (REVERIFY). monitor/check.py ties them together,
monitor/deployed.py says which drafter a check watches (the state directory is that drafter's alone),
monitor/reverify.py compares the engine's version with the export's and says what to run, monitor/state.py
keeps the one state file.
"""

from __future__ import annotations

from enum import IntEnum


class Outcome(IntEnum):
    """A check's result, as its exit code (cron, systemd and Kubernetes act on it)."""

    HEALTHY = 0  # no drift (or too little data to tell): nothing to do
    DRIFT = 10  # drift measured, no retraining now (hysteresis, cooldown, or monitor.retrain=false)
    REJECTED = 11  # retrained; the new drafter did not pass the gate: the deployed one stays
    PROMOTED = 12  # retrained and exported: deploy the new export (state.json's deployed.export)
    REVERIFY = 13  # the engine is not the one the export was checked in: check the export in it (no drift judged)


__all__ = ["Outcome"]
