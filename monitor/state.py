"""The monitor's one state file, `<state_dir>/state.json` (written atomically): the drafter it monitors,
the deployed export and its baseline, the last scrape's counters (where the next window starts), the
drift streak, the cooldown, the retraining in progress (its completed steps, so a killed run resumes),
and every revision promoted so far."""

from __future__ import annotations

import datetime
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from draftsmith.errors import UserError
from draftsmith.files import read_json, write_text_atomic

STATE_NAME = "state.json"
STATE_VERSION = 1
EARLIER_OUTPUTS = ("retrain", "exports")  # what a retraining writes beside the state, numbered by it
START_OVER = "to start over, give another monitor.state_dir (or move this one aside)"


@dataclass
class State:
    deployed: Optional[dict[str, Any]] = None  # {"export": folder, "revision": n, "baseline": report path, ...}
    # the drafter the monitoring started with, {"export", "sha256"}: the state is its and its revisions' only
    first_deployed: Optional[dict[str, Any]] = None
    counters: Optional[dict[str, float]] = None  # the last scrape, by series
    checks: int = 0
    consecutive_drift: int = 0
    cooldown_until: float = 0.0
    last_check: Optional[dict[str, Any]] = None  # {"time", "record", "outcome", "action", "verdict"}
    last_retrain: Optional[dict[str, Any]] = None
    # the retraining in progress: {"id", "drift" (the figures that started it), "domains", "done": {step: result}}
    pipeline: Optional[dict[str, Any]] = None
    revisions: list[dict[str, Any]] = field(default_factory=list)
    # after a promotion, until vLLM's counters show the redeploy (monitor/redeploy.py): {"revision", "export",
    # "promoted", "restarted": the URLs that serve it}; nothing is judged meanwhile
    awaiting_redeploy: Optional[dict[str, Any]] = None
    # Unix time: the requests logged before it were served by a replaced drafter and are not judged
    judged_since: float = 0.0

    @classmethod
    def load(cls, directory: Path) -> State:
        """The state in `directory`; a new one where it holds none. A state directory whose earlier checks are there
        without their state is refused: a new state would number its checks and retrainings from 1 again, over the
        earlier ones' records, traffic samples and retraining runs."""
        path = directory / STATE_NAME
        if path.exists() and not path.is_file():
            raise UserError(f"{path} is not a file, so no monitor state; {START_OVER}")
        if not path.exists():
            records = sorted((directory / "checks").glob("*.json"))  # a killed check's folder alone is no record
            earlier = [f"checks/{records[0].name}", *([] if len(records) < 2 else ["..."])] if records else []
            earlier += [f"{name}/" for name in EARLIER_OUTPUTS if (directory / name).exists()]
            if earlier:
                raise UserError(
                    f"monitor.state_dir {directory} holds what earlier checks wrote ({', '.join(earlier)}) but no "
                    f"{STATE_NAME}: put it back to go on; {START_OVER}"
                )
            return cls()
        saved = read_json(path, "monitor state", START_OVER)
        if not isinstance(saved, dict):
            raise UserError(f"{path}: corrupt monitor state (JSON {type(saved).__name__}, not an object); {START_OVER}")
        if saved.pop("state_version", None) != STATE_VERSION:
            raise UserError(f"{path}: written by another draftsmith version (state_version); {START_OVER}")
        return cls(**saved)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomic(
            directory / STATE_NAME,
            json.dumps({"state_version": STATE_VERSION, **asdict(self)}, indent=2, sort_keys=True) + "\n",
        )


def iso_seconds(timestamp: float) -> str:
    """A time the state or a check's line gives, in UTC to the second."""
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds")
