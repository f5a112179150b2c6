"""Recipes: every shipped recipe and launch config is valid; bad keys and values are one-line errors."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from draftsmith.errors import UserError
from draftsmith.recipe import RECIPES_DIR, load_recipe, save_recipe
from tests.conftest import REPO, run_entry

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
LAUNCH_CONFIGS = sorted((RECIPES_DIR / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_validates(name):
    cfg = load_recipe([f"recipe={name}"])
    assert cfg.drafter.type and cfg.target.name_or_path and cfg.output_dir


@pytest.mark.parametrize("path", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_every_launch_config_loads_in_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    assert config.num_processes >= 1
    if "deepspeed" in path.name:
        stage = int(path.stem[-1])
        assert config.distributed_type.value == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == stage


def test_overrides_are_typed_and_cover_schema_defaults():
    cfg = load_recipe(["recipe=medusa", "train.lr=1e-4", "train.resume=true", "eval.data=x.jsonl", "drafter.num_heads=4"])
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.train.resume == "True"  # a schema default the YAML never mentions is still overridable
    assert list(cfg.eval.data) == ["x.jsonl"]  # one file for a list key means a list of one
    assert cfg.drafter.num_heads == 4
    assert Path(cfg.target.name_or_path) == REPO / "demo" / "target"  # ${repo:...} resolved


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("train.nope=1", "unknown recipe key 'train.nope'"),
        ("drafter.bogus=1", "unknown recipe key 'drafter.bogus'"),
        ("train.lr=fast", "train.lr"),
        ("train.max_steps=2.5", "train.max_steps"),
        ("drafter.type=nope", "unknown drafter.type 'nope'"),
        ("target.dtype=int4", "target.dtype='int4'"),
        ("+train.extra=1", "only plain key=value"),
        ("train.lr=[1", "cannot parse override"),
    ],
)
def test_bad_overrides_are_user_errors(override, fragment):
    with pytest.raises(UserError, match=None) as info:
        load_recipe(["recipe=medusa", override])
    assert fragment in str(info.value)


def test_missing_required_value(tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(yaml.safe_dump({"drafter": {"type": "medusa"}, "output_dir": "x"}))
    with pytest.raises(UserError, match="target.name_or_path"):
        load_recipe([f"recipe={recipe}"])


def test_resolved_recipe_is_saved_and_reloads(tmp_path):
    cfg = load_recipe(["recipe=medusa", "train.max_steps=7"])
    path = save_recipe(cfg, tmp_path)
    assert OmegaConf.load(path).train.max_steps == 7
    again = load_recipe([f"recipe={path}"])
    assert OmegaConf.to_container(again) == OmegaConf.to_container(cfg)


@pytest.mark.parametrize(
    "args",
    [
        ["recipe=medusa", "train.nope=1"],
        ["recipe=does_not_exist"],
        ["train.lr=1"],
        ["recipe=medusa", "data.train=[/nonexistent/file.jsonl]"],
    ],
    ids=["unknown-key", "unknown-recipe", "no-recipe", "missing-data"],
)
def test_train_py_bad_input_is_one_line_exit_2(tmp_path, args):
    out = tmp_path / "run"
    result = run_entry(["train.py", *args, f"output_dir={out}"], timeout=120)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists(), "a failed start must not leave a half-written output_dir"


def test_online_and_features_are_exclusive():
    assert load_recipe(["recipe=medusa", "data.online=true"]).data.online is True
    assert load_recipe(["recipe=medusa", "data.features=/x", "data.online=false"]).data.features == "/x"
    with pytest.raises(UserError, match="both set"):
        load_recipe(["recipe=medusa", "data.features=/x", "data.online=true"])
    with pytest.raises(UserError, match="needs data.features"):
        load_recipe(["recipe=medusa", "data.online=false"])
