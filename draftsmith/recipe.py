"""Recipes: `recipe=NAME` picks recipes/NAME.yaml, Hydra's `key=value` overrides change it, and a
typed schema checks every key and value before any work starts.

The same parser serves every entry point (train.py, python -m eval, data_prep jobs). Overrides use
Hydra's grammar (its override parser), applied to the YAML merged into a typed OmegaConf schema.
Not `@hydra.main`: that would change the working directory and own argv under `accelerate launch`
and `torchrun`, and any key of the schema must be overridable, not only those the YAML spells out.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional, Sequence

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from draftsmith.errors import UserError
from draftsmith.files import write_text_atomic

REPO_DIR = Path(__file__).resolve().parent.parent
RECIPES_DIR = REPO_DIR / "recipes"

# `${repo:demo/target}` in a recipe is a path inside this checkout, wherever the command runs from.
if not OmegaConf.has_resolver("repo"):
    OmegaConf.register_new_resolver("repo", lambda relative: str(REPO_DIR / relative))


@dataclass
class TargetSection:
    name_or_path: str = MISSING  # local directory or Hub id
    revision: Optional[str] = None
    dtype: str = "auto"  # auto (float32 on CPU, bfloat16 on GPU) | float32 | bfloat16 | float16
    trust_remote_code: bool = False


@dataclass
class CaptureSection:
    """`python -m data_prep.capture`: what to store from the target's forward over data.train.
    None means "what the recipe's drafter asks for" (its `features`)."""

    output: Optional[str] = None  # shard directory; default <output_dir>/features
    layers: Optional[List[int]] = None  # decoder-layer outputs (draftsmith.target's convention; -1 = embeddings)
    final: Optional[bool] = None  # last hidden state after the final norm
    logits: str = "auto"  # auto (topk if the drafter asks for logits, else none) | none | topk | full
    topk: int = 32  # entries kept per token when logits=topk
    dtype: str = "bfloat16"  # bfloat16 | float16 | float8 (e4m3 with a float32 scale per token)
    shard_tokens: int = 65536  # tokens per shard, approximately (shards hold whole conversations)


@dataclass
class RegenerateSection:
    """`python -m data_prep.regenerate`: data.train with every assistant turn rewritten by the target."""

    output: Optional[str] = None  # directory of part files; default <output_dir>/regenerated
    max_new_tokens: int = 256  # per assistant turn
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 8  # conversations generated together (left-padded)
    seed: int = 0


@dataclass
class DataSection:
    train: List[str] = field(default_factory=list)  # files (.jsonl, .jsonl.gz, .json, .parquet), globs or Hub ids
    eval: List[str] = field(default_factory=list)
    max_length: int = 1024  # tokens per conversation after the chat template
    overlong: str = "truncate"  # truncate | drop | error
    max_conversations: Optional[int] = None  # cap per source file, for quick runs
    cache_dir: Optional[str] = None  # tokenized-data cache; default ~/.cache/draftsmith
    features: Optional[str] = None  # a data_prep.capture directory to train from instead of running the target
    online: Optional[bool] = None  # run the frozen target inside each step; default: yes unless `features` is set
    capture: CaptureSection = field(default_factory=CaptureSection)
    regenerate: RegenerateSection = field(default_factory=RegenerateSection)


@dataclass
class TrainSection:
    lr: float = 1e-3
    max_steps: int = -1  # optimizer steps; -1 means run `epochs` epochs
    epochs: int = 1
    micro_batch_size: int = 8  # conversations per process per forward
    grad_accum: int = 1
    warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    save_every: int = 0  # steps between checkpoints; 0 = only the final one
    keep_checkpoints: int = 2  # older step checkpoints are deleted
    resume: Optional[str] = None  # true = latest checkpoint in output_dir, or a checkpoint path
    mixed_precision: str = "auto"  # auto (bf16 where the GPU supports it, else none) | no | bf16 | fp16
    num_workers: int = 0


@dataclass
class EvalSection:
    enabled: bool = True  # train.py runs the eval when training ends
    data: List[str] = field(default_factory=list)  # conversations; empty = data.eval
    max_prompts: int = 8  # per domain
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    num_speculative_tokens: int = 3  # chain length gamma
    tree: int = 0  # nodes in the static draft tree (0 = chain only)
    ngram_max: int = 3  # prompt-lookup baseline: longest n-gram to match
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    seed: int = 0


@dataclass
class RecipeSchema:
    drafter: Any = MISSING  # checked against the drafter type's own schema (heads registry)
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    output_dir: str = MISSING


CHOICES = {
    "target.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.overlong": ("truncate", "drop", "error"),
    "data.capture.logits": ("auto", "none", "topk", "full"),
    "data.capture.dtype": ("bfloat16", "float16", "float8"),
    "train.mixed_precision": ("auto", "no", "bf16", "fp16"),
}


def _one_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    # OmegaConf appends "full_key: ..., object_type=..." lines; the first line says what is wrong.
    head = text[0] if text else type(err).__name__
    full_key = next((line.split(":", 1)[1].strip() for line in text if line.startswith("full_key:")), "")
    return f"{head} (key: {full_key})" if full_key and full_key not in head else head


def recipe_path(name: str) -> Path:
    """`medusa` -> recipes/medusa.yaml; a path to a .yaml file is used as it is."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml"):
        path = candidate
    else:
        path = RECIPES_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
        raise UserError(f"recipe {name!r} not found ({path}); shipped recipes: {', '.join(known)}")
    return path.resolve()


def split_argv(argv: Sequence[str]) -> tuple[str, list[str]]:
    recipe, overrides = None, []
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        elif arg.startswith("-"):
            raise UserError(f"unexpected option {arg!r}: arguments are recipe=NAME and key=value overrides")
        elif "=" not in arg:
            raise UserError(f"argument {arg!r} is not key=value")
        else:
            overrides.append(arg)
    if recipe is None:
        raise UserError("no recipe given: pass recipe=NAME (a file in recipes/) or recipe=path/to/recipe.yaml")
    return recipe, overrides


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """Hydra's override grammar (`a.b=1`, `a.list=[x,y]`, `a.b=null`, quoting) into (key, value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parsed = []
    try:
        for override in OverridesParser.create().parse_overrides(list(overrides)):
            if override.is_delete() or override.is_add() or override.is_force_add():
                raise UserError(f"override {override.input_line!r}: only plain key=value is supported (no +, ++ or ~)")
            if override.is_sweep_override():
                raise UserError(f"override {override.input_line!r}: sweeps are not supported")
            parsed.append((override.key_or_group, override.value()))
    except HydraException as err:
        raise UserError(f"cannot parse override: {' '.join(str(err).split())}") from None
    return parsed


def compose(recipe: str, overrides: Sequence[str]) -> DictConfig:
    """Read a recipe, merge it into the typed schema, apply overrides; raise UserError on any misfit.

    Unknown keys, values of the wrong type and missing required values are all caught here, before
    any model or data is touched.
    """
    from heads import drafter_class  # the drafter section's schema belongs to the drafter type

    path = recipe_path(recipe)
    parsed = parse_overrides(overrides)
    try:
        raw = OmegaConf.load(path)
    except Exception as err:  # YAML syntax errors come from the yaml parser
        raise UserError(f"recipe {path}: not valid YAML ({' '.join(str(err).split())[:200]})") from None
    if not isinstance(raw, DictConfig):
        raise UserError(f"recipe {path}: top level must be a mapping of sections")
    drafter_type = dict(parsed).get("drafter.type", OmegaConf.select(raw, "drafter.type"))
    if drafter_type is None:
        raise UserError(f"recipe {path}: no drafter.type")
    try:
        schema = OmegaConf.structured(RecipeSchema)
        schema.drafter = OmegaConf.structured(drafter_class(str(drafter_type)).Config)
        cfg = OmegaConf.merge(schema, raw)
        for key, value in parsed:
            node_is_list = isinstance(OmegaConf.select(cfg, key, throw_on_missing=False), ListConfig)
            if node_is_list and isinstance(value, str):
                value = [value]  # `data.train=file.jsonl` means a list of one file
            if OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False) is _ABSENT:
                raise UserError(f"unknown recipe key {key!r} (override {key}={value})")
            try:
                OmegaConf.update(cfg, key, value, merge=False)
            except OmegaConfBaseException as err:
                raise UserError(f"override {key}={value!r}: {_one_line(err)}") from None
    except OmegaConfBaseException as err:
        raise UserError(f"invalid recipe {path.name}: {_one_line(err)}") from None
    return cfg


_ABSENT = object()


def validate(cfg: DictConfig) -> DictConfig:
    """Check that required values are set and choices are known; resolve interpolations."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise UserError(f"missing required value(s): {', '.join(missing)}")
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise UserError(f"invalid recipe: {_one_line(err)}") from None
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(cfg, key)
        if value not in allowed:
            raise UserError(f"{key}={value!r} is not one of {', '.join(allowed)}")
    if cfg.data.online is True and cfg.data.features is not None:
        raise UserError("data.online=true and data.features are both set: train from the target or from captured features")
    if cfg.data.online is False and cfg.data.features is None:
        raise UserError("data.online=false needs data.features=<a data_prep.capture directory>")
    OmegaConf.set_readonly(cfg, True)
    return cfg


def load_recipe(argv: Sequence[str]) -> DictConfig:
    """Parse `recipe=NAME key=value ...` into a validated, read-only config."""
    recipe, overrides = split_argv(argv)
    return validate(compose(recipe, overrides))


def save_recipe(cfg: DictConfig, directory: str | os.PathLike) -> Path:
    """Write the resolved recipe as recipe.yaml in `directory` (atomically)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "recipe.yaml"
    write_text_atomic(path, OmegaConf.to_yaml(cfg, resolve=True))
    return path


def resolve_bool_or_path(value: Optional[str]) -> Optional[str]:
    """`train.resume`: None/false -> None, true -> 'latest', anything else is a path."""
    if value is None or str(value).lower() in ("false", "none", ""):
        return None
    if str(value).lower() == "true":
        return "latest"
    return str(value)
