"""The monitor's one state file, `<state_dir>/state.json` (written atomically), and each check's record beside it
(`checks/<n>.json`, its folder `checks/<n>/`, TensorBoard under `tb/`). The state holds the drafter it monitors,
the deployed export and its baseline, the last scrape's counters (where the next window starts), the
drift streak, the cooldown, the retraining in progress (its completed steps, so a killed run resumes),
and every revision promoted so far."""

from __future__ import annotations

import datetime
import json
import logging
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from draftsmith.errors import UserError
from draftsmith.files import read_json, write_text_atomic
from draftsmith.outputs import move_aside

log = logging.getLogger("draftsmith.monitor")

STATE_NAME = "state.json"
STATE_VERSION = 1
START_OVER = "move it aside to start over (the next check keeps what earlier checks wrote aside too)"


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
        """The state in `directory`; a new one where it holds none (`set_stateless_checks_aside` has kept what
        earlier checks wrote there)."""
        path = directory / STATE_NAME
        if path.exists() and not path.is_file():  # it read as no state: the check removed checks/ at its end
            raise UserError(f"{path} is not a file, so no monitor state; {START_OVER}")
        if not path.exists():
            return cls()
        saved = read_json(path, "monitor state", START_OVER)
        if not isinstance(saved, dict):
            raise UserError(f"{path}: corrupt monitor state (JSON {type(saved).__name__}, not an object); {START_OVER}")
        if saved.pop("state_version", None) != STATE_VERSION:
            raise UserError(f"{path}: written by another draftsmith version (state_version); {START_OVER}")
        if unknown := sorted(set(saved) - {field.name for field in fields(cls)}):  # a TypeError, exit 70, before
            raise UserError(f"{path}: corrupt monitor state (unknown keys {', '.join(unknown)}); {START_OVER}")
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


def set_stateless_checks_aside(directory: Path) -> None:
    """What earlier checks wrote in `directory` (their records, traffic samples, retrainings and exports) moved to
    `replaced/<time>/` when their state is gone (moved aside to start over, or a first check killed between its
    record and its state): a new state numbers its checks and retrainings from 1 again, and wrote over checks/00001.json
    and its folder. A killed check's folder alone (`checks/00001/`, no record) is left: the next check takes its
    number."""
    if (directory / STATE_NAME).exists():
        return
    earlier = [name for name in ("retrain", "exports") if (directory / name).exists()]
    earlier += ["checks"] if any((directory / "checks").glob("*.json")) else []
    if earlier:
        moved = move_aside(directory, earlier)
        log.warning("%s holds no %s: what earlier checks wrote (%s) moved to %s", directory, STATE_NAME,
                    ", ".join(f"{name}/" for name in earlier), moved)  # fmt: skip


def check_record_paths(directory: Path, number: int) -> tuple[Path, Path]:
    """Check `number`'s folder (its traffic sample and the replay's eval) and its record."""
    return directory / "checks" / f"{number:05d}", directory / "checks" / f"{number:05d}.json"


def write_record(directory: Path, number: int, record: dict[str, Any], now: float) -> Path:
    path = check_record_paths(directory, number)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(record, indent=2, default=str) + "\n")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(directory / "tb"))
    try:
        engine = record.get("engine", {})
        for name, value in (
            ("engine/alpha", engine.get("alpha")),
            ("engine/tau", engine.get("tau")),
            ("baseline/alpha", record["baseline"]["alpha"]),
        ):
            if value is not None:
                writer.add_scalar(name, value, number, walltime=now)
        for position, rate in enumerate(engine.get("at_least", [])):
            writer.add_scalar(f"engine/at_least_{position + 1}", rate, number, walltime=now)
        for domain, test in record.get("traffic", {}).get("domains", {}).items():
            if test["measured"] is not None:
                writer.add_scalar(f"traffic/{domain}/alpha", test["measured"], number, walltime=now)
        writer.add_scalar("decision/drift", float(record["decision"]["drift"]), number, walltime=now)
        writer.add_scalar("decision/consecutive", record["decision"]["consecutive"], number, walltime=now)
    finally:
        writer.close()
    return path
