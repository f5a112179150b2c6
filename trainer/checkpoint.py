"""Checkpoints and the output directory of a training run.

`checkpoints/step_NNNNNNN/` holds accelerate's state (optimizer, scheduler, RNG of every rank;
sharded correctly under DeepSpeed/FSDP), the portable drafter (`drafter/`, safetensors + config.json)
and `trainer_state.json` (step, data position, skipped steps, tokens trained on, the best held-out
evaluation and the held-out curve so far). A checkpoint is written under a `.tmp`
name and renamed when complete, and `trainer_state.json` is its last file, so a run killed mid-save
never leaves a checkpoint that resume would pick up; a write that fails (a full disk) removes its
partial copy and leaves the previous checkpoint as it was. `final/` and `best/` are replaced the same way.

`checksums.json` records every file's size and sha256 as it was written, and resuming verifies them
first: a checkpoint damaged since (a copy cut short between machines) is refused in one line naming
it and the file, before anything is loaded or written; `train.resume=latest_intact` resumes from the
newest checkpoint that is intact instead. A checkpoint saved before checksums were recorded resumes
unverified, and the log says so.

The output directory is claimed before anything is written (`claim_output_dir`): locked against a
second job, and refused when it holds another run unless the user says to continue it
(`train.resume=true`) or to start over (`train.overwrite=true`, which moves the earlier run aside).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import pickle
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig
from safetensors import SafetensorError

from draftsmith.errors import STORAGE_ERRNOS, StorageError, UserError, one_line
from draftsmith.files import file_sha256, publish_folder, read_json, readable_as_created, write_text_atomic
from draftsmith.heads.base import DRAFTER_DIR
from draftsmith.outputs import (
    ACCURACY_NAME,
    DATA_CONTENT_NAME,
    EVAL_DIR,
    FINAL_DIR,
    LOG_NAME,
    RECIPE_NAME,
    RUN_SUMMARY_NAME,
    check_output_folders,
    held_by_main_process,
    move_aside,
)
from draftsmith.recipe_checks import LATEST_INTACT, resolve_bool_or_path
from draftsmith.trainer.checkpoint_files import UNREADABLE, check_random_states, unreadable_file, unsafe_pickle
from draftsmith.trainer.launcher import with_fp32_masters

log = logging.getLogger("draftsmith.train")

STATE_NAME = "trainer_state.json"
CHECKSUMS_NAME = "checksums.json"  # every other file of a checkpoint: {"files": {path: {"bytes", "sha256"}}}
# What a training run writes into its output directory: an earlier run is recognised by these.
RUN_OUTPUTS = ["checkpoints", FINAL_DIR, "best", "curve.json", "curve.png", LOG_NAME, "tb", EVAL_DIR, ACCURACY_NAME,
               RUN_SUMMARY_NAME, RECIPE_NAME, DATA_CONTENT_NAME]  # fmt: skip


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # epoch the next micro-batch comes from
    batch_in_epoch: int = 0  # micro-batches of that epoch already consumed (per rank)
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient
    # Fields added later default when a checkpoint lacks them (an older run resumes, its token count from 0)
    tokens: int = 0  # tokens consumed by training so far, all ranks together
    best: Optional[dict] = None  # the best held-out evaluation so far, as <output_dir>/best/best.json holds it
    curve: list = field(default_factory=list)  # one row per held-out evaluation (curve.json's rows)
    # how a step is split: {"processes", "micro_batch_size", "grad_accum"} (None in what an earlier draftsmith
    # saved: taken as the resuming run's); batch_in_epoch counts micro-batches of this split
    split: Optional[dict] = None
    # the log interval open at the checkpoint: its statistics' (total, count) over all ranks and this process's counts
    # (Meters.carried), which the resumed run's first log line adds to its own, as the uninterrupted run's did
    interval: Optional[dict] = None


def resplit(state: TrainerState, split: dict) -> TrainerState:
    """`state` of a checkpoint, resumed with `split`: its data position in micro-batches of that split. A step
    trains the same conversations however its G = processes x micro_batch_size x grad_accum are split
    (trainer/loop.py micro_batches), so another split of the same G continues where the run stopped; another G
    would train other steps from the same position, and its schedule, and is refused."""
    saved = state.split or split
    if saved == split:
        return replace(state, split=split)
    began, now = (math.prod(s.values()) for s in (saved, split))
    if began != now:
        described = ", ".join(f"{key} {value}" for key, value in saved.items())
        raise UserError(
            f"train.resume: this run's steps are of {began} conversations ({described}), and this launch makes steps "
            f"of {now}: resume with processes x train.micro_batch_size x train.grad_accum = {began}, or start a new "
            "run from its checkpoint with train.init_from"
        )
    conversations = state.batch_in_epoch * saved["micro_batch_size"] * saved["processes"]
    log.info("resumed on another split of the run's %d conversations a step: %s (it began with %s)", now, split, saved)
    return replace(state, split=split, batch_in_epoch=conversations // (split["micro_batch_size"] * split["processes"]))


def checkpoint_dir(output_dir: Path, step: int) -> Path:
    return output_dir / "checkpoints" / f"step_{step:07d}"


def save_checkpoint(accelerator, drafter, state: TrainerState, output_dir: Path, keep: int) -> Path:
    final = checkpoint_dir(output_dir, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    with _writing(tmp, f"checkpoint for step {state.step}", output_dir):
        accelerator.save_state(str(tmp))
        save_drafter(accelerator, drafter, tmp / DRAFTER_DIR)
        accelerator.wait_for_everyone()  # every rank's files are complete before they are summed
        if accelerator.is_main_process:
            text = json.dumps(asdict(state), indent=2) + "\n"
            write_checksums(tmp, {STATE_NAME: text.encode()})
            (tmp / STATE_NAME).write_text(text)
    if accelerator.is_main_process:
        readable_as_created(tmp)  # as publish_folder does for final/
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        prune_checkpoints(output_dir, keep)
    accelerator.wait_for_everyone()
    return final


def save_final(accelerator, drafter, directory: Path, files: Optional[dict[str, str]] = None) -> None:
    """The trained drafter alone, as eval and export read it, replacing any earlier `final/` in one
    rename; `files` (name -> text) are written beside it before the rename (best/'s best.json)."""
    tmp = directory.with_name(directory.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    with _writing(tmp, f"{directory.name} drafter", directory.parent):
        save_drafter(accelerator, drafter, tmp)
        if accelerator.is_main_process:
            for name, text in (files or {}).items():
                (tmp / name).write_text(text)
    if accelerator.is_main_process:
        publish_folder(tmp, directory)


@contextlib.contextmanager
def _writing(tmp: Path, what: str, output_dir: Path) -> Iterator[None]:
    """Remove the partial copy whatever stops the write (Ctrl-C and SIGTERM's Preempted too, raised on), and turn a
    failed write (a full disk, a quota, an I/O error) into one line (StorageError, exit 74) that says how to continue.
    The writers report a full disk differently (OSError ENOSPC from Python, SafetensorError from safetensors,
    RuntimeError from torch.save's zip writer), so the space left decides the reason. A PermissionError is bad input
    wherever it is met (errors.outcome): exit 2, with the same advice."""
    try:
        yield
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(err, (OSError, RuntimeError, SafetensorError)):
            raise
        if isinstance(err, PermissionError):
            reason, fix, error = f"permission denied ({err.filename or tmp})", "fix its permissions", UserError
        else:
            free = _free_bytes(output_dir)
            full = getattr(err, "errno", None) == errno.ENOSPC or "No space left" in str(err)
            full = full or (free is not None and free < 16 * 2**20)
            left = "" if free is None else f" ({free / 2**20:.1f} MiB free)"
            reason = f"no space left on device{left}" if full else one_line(err)
            fix, error = ("free space" if full else "fix the disk"), StorageError
        try:
            found = completed_checkpoints(output_dir)  # the same command alone is refused (check_earlier_run)
        except OSError:  # a disk failing under output_dir: the line is the write's, without what it could not list
            kept, then = "", "continue from its last complete checkpoint, if any"
        else:
            kept = f"the last complete checkpoint, {found[-1]}, is intact" if found else "no earlier checkpoint exists"
            kept, then = f"{kept}: ", "continue from it" if found else "start again from step 0"
        raise error(
            f"could not write the {what} under {tmp.parent}: {reason}; {kept}{fix} and run the same command with "
            f"train.resume=true to {then}"
        ) from None


def _free_bytes(directory: Path) -> Optional[int]:
    """The room left on `directory`'s file system, None where a failing disk does not say."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def save_drafter(accelerator, drafter, directory: Path) -> None:
    """The drafter alone, as eval and export read it. Gathers shards under ZeRO-3/FSDP; under DeepSpeed with mixed
    precision, the weights its optimizer steps, not the module's 16-bit copies (`with_fp32_masters`)."""
    state_dict = with_fp32_masters(accelerator, drafter, accelerator.get_state_dict(drafter))  # every rank
    if accelerator.is_main_process:
        accelerator.unwrap_model(drafter).save_pretrained(directory, state_dict=state_dict)


def write_checksums(directory: Path, pending: dict[str, bytes]) -> None:
    """`checksums.json`: the size and sha256 of every file under `directory`, and of `pending` (name ->
    the bytes about to be written there: the trainer state, written last)."""
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }
    for name, data in pending.items():
        files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (directory / CHECKSUMS_NAME).write_text(json.dumps({"algorithm": "sha256", "files": files}, indent=1) + "\n")


def checkpoint_damage(path: Path) -> Optional[str]:
    """What differs between a checkpoint's files and the checksums recorded when it was saved
    (`drafter/model.safetensors is 1000 bytes, 5000 were written`), or None when all match. A
    checkpoint without checksums.json (saved before they were recorded) has nothing to differ from."""
    listing = path / CHECKSUMS_NAME
    if not listing.is_file():
        return None
    try:
        recorded = {
            name: (int(entry["bytes"]), str(entry["sha256"]))
            for name, entry in json.loads(listing.read_text())["files"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        return f"its {CHECKSUMS_NAME} is unreadable"
    for name, (size, digest) in recorded.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, {size} were written"
        if file_sha256(file) != digest:
            return f"{name} differs from what was written (sha256)"
    return None


def verified(path: Path, hint: str) -> Path:
    """`path`, a checkpoint to resume from, once its files match their checksums; otherwise one line
    naming it and the damaged file (and `hint`, what the user can do), before anything is touched."""
    damage = _verify(path)
    if damage is not None:
        raise UserError(f"checkpoint {path} is damaged: {damage}; nothing was loaded or changed; {hint}")
    return path


def _verify(path: Path) -> Optional[str]:
    """checkpoint_damage, with a log line saying what was verified (or that nothing could be)."""
    if not (path / CHECKSUMS_NAME).is_file():
        log.warning(
            "checkpoint %s has no %s (saved before checkpoints recorded checksums): resuming from it unverified",
            path,
            CHECKSUMS_NAME,
        )
        return None
    damage = checkpoint_damage(path)
    if damage is None:
        log.info("checkpoint %s verified: its files match their checksums", path)
    return damage


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


def resume_checkpoint(output_dir: Path, resume: Optional[str], accelerator=None) -> Optional[Path]:
    """`train.resume`: true -> the newest complete checkpoint in output_dir (None if there is none
    yet, so a scheduler can always pass it); latest_intact -> the newest one whose files match their
    checksums (skipping damaged ones with a warning each); a path -> that checkpoint; unset -> None.
    The checkpoint is verified against its checksums (UserError when damaged). With an `accelerator`
    of several processes the main process verifies and the others receive its answer."""
    if accelerator is None or accelerator.num_processes == 1:
        return _resume_checkpoint(output_dir, resume)
    from accelerate.utils import broadcast_object_list

    answer: list = [None]
    if accelerator.is_main_process:
        try:
            found = _resume_checkpoint(output_dir, resume)
            answer = [("path", None if found is None else str(found))]
        except UserError as err:
            answer = [("error", str(err))]
    kind, value = broadcast_object_list(answer)[0]
    if kind == "error":
        raise UserError(value)
    return None if value is None else Path(value)


def _resume_checkpoint(output_dir: Path, resume: Optional[str]) -> Optional[Path]:
    resume = resolve_bool_or_path(resume)
    if resume is None:
        return None
    if resume in ("latest", LATEST_INTACT):
        found = completed_checkpoints(output_dir)
        if not found and (output_dir / FINAL_DIR).exists():  # starting over would replace its final/
            raise UserError(
                f"train.resume=true: {output_dir} holds a finished run (final/) and no checkpoint to resume from; "
                "start over with train.overwrite=true (the run is moved aside), or train a new run from it with "
                f"train.init_from={output_dir / 'final'}"
            )
        if not found:
            log.info("train.resume: no checkpoint in %s yet: the run starts at step 0", output_dir)
            return None
        if resume == "latest":
            earlier = "train.resume=latest_intact resumes from the newest intact one, " if len(found) > 1 else ""
            return verified(found[-1], f"{earlier}train.overwrite=true starts over (the run is moved aside)")
        for path in reversed(found):
            damage = _verify(path)
            if damage is None:
                return path
            log.warning(
                "train.resume=%s: checkpoint %s is damaged (%s); trying the one before it", LATEST_INTACT, path, damage
            )
        raise UserError(
            f"train.resume={LATEST_INTACT}: every checkpoint in {output_dir / 'checkpoints'} is damaged (the warnings"
            " above name their files); start over with train.overwrite=true (the run is moved aside)"
        )
    path = Path(resume)
    if not path.exists():
        raise UserError(f"train.resume={resume!r} does not exist; give a checkpoint's folder, or train.resume=true")
    if not (path / STATE_NAME).is_file():
        raise UserError(f"train.resume={resume!r} is not a complete checkpoint (no {STATE_NAME})")
    return verified(
        path, f"give another checkpoint, or train.resume={LATEST_INTACT} for the newest intact one in output_dir"
    )


def follows_training(cfg: DictConfig) -> str:
    """What a run does once trained, which a resume of its finished training runs (a stop's advice): it said "its
    evaluation" with eval.enabled=false too, of a run whose eval-split accuracy was stopped."""
    stages = [("its eval-split accuracy", bool(cfg.data.eval)), ("its speculative-decoding report", cfg.eval.enabled)]
    return " and ".join(stage for stage, runs in stages if runs) or "its end"


def set_newer_checkpoints_aside(output_dir: Path, resumed: Path) -> None:
    """A run resumed from one of its own checkpoints older than its newest branches off there: the newer ones
    (another branch, which a later train.resume=true would jump back to) move to replaced/<time>/checkpoints/."""
    newer = [
        p
        for p in completed_checkpoints(output_dir)
        if p.name > resumed.name and p.parent.resolve() == resumed.parent.resolve()
    ]
    moved = move_aside(output_dir, [str(p.relative_to(output_dir)) for p in newer])
    if moved is None:
        return
    log.warning(
        "resumed from %s, older than the run's newest checkpoint: the newer %s moved to %s",
        resumed.name, ", ".join(p.name for p in newer), moved / "checkpoints",
    )  # fmt: skip


def keep_log_to(output_dir: Path, step: int) -> None:
    """log.jsonl as an uninterrupted run's: the rows past `step`, the step a run resumes at (0: it starts over),
    were logged by the attempt that stopped after its last checkpoint, and are dropped."""
    path = output_dir / LOG_NAME
    if not path.is_file():
        return
    rows = path.read_text().splitlines(keepends=True)
    kept = [row for row in rows if row.endswith("\n") and json.loads(row)["step"] <= step]
    if len(kept) != len(rows):
        write_text_atomic(path, "".join(kept))
        log.info("log.jsonl: %d rows past step %d, of the attempt that stopped, dropped", len(rows) - len(kept), step)


def load_checkpoint(accelerator, path: Path) -> None:
    """Restore accelerate's state (weights, optimizer, scheduler, RNG) from the checkpoint `path`; its trainer state
    is `saved_state`'s. A pickle torch's safe unpickler refuses (its checksums may match a file put in its place) is
    one line naming it (`unsafe_pickle`), as is a file of a checkpoint saved without checksums that does not load
    (`unreadable_file`); this rank's random states are checked (`check_random_states`): trainer/checkpoint_files.py."""
    verified_files = (path / CHECKSUMS_NAME).is_file()
    try:
        accelerator.load_state(str(path))
    except pickle.UnpicklingError:
        raise unsafe_pickle(path, sorted([*path.glob("*.bin"), *path.glob("*.pkl")])) from None
    except UNREADABLE as err:
        # its files as saved: the failure is not theirs (a bug, or another recipe); permissions and a failing disk
        # mean what errors.outcome says they mean wherever they are met
        if verified_files or isinstance(err, PermissionError) or getattr(err, "errno", None) in STORAGE_ERRNOS:
            raise
        raise UserError(  # saved before checksums: a damaged file is still the user's to fix, in one line
            f"checkpoint {path} (saved without checksums) cannot be loaded: {unreadable_file(path) or 'a file of it'} "
            f"may be damaged ({one_line(err)})"
        ) from None
    check_random_states(accelerator.process_index, path)


def saved_state(path: Path) -> TrainerState:
    """A checkpoint's trainer state (step, data position, split ...), read alone."""
    try:
        return TrainerState(**read_json(path / STATE_NAME, "trainer state"))
    except TypeError as err:
        raise UserError(f"{path / STATE_NAME}: corrupt trainer state ({err})") from None


def earlier_run(output_dir: Path) -> list[str]:
    """The training outputs already in `output_dir` (empty for a fresh directory)."""
    return [name for name in RUN_OUTPUTS if (output_dir / name).exists()]


def check_earlier_run(cfg: DictConfig) -> None:
    """Refuse to start a new run over an earlier one; with train.overwrite=true move it aside first."""
    output_dir = Path(cfg.output_dir)
    found = earlier_run(output_dir)
    if not found or resolve_bool_or_path(cfg.train.resume) is not None:
        check_output_folders(output_dir, ["tb", "checkpoints", EVAL_DIR])  # what a resumed run writes into again
        return
    if cfg.train.overwrite:
        moved = move_aside(output_dir, RUN_OUTPUTS)
        log.warning("train.overwrite=true: moved the earlier run's %s to %s", ", ".join(found), moved)
        return
    steps = [p.name for p in completed_checkpoints(output_dir)]
    held = f"checkpoints {', '.join(steps)}" if steps else ", ".join(found)
    raise UserError(
        f"output_dir {output_dir} holds an earlier run ({held}); continue it with train.resume=true, "
        f"or start over with train.overwrite=true (moves it to {output_dir}/replaced/<time>/)"
    )


def claim_output_dir(cfg: DictConfig, state):
    """Hold the output directory for this job (`state`: accelerate's PartialState): locked, and
    checked for an earlier run, before any rank writes."""
    return held_by_main_process(cfg.output_dir, state, check=lambda: check_earlier_run(cfg), key="output_dir")
