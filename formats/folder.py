"""Reading a drafter folder, for every stage that reads one: eval and the monitor evaluate it, the export
reads its own folders back, and training warm-starts from it. A folder is a draftsmith checkpoint
(`heads.base.load_drafter`) or an engine folder (an export's `vllm/` or `sglang/`, or one speculators saved),
read through the export formats' registry, where each format's writer and reader live together.

Which folder a command reads: `checkpoint=`, else the run's own `<output_dir>/final`. Only the
read-only commands (eval, export, monitor) take `checkpoint`; a training run's start is `train.init_from`,
so a run's saved recipe never points a later command at other weights than the run's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from draftsmith.errors import UserError, one_line
from draftsmith.files import checkpoint_digest, read_json, require_readable
from draftsmith.formats import EXPORTERS, Exporter
from draftsmith.formats.repo import EXPORT_INFO
from draftsmith.heads.base import (
    CONFIG_NAME,
    WEIGHTS_NAME,
    DrafterConfig,
    architecture,
    built_drafter,
    check_same_target,
    load_drafter,
    saved_drafter,
)
from draftsmith.recipe import checkpoint_to_read
from draftsmith.recipe_input import parse_overrides, recipe_advice, split_argv
from draftsmith.target import TargetShape, local_target_config


def weights_digest(path: str | Path) -> str:
    """What identifies the weights a drafter folder holds, for the eval report and the monitor's baseline:
    a checkpoint's sha256 (draftsmith.files.checkpoint_digest), and for an export folder the sha256 of the
    checkpoint it was made from (its draftsmith_export.json), so that a report on either names the same
    drafter."""
    info_path = export_info_path(Path(path))
    if info_path is not None:
        return read_json(info_path)["source"]["sha256"]
    return checkpoint_digest(path)


def export_info_path(folder: Path) -> Optional[Path]:
    """The draftsmith_export.json of an engine folder an export wrote: in it, or beside it (Medusa-2's `vllm/`
    holds its drafter in a subfolder); None for a folder written elsewhere."""
    return next((p for p in (folder / EXPORT_INFO, folder.parent / EXPORT_INFO) if p.is_file()), None)


def read_folder(folder: Path, target):
    """The draftsmith drafter an engine folder holds, attached to `target`."""
    exporter, config, _ = engine_format(folder)
    try:
        tensors = load_file(str(folder / WEIGHTS_NAME))
    except (SafetensorError, OSError) as err:  # a file cut short past its header
        raise UserError(f"{folder / WEIGHTS_NAME}: corrupt weights file ({one_line(err)})") from None
    info_path = export_info_path(folder)
    info = read_json(info_path) if info_path else {}
    try:  # a folder in the format, with a config.json edited to values its reader cannot take
        drafter = exporter.read(folder, config, tensors, target, info)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise UserError(
            f"{folder / CONFIG_NAME}: corrupt {exporter.kinds[0]} engine config ({one_line(err, with_type=True)})"
        ) from None
    except RuntimeError as err:  # load_state_dict's: names or shapes the config.json does not describe
        if "loading state_dict" not in str(err):
            raise
        raise UserError(
            f"{folder}: its {WEIGHTS_NAME} is not what its config.json describes ({one_line(err)})"
        ) from None
    return drafter.eval()


def engine_format(folder: Path) -> tuple[Exporter, dict, frozenset[str]]:
    """The format registry's entry that reads an engine folder, with its config.json and its weights' names (the
    file's header alone: a warm start's checks and its kind, read before anything loads, need no tensor)."""
    config = read_json(folder / CONFIG_NAME)
    if not isinstance(config, dict):
        raise UserError(f"{folder / CONFIG_NAME}: corrupt engine config (JSON {type(config).__name__}, not an object)")
    require_readable(folder / WEIGHTS_NAME)  # safetensors calls a file it may not read missing
    try:
        with safe_open(str(folder / WEIGHTS_NAME), "pt") as weights:
            names = frozenset(weights.keys())
    except (SafetensorError, OSError) as err:
        raise UserError(f"{folder / WEIGHTS_NAME}: corrupt weights file ({one_line(err)})") from None
    try:  # a format's fields of another type (`architectures: null`) are no format's
        matches = [exporter for exporter in dict.fromkeys(EXPORTERS.values()) if exporter.recognises(config, names)]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise UserError(f"{folder / CONFIG_NAME}: corrupt engine config ({one_line(err, with_type=True)})") from None
    if len(matches) != 1:
        said = f"config.json architectures {config.get('architectures')}"
        if "speculators_model_type" in config:  # speculators names the model by its type, not its architecture
            read = sorted({kind for exporter in EXPORTERS.values() for kind in exporter.speculators_types})
            said = (
                f"config.json speculators_model_type {config['speculators_model_type']!r}; it reads speculators' "
                f"{', '.join(read)}"
            )
        raise UserError(f"{folder} is not a drafter folder draftsmith can read ({said})")
    return matches[0], config, names


def checkpoint_kind(path: Path) -> Optional[str]:
    """The kind of the draftsmith checkpoint at `path`, read without a target; None for an engine folder,
    which an export may have written as another kind's format (Medusa-2's is vLLM's Medusa)."""
    saved = path / CONFIG_NAME
    values = read_json(saved) if saved.is_file() else {}
    # another JSON value (a list, null): no draftsmith checkpoint's, the engine folder's reader names it
    return saved_drafter(path)[0].type if isinstance(values, dict) and "draftsmith_format" in values else None


def recorded_kind(path: Path) -> Optional[str]:
    """The kind of the drafter at `path` as its command names it, known without a target: a checkpoint's own, the
    kind an export recorded (draftsmith_export.json: a Medusa-2 export's is medusa2, its vLLM folder read as Medusa),
    else the kind its engine folder reads as (`start_kind`)."""
    folder = engine_folder(path) if checkpoint_kind(path) is None else None
    info = export_info_path(folder) if folder is not None else None
    recorded = read_json(info).get("drafter_type") if info is not None else None
    return recorded if isinstance(recorded, str) else start_kind(path)


def start_kind(path: Path) -> Optional[str]:
    """The kind a training start (`train.init_from`) is read as, known without a target: a checkpoint's own, an
    engine folder's format's (`Exporter.kinds[0]`: Medusa-2's vLLM folder reads as Medusa); None when `path`
    holds neither (open_drafter says so once the target is loaded)."""
    kind = checkpoint_kind(path)
    if kind is not None:
        return kind
    folder = engine_folder(path)
    return None if folder is None else engine_format(folder)[0].kinds[0]


def engine_folder(path: Path) -> Optional[Path]:
    """The engine folder a path that is no draftsmith checkpoint holds (an export's `vllm/` or `sglang/`, the
    export directory holding one, or the folder itself); None where it holds none."""
    inner = sorted({name for exporter in EXPORTERS.values() for name in exporter.weights_dirs})
    engines = [path, *(path / name for name in inner), path / "vllm", *(path / "vllm" / name for name in inner)]
    return next(
        (f for f in (*engines, path / "sglang") if (f / CONFIG_NAME).is_file() and (f / WEIGHTS_NAME).is_file()), None
    )


def open_drafter(path: str | Path, target_shape: TargetShape, target, served: Optional[Mapping[str, Any]] = None):
    """A draftsmith checkpoint, or an engine folder an export wrote (its `vllm/` or `sglang/`, or the
    export directory holding one), as a drafter attached to `target`, with the `served` settings given."""
    path = Path(path)
    saved = path / CONFIG_NAME
    if saved.is_file() and "draftsmith_format" in read_json(saved):
        return with_served(load_drafter(path, target_shape, target), served)
    folder = engine_folder(path)
    if folder is not None:
        drafter = read_folder(folder, target)
        check_same_target(drafter.target, target_shape, str(folder))
        return with_served(drafter, served)
    raise not_a_drafter(path)


def not_a_drafter(path: Path) -> UserError:
    """The line for a path `open_drafter` cannot read, naming the folder inside it that it could."""
    if path.is_file():  # a file was read as a folder holding nothing
        return UserError(f"{path} is a file: give the folder of a drafter checkpoint or of an exported drafter")
    inside = sorted(p.parent.name for p in path.glob(f"*/{CONFIG_NAME}") if (p.parent / WEIGHTS_NAME).is_file())
    where = f"; its {inside[0]}/ does (pass that)" if inside else ""  # a run's final/, a training checkpoint's drafter/
    if not inside and (path / CONFIG_NAME).is_file():  # the weights file is what is missing
        where = f": it has a {CONFIG_NAME} and no {WEIGHTS_NAME}"
    return UserError(
        f"{path} holds neither a drafter checkpoint nor an exported drafter folder "
        f"(config.json + {WEIGHTS_NAME}){where}"
    )


def require_drafter_folder(cfg) -> None:
    """train.init_from holds what `warm_start` reads, checked before any data or model loads (unless the run
    resumes: it does not read its start again): one line naming the folder inside it that it could read."""
    from draftsmith.recipe_checks import resolve_bool_or_path

    if cfg.train.init_from is None or resolve_bool_or_path(cfg.train.resume) is not None:
        return
    folder = Path(cfg.train.init_from).expanduser()
    if engine_folder(folder) is None:
        raise not_a_drafter(folder)
    require_weights_as_configured(folder)
    recipe = OmegaConf.to_object(cfg.drafter)
    what = f"train.init_from={cfg.train.init_from}"
    if checkpoint_kind(folder) is not None:  # a draftsmith checkpoint's settings are read without a target
        kind, saved = saved_drafter(folder)[:2]
        require_recipes_kind(kind.type, recipe.type, what)
        # what the recipe leaves null is the target's or the start's to fill: only `warm_start` can compare it
        given = replace(saved, **{key: value for key, value in asdict(recipe).items() if value is not None})
        require_recipes_drafter(kind.type, saved, recipe.type, given, what, cfg.train.init_from)
    else:  # an engine folder: what its config.json fixes (its format's folder_settings), before minutes of loading
        found = engine_folder(folder)
        exporter, config, _ = engine_format(found)
        require_recipes_kind(exporter.kinds[0], recipe.type, what)
        target_config = local_target_config(cfg.target.name_or_path)
        if target_config is not None:  # a Hub id's is read as it loads
            exporter.require_made_for(found, config, target_config)
        ours = architecture(recipe)
        try:  # a config.json edited to values its reader cannot take, as read_folder says it
            fixed = exporter.folder_settings(found, config)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
            raise UserError(
                f"{found / CONFIG_NAME}: corrupt {exporter.kinds[0]} engine config ({one_line(err, with_type=True)})"
            ) from None
        raise_if_differ(
            {key: value for key, value in fixed.items() if ours.get(key) is not None}, ours, what, cfg.train.init_from
        )


def warm_start(path: str | Path, drafter, target_model):
    """The drafter a training run starts from (`train.init_from`): a draftsmith checkpoint, or an engine
    folder, its export's or one speculators saved (`open_drafter`), for `drafter`'s target, of the recipe's
    architecture (`drafter`, built from the recipe's drafter section; `require_recipes_drafter`)."""
    start = open_drafter(path, drafter.target, target_model)
    require_recipes_drafter(start.type, start.config, drafter.type, drafter.config, f"train.init_from={path}", path)
    return start


def load_warm_start(path: str | Path, drafter, target_model) -> None:
    """`drafter` given the weights and data-fitted state of the start at `path` (`warm_start`): its draft vocabulary
    is kept, not fitted to this run's data again."""
    start = warm_start(path, drafter, target_model)
    drafter.load_state_dict(start.state_dict())
    drafter.learned = dict(start.learned)


def require_recipes_kind(kind: Optional[str], recipe_kind: str, what: str, role: str = "trains") -> None:
    """The drafter `what` holds is of the kind the recipe trains (`role` "is for": the kind a read-only
    command's recipe names); None: not known yet (an engine folder, read as its format's kind)."""
    if kind not in (None, recipe_kind):
        # a name without vowels is said letter by letter ("an mtp drafter"): the first letter's name decides
        initialism = not any(letter in "aeiou" for letter in kind.lower())
        article = "an" if kind[0].lower() in ("fhlmnrsx" if initialism else "aeiou") else "a"
        raise UserError(
            f"{what} holds {article} {kind} drafter, the recipe {role} {recipe_kind}: {recipe_advice(kind)}"
        )


def served_settings(argv: Sequence[str], cfg: DictConfig) -> dict[str, Any]:
    """The drafter settings eval, export and sweep take from their command line: the kind's SERVED ones (how it
    decodes and is served), as `with_served` applies them to the folder they read. Every other drafter setting is
    the folder's own, never the recipe's: a `drafter.*` the command line sets would be ignored without a word, so
    one that differs from the checkpoint's (and any, for an engine folder, whose settings are its format's) is
    refused, naming it. The recipe file's own drafter section may differ: it names the kind only."""
    names = [
        key.split(".", 1)[1]
        for key, _ in parse_overrides(split_argv(argv)[1])
        if key.startswith("drafter.") and key != "drafter.type"
    ]
    ours = OmegaConf.to_object(cfg.drafter)
    served = {name: getattr(ours, name) for name in names if name in ours.SERVED}
    given = [name for name in names if name not in served]
    path = checkpoint_to_read(cfg)
    if checkpoint_kind(path) is None:
        if given and engine_folder(path) is not None:
            raise UserError(
                f"{', '.join('drafter.' + name for name in given)} is not read: {path} is an engine folder, read with "
                "the settings its format records"
            )
        return served  # no folder to read (the command says so), or an engine folder checked once read
    saved_config = saved_drafter(path)[1]
    if served and saved_config.type == ours.type:  # another kind: the command refuses the folder
        replace(saved_config, **served).check()  # before the target loads
    saved = asdict(saved_config)
    taken = f" (all but {', '.join(ours.SERVED)})" if ours.SERVED else ""
    for name in given:
        if name in saved and not same_setting(saved[name], getattr(ours, name, None)):
            raise UserError(
                f"drafter.{name}={json.dumps(getattr(ours, name), default=str)} is not read: {path} holds a drafter "
                f"with {name}={json.dumps(saved[name], default=str)}, and eval and export read the checkpoint's "
                f"settings{taken}; train.init_from trains a new one from it"
            )
    return served


def with_served(drafter, served: Optional[Mapping[str, Any]]):
    """`drafter` decoding and served with `served` (`served_settings`) in place of its folder's own: SERVED keys are
    read when it decodes or is exported, so its weights and what they compute stay the folder's."""
    if served:
        drafter.config = replace(drafter.config, **served)
        drafter.config.check(drafter.target)
    return drafter


def served_values(config: DrafterConfig, served: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The SERVED settings a drafter of `config` decodes and is served with, `served` given: what an eval report
    and an export record must agree on to describe one way of serving it."""
    return {name: (served or {}).get(name, getattr(config, name)) for name in config.SERVED}


def require_same_serving(recorded: Mapping[str, Any], expected: Mapping[str, Any], what: str, advice: str) -> None:
    """`recorded` (the drafter settings a report or a sweep row holds) are the SERVED ones `expected` (`served_values`)
    where it records them (an earlier draftsmith did not)."""
    differ = [
        f"drafter.{name}={json.dumps(value)} ({what} has {json.dumps(recorded[name])})"
        for name, value in expected.items()
        if name in recorded and not same_setting(recorded[name], value)
    ]
    if differ:
        raise UserError(f"{what} measured another way of serving the drafter: {'; '.join(differ)}; {advice}")


def same_setting(a, b) -> bool:
    """Two values of a drafter setting, a list and a tuple of the same items alike."""
    return (list(a) if isinstance(a, (list, tuple)) else a) == (list(b) if isinstance(b, (list, tuple)) else b)


def require_recipes_drafter(
    kind: str, config: DrafterConfig, recipe_kind: str, recipe: DrafterConfig, what: str, path: str | Path
):
    """The drafter `what` (the folder `path`) holds (`kind`, `config`) is the recipe's (`recipe_kind`, `recipe`),
    or its weights would train, save and export as another function: a difference is one UserError naming the
    keys to set, never adopted silently (training settings, DrafterConfig.SETTINGS, and what a kind resolves
    from the target may differ)."""
    require_recipes_kind(kind, recipe_kind, what)
    raise_if_differ(architecture(config), architecture(recipe), what, path)


def raise_if_differ(theirs: dict[str, Any], ours: dict[str, Any], what: str, path: str | Path) -> None:
    """One UserError naming each of `theirs` (the drafter `what`, the folder `path`, holds) that `ours` (the recipe's)
    sets otherwise, and the keys to set."""
    differ = [
        f"drafter.{key}={json.dumps(ours[key], default=str)} ({path} has {json.dumps(theirs.get(key), default=str)})"
        for key in ours
        if key in theirs and theirs[key] != ours[key]
    ]
    if differ:
        raise UserError(
            f"{what} is another architecture than the recipe's: {'; '.join(differ)}; set those to the checkpoint's"
        )


def require_outside_published(
    output: Path, checkpoint: Optional[Path], named: str, matched_by: str, give: str = "a folder"
) -> None:
    """`output` (an export's, a sweep's, an eval report's folder) not inside the checkpoint it reads, whose sha256 its
    files would count in, which what it writes is matched by (`matched_by`); nor inside an engine folder an export
    published (its draftsmith_export.json), which it would be served and pushed with (an export.output of the vllm/
    folder wrote a whole export into it, and the next export in place removed it)."""
    resolved = output.resolve()
    if checkpoint is not None and resolved.is_relative_to(checkpoint.resolve()):
        raise UserError(
            f"{named} is inside the checkpoint {checkpoint}: its files would count in the checkpoint's sha256, which "
            f"{matched_by}; give {give} outside it"
        )
    for folder in [resolved, *resolved.parents]:  # another drafter's folder: a checkpoint or an export
        if (folder / EXPORT_INFO).is_file():
            raise UserError(
                f"{named} is inside the export {folder} (its {EXPORT_INFO}): what it writes would be served and pushed "
                f"with it; give {give} outside it"
            )
        if is_drafter_checkpoint(folder):
            raise UserError(
                f"{named} is inside the drafter checkpoint {folder}: its files would count in its sha256, which its "
                f"eval report and exports identify it by; give {give} outside it"
            )


def require_target_before_load(path: Path, section) -> None:
    """`load_drafter`'s check that the target is the one the drafter at `path` was made for, before the target loads
    (minutes, for a large one): a local target's shape and the records of its weights read alone from its checkpoint
    (`stored_records`: a few rows). A Hub target, a quantized one (its stored values are not the ones it loads) and an
    engine folder at `path` are checked as the target loads. `path` the target's own folder is refused: a causal LM's
    folder reads as a draft model's export (an MTP release's, which ships its layer, too), refused as another kind's
    and then as weights its config does not describe."""
    if Path(section.name_or_path).is_dir() and path.is_dir() and path.samefile(section.name_or_path):
        raise UserError(
            f"checkpoint={path} is the target's own folder (target.name_or_path): checkpoint= names a drafter, a "
            "training run's final/ or checkpoint or an export's folder"
        )
    if not Path(section.name_or_path).is_dir() or not is_drafter_checkpoint(path):
        return
    from draftsmith.target import empty_target
    from draftsmith.target_weights import stored_records

    empty = empty_target(section, torch.float32)
    if getattr(empty.config, "quantization_config", None) is not None:
        return
    stored = stored_records(empty, section.name_or_path, "the target's check")
    check_same_target(saved_drafter(path)[2], replace(TargetShape.of(empty, section.name_or_path), **stored), str(path))


def is_drafter_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a draftsmith checkpoint's config.json (a model's, or a damaged one, does not count)."""
    try:
        saved = json.loads((folder / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(saved, dict) and "draftsmith_format" in saved


def require_weights_as_configured(path: Path) -> None:
    """The draftsmith checkpoint at `path` (the one eval, export and sweep read, a training's warm start) holds every
    tensor its config.json builds, at the shape it builds it: the drafter built on the meta device (no memory, no
    target) against the weights file's header, before the target loads. A config edited to other sizes than its
    weights (more heads) was refused only once the target's weights had loaded, minutes at scale. Tensors the file
    holds beyond them are the target's modules a drafter adapts (Medusa-2's LoRA), which load_drafter checks once it
    has the target. An engine folder is its format's to read."""

    if checkpoint_kind(path) is None:
        return
    cls, config, saved_target, _ = saved_drafter(path)
    with torch.device("meta"):
        drafter = built_drafter(path, cls, config, saved_target)
    state = drafter.state_dict()
    built = {name: tuple(tensor.shape) for name, tensor in state.items()}
    weights = path / WEIGHTS_NAME
    require_readable(weights)
    try:
        with safe_open(str(weights), framework="pt") as stored:
            held = {name: tuple(stored.get_slice(name).get_shape()) for name in stored.keys()}
            kinds = {name: stored.get_slice(name).get_dtype() for name in stored.keys()}  # F32, BF16, I64, BOOL, ...
    except (SafetensorError, OSError) as err:
        raise UserError(f"{weights}: corrupt weights file ({one_line(err)})") from None
    missing = [name for name in built if name not in held]
    other = [
        f"{name} {list(held[name])} (its config builds {list(shape)})"
        for name, shape in built.items()
        if name in held and held[name] != shape
    ]
    # a weight stored as integers or booleans was cast to floats without a word, and evaluated and exported so
    other += [
        f"{name} stored as {kinds[name]} (its config builds floating-point weights)"
        for name, tensor in state.items()
        if name in kinds and tensor.is_floating_point() and not kinds[name].startswith(("F", "BF"))
    ]
    if missing or other:
        raise UserError(
            f"{weights}: weights do not match a {cls.type} drafter as its {CONFIG_NAME} builds it "
            f"(missing {missing[:3]}, other shapes or types: {other[:3]})"
        )
