"""What a resumed run keeps as it began, checked before any data or model loads (trainer/setup.py `set_up`): the
start it began from, the settings its saved state holds or counts in, and its data, by the bytes it read as it began
(DATA_CONTENT_NAME, written beside its recipe.yaml)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from draftsmith.data_prep.features import MANIFEST_NAME
from draftsmith.data_prep.local_files import local_content
from draftsmith.errors import UserError, one_line
from draftsmith.files import file_sha256, read_json, write_json
from draftsmith.outputs import DATA_CONTENT_NAME, RECIPE_NAME
from draftsmith.recipe import derived
from draftsmith.recipe_schema import RecipeSchema
from draftsmith.target import TargetShape

log = logging.getLogger("draftsmith.train")


def resumed_start(cfg: DictConfig, output_dir: Path) -> DictConfig:
    """A resumed run keeps the start it began from (its recipe.yaml's train.init_from), and the
    recipe.yaml it writes again names that start: the resumed weights are the checkpoint's, so another
    train.init_from is not read, and says so (the monitor's retraining may name its start anew)."""
    saved = output_dir / RECIPE_NAME
    try:
        began = OmegaConf.load(saved).train.get("init_from") if saved.is_file() else None
    except Exception as err:  # the yaml parser's errors, or a file that is not a recipe
        raise UserError(
            f"{saved} is not the run's recipe ({one_line(err, 200)}): restore it, or start over with "
            "train.overwrite=true"
        ) from None
    if cfg.train.init_from and str(cfg.train.init_from) != str(began):
        log.warning(
            "train.init_from=%s is not read: this run began from %s (its recipe.yaml) and resumes from its checkpoint",
            cfg.train.init_from,
            began or "scratch",
        )
    return derived(cfg, {"train.init_from": began}) if str(cfg.train.init_from) != str(began) else cfg


# What a resumed run must keep as it began: the optimizer's settings, which its saved state restores over the
# recipe's, the schedule's length and warm-up (the saved optimizer holds the rate the old schedule set for the next
# step, then the new schedule's takes over mid-run), and what decides the conversations and their order, which the
# saved data position counts in.
RESUMED_AS_BEGUN = (
    "train.lr", "train.optimizer", "train.weight_decay", "train.adam_betas", "train.max_steps", "train.epochs",
    "train.warmup_steps", "train.seed", "train.heldout", "data.train", "data.max_length", "data.overlong",
    "data.max_conversations", "data.skip_invalid_utf8", "data.thinking", "data.features", "data.draft_vocab",
)  # fmt: skip


# The RESUMED_AS_BEGUN keys that name local data by path: the same bytes under another path (a clone's copy of
# demo/, a relative path for an absolute one) are the run's data, so these compare by content where paths differ
DATA_PATHS = ("data.train", "data.draft_vocab", "data.features")


def data_content(key: str, value, digests: Optional[dict[str, str]] = None) -> Any:
    """What the DATA_PATHS `key`'s `value` reads: the sha256 of each file, in order, a Hub or named data set by its
    name (`local_content`, which takes those the start's load read from `digests`); a capture by its manifest's
    sha256 (which holds every shard's). None where unset, or where local data cannot be read here (a path moved
    away), whose content is not known."""
    if value is None:
        return None
    if key == "data.features":
        manifest = Path(value).expanduser() / MANIFEST_NAME
        return file_sha256(manifest) if manifest.is_file() else None
    return local_content(value, digests)


def record_data_content(cfg: DictConfig, output_dir: Path, digests: Optional[dict[str, str]] = None) -> None:
    """Write what the run's data settings read as it begins (DATA_CONTENT_NAME), for its resumes to compare with:
    the files' sha256 as the start's load read them (`digests`), each file not read again."""
    settings = {key: OmegaConf.select(cfg, key, default=None) for key in DATA_PATHS}
    content = {
        key: data_content(key, OmegaConf.to_container(value) if OmegaConf.is_config(value) else value, digests)
        for key, value in settings.items()
    }
    write_json(output_dir / DATA_CONTENT_NAME, content)


def same_local_data(key: str, began, now) -> bool:
    """Whether the DATA_PATHS `key`'s values `began` and `now` read the same bytes today, file for file in order;
    false where either cannot be read here (a path moved away), whose content is not known."""
    content = data_content(key, began)
    return content is not None and content == data_content(key, now)


def data_changed(key: str, began, now, began_with: Optional[dict]) -> Optional[str]:
    """Why the DATA_PATHS `key`'s value `now` is not the data the run began with (`began`: its recipe.yaml's), in
    words for the refusal, or None. With the run's record of what it read (`began_with`, DATA_CONTENT_NAME), the
    same bytes resume under any path, and the same path whose bytes changed since is refused (it would train other
    conversations from the saved position); without it (a run begun before draftsmith recorded it), another path
    resumes where it reads the same bytes as the run's path today."""
    recorded = None if began_with is None else began_with.get(key)
    if recorded is not None:
        content = data_content(key, now)
        if content == recorded:
            if began != now:
                log.info("%s=%s reads the bytes the run began with (%s)", key, json.dumps(now), json.dumps(began))
            return None
        if began == now and content is not None:
            return (
                "the run's value, whose bytes changed since the run began: it would train other conversations from "
                "the saved position"
            )
    elif began != now and same_local_data(key, began, now):
        log.info("%s=%s reads the bytes %s holds today", key, json.dumps(now), json.dumps(began))
        return None
    return None if began == now else f"the run began with {json.dumps(began)}"


def require_resumed_as_begun(cfg: DictConfig, output_dir: Path) -> None:
    """One line naming each RESUMED_AS_BEGUN key the resuming recipe changes from the run's recipe.yaml (a value
    given anew was ignored, or trained other conversations from the saved position, without a word); its data by
    the bytes the run began with where it recorded them (`data_changed`)."""
    if not (output_dir / RECIPE_NAME).is_file():  # a checkpoint given by path, of a run elsewhere
        return
    saved = OmegaConf.load(output_dir / RECIPE_NAME)  # read by resumed_start just before
    record = output_dir / DATA_CONTENT_NAME
    advice = "restore it, or remove it to compare the data with what the run's paths hold today"
    began_with = read_json(record, "record of the run's data", advice) if record.is_file() else None
    # a key an earlier draftsmith did not write (data.thinking, train.optimizer) was its default
    defaults = OmegaConf.structured(RecipeSchema)
    changed = []
    for key in RESUMED_AS_BEGUN:
        began = OmegaConf.select(saved, key, default=OmegaConf.select(defaults, key))
        now = OmegaConf.select(cfg, key, default=None)
        began, now = (OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for v in (began, now))
        if key in DATA_PATHS:
            why = data_changed(key, began, now, began_with)
        else:
            why = None if began == now else f"the run began with {json.dumps(began)}"
        if why is not None:
            changed.append(f"{key}={json.dumps(now)} ({why})")
    if changed:
        raise UserError(
            f"train.resume continues the run in {output_dir} as it began, and this recipe changes {'; '.join(changed)}"
            ": resume with the run's values and data, or start a new run from its checkpoint with train.init_from"
        )


def require_same_commit(begun_on: TargetShape, loaded: TargetShape, resumed_what: str) -> None:
    """A run resumes on the Hub commit of the target it began on: another commit of the repository (its main moved
    since) may compute otherwise with the same weights (a config value changed), which the weights' records miss."""
    if begun_on.revision and loaded.revision and begun_on.revision != loaded.revision:
        raise UserError(
            f"{resumed_what} began on commit {begun_on.revision} of target {begun_on.name_or_path!r}, and the target "
            f"now loads commit {loaded.revision}: give target.revision={begun_on.revision} to resume it as begun"
        )


def require_trained_as_begun(saved, recipe, what: str) -> None:
    """The drafter settings of how the run trains (its DrafterConfig.SETTINGS but those that set only how it decodes,
    SERVED) are the checkpoint's `saved` ones: another training-time-test depth or loss would go on from the run's
    weights and record itself as the whole run's, without a word (a warm start, train.init_from, may change them)."""
    changed = [
        f"drafter.{key}={json.dumps(getattr(recipe, key), default=str)} (the run began with "
        f"{json.dumps(getattr(saved, key), default=str)})"
        for key in type(recipe).SETTINGS
        if key not in type(recipe).SERVED and getattr(saved, key, None) != getattr(recipe, key)
    ]
    if changed:
        raise UserError(
            f"train.resume continues the run of {what} as it trained, and this recipe changes {'; '.join(changed)}: "
            "resume with the run's values, or start a new run from its checkpoint with train.init_from"
        )
