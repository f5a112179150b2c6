"""Recipes: `recipe=NAME` picks recipes/NAME.yaml, Hydra's `key=value` overrides change it (in order: a key
given twice takes its last value, as in Hydra, so that a script's defaults come before the user's), and a typed
schema checks every key and value before any work starts.

The same parser serves every entry point (train.py, python -m eval, data_prep jobs). Overrides use
Hydra's grammar (its override parser), applied to the YAML merged into a typed OmegaConf schema.
Not `@hydra.main`: that would change the working directory and own argv under `accelerate launch`
and `torchrun`, and any key of the schema must be overridable, not only those the YAML spells out.
The inputs (the command line, the file, the resolvers) are read in draftsmith.recipe_input.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import pickle
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from draftsmith.errors import UserError, one_line
from draftsmith.files import cannot_read, write_text_atomic
from draftsmith.outputs import FINAL_DIR, RECIPE_NAME
from draftsmith.recipe_checks import (
    check_data,
    check_eval,
    check_export,
    check_finite_settings,
    check_inputs,
    check_monitor,
    check_outputs,
    require,
    resolve_bool_or_path,
    unset_keys,
)
from draftsmith.recipe_input import (
    closest_key,
    expand_home,
    invalid_recipe,
    not_yaml,
    omegaconf_error_line,
    open_null_sections,
    parse_overrides,
    recipe_path,
    register_resolvers,
    require_plain_yaml,
    split_argv,
)
from draftsmith.recipe_schema import CHOICES, RecipeSchema, TrainSection
from draftsmith.train_checks import check_train

if TYPE_CHECKING:
    from draftsmith.target import TargetShape

# draftsmith.target, .sharding and the drafter classes import torch (seconds): imported where used, after the read


@functools.lru_cache(maxsize=32)
def parsed_recipe(path: str, text: str) -> DictConfig:
    """The recipe file `path` holding `text`, parsed (a test process or a monitor composes one recipe hundreds of
    times: YAML's pure-Python parser twice a time was a sixth of the time a recipe took); UserError on what is not
    a mapping of sections, or names a key twice. Callers copy what they change."""
    require_plain_yaml(path, text)
    try:
        raw = OmegaConf.create(text)
    except Exception as err:  # noqa: BLE001 - what OmegaConf refuses of YAML yaml reads
        raise not_yaml(path, err) from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"recipe {path}: top level must be a mapping of sections")
    return raw


def compose(recipe: str, overrides: Sequence[str]) -> DictConfig:
    """Read a recipe, merge it into the typed schema, apply overrides; raise UserError on any misfit.

    Unknown keys, values of the wrong type and missing required values are all caught here, before
    any model or data is touched.
    """
    register_resolvers()
    path = recipe_path(recipe)
    parsed = parse_overrides(overrides)
    try:
        text = path.read_text(encoding="utf-8")
    except PermissionError:
        raise cannot_read(path) from None
    except UnicodeDecodeError as err:
        raise UserError(f"recipe {path}: not UTF-8 text, so no YAML ({one_line(err)})") from None
    for old, now in RENAMED.items():
        if old in dict(parsed):
            raise UserError(f"{old} is now the recipe key {now}: rename it in the override {old}=...")
    raw = file_sections(str(path), text)
    drafter_type = dict(parsed).get("drafter.type", OmegaConf.select(raw, "drafter.type"))
    if drafter_type is None:
        raise UserError(f"recipe {path}: no drafter.type")
    cfg = pickle.loads(on_schema(str(path), text, str(drafter_type)))  # a fresh copy, changed below
    try:
        for key, value in parsed:
            open_null_sections(cfg, key, value)
            try:  # a required key the recipe file leaves out (output_dir) is there, unset: select's default is
                # for a key that is not
                current = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=True)
            except OmegaConfBaseException:  # unset, or `${package:...}` not installed here: the override sets it
                current = None
            if isinstance(current, ListConfig) and isinstance(value, str):
                value = [value]  # `data.train=file.jsonl` means a list of one file
            if current is _ABSENT:
                raise UserError(f"unknown recipe key {key!r} (override {key}={value}){closest_key(cfg, key)}")
            if isinstance(current, DictConfig):  # `target=Qwen/Qwen3-8B`: OmegaConf's line names a schema class
                inside = [f"{key}.{name}" for name in current]
                shown = ", ".join(inside[:3]) + (", ..." if len(inside) > 3 else "")
                raise UserError(f"override {key}={value}: {key} is a section, not one value: set its keys ({shown})")
            try:
                OmegaConf.update(cfg, key, value, merge=False)
            except OmegaConfBaseException as err:
                raise UserError(f"override {key}={value!r}: {omegaconf_error_line(err)}") from None
        expand_home(cfg)
        given = dict(parsed)
        if "train.max_steps" in given and "train.epochs" not in given and str(given["train.max_steps"]) != "-1":
            # the command line sets the run's length: the recipe file's epochs is not read, and the saved recipe
            # says so (a recipe's or a command line's epochs beside a max_steps is refused: recipe_checks)
            cfg.train.epochs = TrainSection.epochs
    except OmegaConfBaseException as err:  # a key the file misspells: told the closest, as an override's
        raise invalid_recipe(path, cfg, raw, drafter_type, err) from None
    return cfg


@functools.lru_cache(maxsize=32)
def file_sections(path: str, text: str) -> DictConfig:
    """The recipe file `path` holding `text`, its sections checked and the keys an earlier draftsmith read removed
    (shared: callers only read it)."""
    raw = copy.deepcopy(parsed_recipe(path, text))  # the parse is shared too
    for name in RECIPE_SECTIONS:  # a list or a number where a section belongs: one line, not OmegaConf's
        if raw.get(name) is not None and not isinstance(raw[name], DictConfig):
            given = OmegaConf.to_container(raw[name]) if OmegaConf.is_config(raw[name]) else raw[name]
            raise UserError(f"recipe {path}: {name} must be a mapping of keys, not {given!r}")
    for old, now in RENAMED.items():
        section, key = old.split(".")
        if OmegaConf.select(raw, old, default=None) is not None:
            raise UserError(f"{old} is now the recipe key {now}: rename it in recipe {path}")
        if isinstance(raw.get(section), DictConfig) and key in raw[section]:  # null in a run's saved recipe
            del raw[section][key]
    return raw


@functools.lru_cache(maxsize=32)
def on_schema(path: str, text: str, drafter_type: str) -> bytes:
    """The recipe file `path` holding `text` merged into the schema, its drafter section `drafter_type`'s, before any
    override (a test process or a monitor composes one recipe hundreds of times: the schema's build and the merge were
    half of each composition). Pickled: a fresh copy unpickles in a tenth of deepcopy's time (0.7 ms against 6.5);
    the bytes are this process's own, never read from a file."""
    from draftsmith.heads import config_class  # the drafter section's schema belongs to the drafter type

    raw = file_sections(path, text)
    cfg = OmegaConf.structured(RecipeSchema)
    try:
        cfg.drafter = OmegaConf.structured(config_class(drafter_type))
        cfg.merge_with(raw)
    except OmegaConfBaseException as err:
        raise invalid_recipe(Path(path), cfg, raw, drafter_type, err) from None
    return pickle.dumps(cfg)


_ABSENT = object()
# the recipe's sections: its drafter (a kind's own schema) and each typed section of the schema
SCHEMA_TYPES = typing.get_type_hints(RecipeSchema)
RECIPE_SECTIONS = ("drafter", *(name for name, kind in SCHEMA_TYPES.items() if dataclasses.is_dataclass(kind)))


# Keys an earlier draftsmith read, and the key that means the same now: one line instead of "unknown key".
RENAMED = {"drafter.path": "checkpoint", "monitor.deployed": "checkpoint"}


def require_draft_vocab_use(cfg: DictConfig, config, target: Optional[TargetShape]) -> None:
    """data.draft_vocab only for a drafter that picks a pruned draft vocabulary: anywhere else it
    would be ignored."""
    from draftsmith.heads import drafter_class

    require(
        not cfg.data.draft_vocab or drafter_class(cfg.drafter.type).picks_draft_vocab(config, target),
        f"data.draft_vocab is set, but the {cfg.drafter.type} drafter with these settings for this target "
        "has no pruned draft vocabulary to pick; remove it",
    )


def checkpoint_to_read(cfg: DictConfig) -> Path:
    """The drafter eval and export read: `checkpoint=`, else `<output_dir>/final`, where train writes."""
    return Path(cfg.checkpoint or Path(cfg.output_dir) / FINAL_DIR)


# the commands that read their drafter from `checkpoint` and never build one from the recipe's drafter section
# (which names the kind only there); the monitor does too unless it retrains (its run trains the section)
READS_CHECKPOINT = ("eval", "export", "sweep")


def builds_drafter(command: str, cfg: DictConfig) -> bool:
    """Whether `command` builds a drafter from the recipe's drafter section, which is then checked against the
    target; a command that reads `checkpoint` checks the eval's chain against the checkpoint's settings."""
    return command not in READS_CHECKPOINT and not (command == "monitor" and not cfg.monitor.retrain)


def check_drafter(cfg: DictConfig, command: str = "train") -> None:
    """The drafter type's own check of its section, against the target's shape when the target is a
    local directory (its config.json, not its weights); and the eval's chain length against what the
    drafter can propose. For a command that reads `checkpoint` (`builds_drafter`), the chain against the
    checkpoint's own settings (an engine folder's, or a missing one's, its reader checks)."""
    from draftsmith.causal_lm import not_a_causal_lm
    from draftsmith.families import unserved_clamp
    from draftsmith.heads import drafter_class, drafters
    from draftsmith.heads.base import saved_drafter
    from draftsmith.target import local_target_config, local_target_shape, names_a_missing_folder

    drafter_cls = drafter_class(cfg.drafter.type)
    try:
        config = OmegaConf.to_object(cfg.drafter)
    except OmegaConfBaseException as err:
        raise UserError(f"invalid drafter section: {omegaconf_error_line(err)}") from None
    for key in drafter_cls.Config.RESOLVED:  # a value here was replaced (train) or compared with the folder's
        require(
            getattr(config, key, None) is None,
            f"drafter.{key} is filled from the target when a drafter is built, and read from the checkpoint "
            "otherwise, never from the recipe: leave it out",
        )
    require(
        not names_a_missing_folder(cfg.target.name_or_path),
        f"target.name_or_path={cfg.target.name_or_path}: no such folder (a Hub id reads owner/name)",
    )
    # every command loads the target (eval, export and monitor too, for their eval): its class is known now
    target_config = local_target_config(cfg.target.name_or_path) if cfg.target.gguf_file is None else None
    if target_config is not None and (refusal := not_a_causal_lm(target_config, cfg.target.name_or_path)):
        raise UserError(refusal)
    if target_config is not None and (refusal := unserved_clamp(target_config, cfg.target.name_or_path)):
        raise UserError(refusal)
    if builds_drafter(command, cfg) and cfg.train.compile_drafter and drafter_cls.COMPILED_BLOCKS is None:
        offered = sorted(name for name, kind in drafters().items() if kind.COMPILED_BLOCKS is not None)
        raise UserError(
            f"train.compile_drafter=true compiles a drafter's repeated blocks; a {drafter_cls.type} drafter offers "
            f"none (the kinds that do: {', '.join(offered)}); drop it"
        )
    if not builds_drafter(command, cfg):
        try:
            saved = saved_drafter(checkpoint_to_read(cfg))[:2]
        except UserError:  # an engine folder, or none yet: the command reads it, and says what it is not
            return
        if saved[0].type == cfg.drafter.type:  # of another kind, the command refuses it, naming both
            check_chain(cfg, *saved)
        return
    if cfg.target.gguf_file is not None:
        from draftsmith.gguf import header_shape

        shape = header_shape(cfg.target.name_or_path, cfg.target.gguf_file)
    else:
        shape = local_target_shape(cfg.target.name_or_path)
    config.check(shape)
    if resolve_bool_or_path(cfg.train.resume) is None:  # a resumed run's recipe is its own (resume_checks)
        config.check_read()
    ahead = config.POSITIONS_AHEAD
    positions = getattr(config, ahead) if ahead else 0
    require(
        positions <= cfg.data.max_length - 2,
        f"drafter.{ahead}={positions} scores tokens past any row of data.max_length={cfg.data.max_length}: set it to "
        f"{cfg.data.max_length - 2} or less",
    )
    require_draft_vocab_use(cfg, config, shape)
    check_chain(cfg, drafter_cls, config)


def check_chain(cfg: DictConfig, drafter_cls, config) -> None:
    """The eval's tree and chain length, and the export's γ, against what a drafter of `config` can propose."""
    require(
        cfg.eval.tree == 0 or drafter_cls.proposes_trees(config),
        f"eval.tree={cfg.eval.tree} but this {drafter_cls.type} drafter, as configured, "
        "proposes chains only: set eval.tree=0",
    )
    longest = drafter_cls.max_chain(config)
    gamma = cfg.eval.num_speculative_tokens
    require(
        longest is None or gamma <= longest,
        f"eval.num_speculative_tokens={gamma} but a {drafter_cls.type} drafter with this config "
        f"proposes at most {longest} token{'s' if longest != 1 else ''}",
    )
    # the export's γ, when given, is the served one (export/run.py serving_gamma): refused now, not once the
    # target has loaded
    served = cfg.export.num_speculative_tokens
    require(
        longest is None or served is None or served <= longest,
        f"export.num_speculative_tokens={served} but this {drafter_cls.type} drafter proposes at most {longest}; "
        f"set export.num_speculative_tokens to {longest} or less",
    )


def validate(cfg: DictConfig, command: str = "train") -> DictConfig:
    """Check every value before any model or data is touched: required values set, choices known,
    interpolations resolved, each section's ranges, the drafter's own settings (as `command` uses them), the
    output directories."""
    try:
        missing = unset_keys(cfg)
        if not missing:
            OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        cause = err.__context__  # a resolver's own message (`${package:...}` not installed), however deep
        while cause is not None and not isinstance(cause, UserError):
            cause = cause.__context__
        if cause is not None:
            raise cause from None
        raise UserError(f"invalid recipe: {omegaconf_error_line(err)}") from None
    if missing:
        raise UserError(f"missing required value(s): {', '.join(missing)}")
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    check_finite_settings(OmegaConf.to_container(cfg))
    check_train(cfg.train, cfg.data, trains=builds_drafter(command, cfg))
    check_data(cfg.data)
    check_eval(cfg.eval)
    check_export(cfg.export)
    check_monitor(cfg.monitor)
    check_outputs(cfg, tokenizes=builds_drafter(command, cfg))  # the commands that read a checkpoint tokenize none
    check_inputs(cfg)
    check_drafter(cfg, command)
    from draftsmith.sharding import check_shard

    check_shard(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg


def validated(argv: Sequence[str], command: str = "train") -> DictConfig:
    """`recipe=NAME key=value ...` composed and validated for `command`, nothing loaded or converted (what
    `--cfg` prints)."""
    return validate(compose(*split_argv(argv)), command)


def load_recipe(argv: Sequence[str], command: str = "train") -> DictConfig:
    """Parse `recipe=NAME key=value ...` into a config validated for `command` (`check_drafter`), read-only,
    whose target is a local directory or a Hub id (`with_local_target`) and whose engine Pythons are absolute
    paths (`with_engine_pythons`)."""
    return with_engine_pythons(with_local_target(validated(argv, command), command), command)


def load_train_recipe(argv: Sequence[str]) -> DictConfig:
    """`load_recipe` for a training run, which reads no `checkpoint` (`check_train_start`, before the target
    is touched)."""
    cfg = validated(argv)
    check_train_start(cfg)
    return with_engine_pythons(with_local_target(cfg))


def check_train_start(cfg: DictConfig) -> None:
    """A training run starts from train.init_from, a local folder that exists (checked before any data or model
    loads, unless the run resumes), and has the eval stage's prompts when eval.enabled. `checkpoint` names the
    drafter the read-only commands read: were it a run's start, the run's saved recipe would point eval and export
    at the start."""
    require(
        cfg.checkpoint is None,
        f"checkpoint={cfg.checkpoint} names the drafter eval, export and monitor read, not a training run's start: "
        f"to warm-start from it, pass train.init_from={cfg.checkpoint}",
    )
    # the eval stage after training reads its prompts there: refused now, not once the run has trained
    require(
        not cfg.eval.enabled or bool(cfg.eval.data or cfg.data.eval),
        "no eval data: eval.enabled=true reports on eval.data or data.eval after training, and both are empty: "
        "set eval.data=[files] or data.eval in the recipe, or eval.enabled=false",
    )
    resumed = resolve_bool_or_path(cfg.train.resume) is not None  # its recipe is its own: checked as it began
    require(  # the folder was read, and the run's and its report's recipes recorded the revision as if applied
        resumed or cfg.target.revision is None or not Path(str(cfg.target.name_or_path)).expanduser().is_dir(),
        f"target.revision={cfg.target.revision} names a revision of a Hub repository, and target.name_or_path is the "
        f"local folder {cfg.target.name_or_path}, which has none: leave target.revision out",
    )
    start = cfg.train.init_from
    if start is None or resumed:
        return  # a resumed run does not read its start again (trainer/setup.py resumed_start)
    folder = Path(start).expanduser()
    require(
        folder.exists(),
        f"train.init_from={start} does not exist: give a drafter checkpoint or an exported drafter folder",
    )
    # what the folder holds is the trainer's to check (formats.folder.require_drafter_folder), before any load


def with_local_target(cfg: DictConfig, command: str = "train") -> DictConfig:
    """A GGUF target dequantized once (draftsmith.gguf), after validation: the recipe names the converted
    directory from then on (a run's saved recipe loads it, not the file)."""
    if cfg.target.gguf_file is None:
        return cfg
    from draftsmith.gguf import materialize

    directory = materialize(cfg.target.name_or_path, cfg.target.gguf_file, cfg.target.revision)
    return derived(cfg, {"target.name_or_path": str(directory), "target.gguf_file": None}, command)


# the keys naming the Python of an engine's environment
ENGINE_PYTHONS = ("export.vllm_python", "data.capture.vllm.python", "data.regenerate.vllm.python")


def with_engine_pythons(cfg: DictConfig, command: str = "train") -> DictConfig:
    """Each engine Python read as a shell reads a program, once: a bare name (`python3`) the program PATH finds, a path
    from the current directory, either made absolute (not resolved: a venv's python is a link that works under its own
    path). Every command then runs the same program, and a run's saved recipe names it from any directory; a name
    PATH lacks is one line."""
    import shutil

    changes = {}
    for key in ENGINE_PYTHONS:
        setting = OmegaConf.select(cfg, key)
        if setting is None:
            continue
        found = str(Path(setting).expanduser().absolute()) if os.sep in setting else shutil.which(setting)
        if found is None:
            raise UserError(f"{key}={setting!r}: no program of that name on PATH (give the path of a Python)")
        if found != setting:
            changes[key] = found
    return derived(cfg, changes, command) if changes else cfg


def derived(cfg: DictConfig, changes: dict[str, Any], command: str = "train") -> DictConfig:
    """A copy of a validated recipe with the dotted keys in `changes` set, validated again for `command` (a job
    that runs another job, like the monitor's retraining, runs a variant of the user's recipe)."""
    import copy

    variant = copy.deepcopy(cfg)
    OmegaConf.set_readonly(variant, False)
    for key, value in changes.items():
        try:
            OmegaConf.update(variant, key, value, merge=False)
        except OmegaConfBaseException as err:
            raise UserError(f"{key}={value!r}: {omegaconf_error_line(err)}") from None
    return validate(variant, command)


def save_recipe(cfg: DictConfig, directory: str | os.PathLike) -> Path:
    """Write the resolved recipe as recipe.yaml in `directory` (atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / RECIPE_NAME
    write_text_atomic(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path
