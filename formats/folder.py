"""Reading a drafter folder, for every stage that reads one: eval and the monitor evaluate it, the export
reads its own folders back, and training warm-starts from it. A folder is a draftsmith checkpoint
(`heads.load_drafter`) or an engine folder (an export's `vllm/` or `sglang/`, or one speculators saved),
read through the export formats' registry, where each format's writer and reader live together.

Which folder a command reads: `checkpoint=`, else the run's own `<output_dir>/final`. Only the
read-only commands (eval, export, monitor) take `checkpoint`; a training run's start is `train.init_from`,
so a run's saved recipe never points a later command at other weights than the run's.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig
from safetensors.torch import load_file

from draftsmith.errors import UserError
from draftsmith.files import checkpoint_digest
from draftsmith.formats import EXPORTERS
from draftsmith.formats.repo import EXPORT_INFO, WEIGHTS
from draftsmith.heads import load_drafter
from draftsmith.heads.base import CONFIG_NAME, architecture, check_same_target
from draftsmith.recipe import recipe_advice
from draftsmith.target import TargetShape


def checkpoint_to_read(cfg: DictConfig) -> Path:
    """The drafter eval and export read: `checkpoint=`, else `<output_dir>/final`, where train writes."""
    return Path(cfg.checkpoint or Path(cfg.output_dir) / "final")


def weights_digest(path: str | Path) -> str:
    """What identifies the weights a drafter folder holds, for the eval report and the monitor's baseline:
    a checkpoint's sha256 (draftsmith.files.checkpoint_digest), and for an export folder the sha256 of the
    checkpoint it was made from (its draftsmith_export.json), so that a report on either names the same
    drafter."""
    path = Path(path)
    info_path = next((p for p in (path / EXPORT_INFO, path.parent / EXPORT_INFO) if p.is_file()), None)
    if info_path is not None:
        return json.loads(info_path.read_text())["source"]["sha256"]
    return checkpoint_digest(path)


def read_folder(folder: Path, target):
    """The draftsmith drafter an engine folder holds, attached to `target`."""
    config = json.loads((folder / CONFIG_NAME).read_text())
    tensors = load_file(str(folder / WEIGHTS))
    info_path = next((p for p in (folder / EXPORT_INFO, folder.parent / EXPORT_INFO) if p.is_file()), None)
    info = json.loads(info_path.read_text()) if info_path else {}
    matches = [exporter for exporter in dict.fromkeys(EXPORTERS.values()) if exporter.recognises(config, tensors)]
    if len(matches) != 1:
        raise UserError(
            f"{folder} is not a drafter folder draftsmith can read "
            f"(config.json architectures {config.get('architectures')})"
        )
    drafter = matches[0].read(folder, config, tensors, target, info)
    return drafter.eval()


def open_drafter(path: str | Path, target_shape: TargetShape, target):
    """A draftsmith checkpoint, or an engine folder an export wrote (its `vllm/` or `sglang/`, or the
    export directory holding one), as a drafter attached to `target`."""
    path = Path(path)
    saved = path / CONFIG_NAME
    if saved.is_file() and "draftsmith_format" in json.loads(saved.read_text()):
        return load_drafter(path, target_shape, target)
    inner = sorted({name for exporter in EXPORTERS.values() for name in exporter.weights_dirs})
    engines = [path, *(path / name for name in inner), path / "vllm", *(path / "vllm" / name for name in inner)]
    for folder in (*engines, path / "sglang"):
        if (folder / CONFIG_NAME).is_file() and (folder / WEIGHTS).is_file():
            drafter = read_folder(folder, target)
            check_same_target(drafter.target, target_shape, str(folder))
            return drafter
    raise UserError(
        f"{path} holds neither a drafter checkpoint nor an exported drafter folder (config.json + {WEIGHTS})"
    )


def warm_start(path: str | Path, drafter, target_model):
    """The drafter a training run starts from (`train.init_from`): a draftsmith checkpoint, or an engine
    folder, its export's or one speculators saved (`open_drafter`), for `drafter`'s target. Its
    architecture must be the recipe's (`drafter`, built from the recipe's drafter section), or the
    starting weights would train, save and export as another function: a difference is one UserError
    naming the keys to set, never adopted silently (training settings, DrafterConfig.SETTINGS, may differ)."""
    start = open_drafter(path, drafter.target, target_model)
    if start.type != drafter.type:
        raise UserError(
            f"train.init_from={path} holds a {start.type} drafter, the recipe trains {drafter.type}: "
            f"{recipe_advice(start.type)}"
        )
    theirs, ours = architecture(start.config), architecture(drafter.config)
    differ = [
        f"drafter.{key}={json.dumps(ours[key], default=str)} ({path} has {json.dumps(theirs.get(key), default=str)})"
        for key in ours
        if theirs.get(key) != ours[key]
    ]
    if differ:
        raise UserError(
            f"train.init_from={path} is another architecture than the recipe's: {'; '.join(differ)}; "
            "set those to the checkpoint's"
        )
    return start
