"""Checkpoints: `checkpoints/step_NNNNNNN/` holds accelerate's state (optimizer, scheduler, RNG of
every rank; sharded correctly under DeepSpeed/FSDP), the portable drafter (`drafter/`, safetensors +
config.json) and `trainer_state.json` (step and data position).

A checkpoint is written under a `.tmp` name and renamed when complete, and `trainer_state.json` is
its last file, so a run killed mid-save never leaves a checkpoint that resume would pick up.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from draftsmith.errors import UserError

STATE_NAME = "trainer_state.json"


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch the next micro-batch comes from
    batch_in_epoch: int = 0  # micro-batches of that epoch already consumed (per rank)


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step:07d}"


def save_checkpoint(accelerator, drafter, state: TrainerState, output_dir: Path, keep: int) -> Path:
    final = checkpoint_dir(output_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    save_drafter(accelerator, drafter, tmp / "drafter")
    if accelerator.is_main_process:
        (tmp / STATE_NAME).write_text(json.dumps(asdict(state), indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune_checkpoints(output_dir, keep)
    accelerator.wait_for_everyone()
    return final


def save_drafter(accelerator, drafter, directory: Path) -> None:
    """The drafter alone, as eval and export read it. Gathers shards under ZeRO-3/FSDP."""
    state_dict = accelerator.get_state_dict(drafter)
    if accelerator.is_main_process:
        accelerator.unwrap_model(drafter).save_pretrained(directory, state_dict=state_dict)


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    if keep <= 0:
        return
    for old in completed_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(old)


def completed_checkpoints(output_dir: Path) -> list[Path]:
    root = output_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / STATE_NAME).is_file())


def find_resume_checkpoint(output_dir: Path, resume: Optional[str]) -> Optional[Path]:
    """`latest` -> newest complete checkpoint in output_dir (None if there is none yet); else a path."""
    if resume is None:
        return None
    if resume == "latest":
        found = completed_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_NAME).is_file():
        raise UserError(f"train.resume={resume!r} is not a complete checkpoint (no {STATE_NAME})")
    return path


def load_checkpoint(accelerator, path: Path) -> TrainerState:
    accelerator.load_state(str(path))
    try:
        return TrainerState(**json.loads((path / STATE_NAME).read_text()))
    except (json.JSONDecodeError, TypeError) as err:
        raise UserError(f"{path / STATE_NAME}: corrupt trainer state ({err})") from None
