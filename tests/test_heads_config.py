"""The kinds' configs (heads/<kind>_config.py, heads/config.py) import no torch: the recipe's schema, `--help`
and the generated reference read them in the time they take, not the seconds torch takes to import; the drafters
(heads/<kind>.py) are imported on first use of the registry."""

from __future__ import annotations

import subprocess
import sys

from draftsmith.heads import CONFIGS, config_class, drafter_module, drafters


def test_the_schema_and_the_help_of_every_kind_import_no_torch():
    code = (
        "import sys; from omegaconf import OmegaConf; from draftsmith.heads import CONFIGS, config_class; "
        "from draftsmith.recipe_keys import render_markdown, render_text; "
        "[OmegaConf.structured(config_class(kind)) for kind in CONFIGS]; render_text(); render_markdown(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout


def test_every_config_is_its_drafters_and_names_the_module_beside_it():
    assert set(CONFIGS) == set(drafters())
    for kind, cls in drafters().items():
        assert config_class(kind) is cls.Config and drafter_module(cls.Config) == cls.__module__


def test_a_setting_left_unread_is_refused_where_a_recipe_builds_a_drafter_not_where_one_is_read():
    """A recipe giving P-EAGLE's mask token to a sequential EAGLE-3 is refused (`check_read`, from the recipe check of a
    command that builds a drafter); a saved drafter's config holding it, from before the refusal, loads as trained
    (`check` alone runs on a saved config)."""
    import pytest

    from draftsmith.errors import UserError
    from draftsmith.recipe import load_recipe

    with pytest.raises(UserError, match="drafter.mask_token_id=5 is read only with drafter.parallel_drafting=true"):
        load_recipe(["recipe=eagle3", "drafter.mask_token_id=5"])
    saved = config_class("eagle3")(mask_token_id=5)
    saved.check()  # what reading a saved drafter's config runs
    with pytest.raises(UserError, match="read only with drafter.parallel_drafting=true"):
        saved.check_read()
