"""A key given twice: in one mapping of a recipe file it is refused in one line naming the key and both lines,
before anything loads; on the command line overrides apply in order and the last wins, as in Hydra, so that a
script's defaults can come before what its user appends."""

from __future__ import annotations

import pytest

from draftsmith.errors import UserError
from draftsmith.recipe import load_recipe
from draftsmith.resources import recipes_dir


def test_on_the_command_line_the_last_value_of_a_key_and_the_last_recipe_win():
    assert load_recipe(["recipe=medusa"]).train.lr == 2e-3  # what recipes/medusa.yaml says
    assert load_recipe(["recipe=medusa", "train.lr=1e-3", "train.lr=5e-4"]).train.lr == 5e-4
    assert load_recipe(["recipe=medusa", "recipe=eagle3"]).drafter.type == "eagle3"


def test_a_recipe_file_giving_a_key_twice_in_one_mapping_is_refused_naming_it_and_its_lines(tmp_path):
    shipped = (recipes_dir() / "medusa.yaml").read_text()
    assert "\ntrain:\n  lr: 2e-3\n" in shipped
    line = shipped[: shipped.index("\ntrain:\n")].count("\n") + 3  # the line of train.lr
    doubled = tmp_path / "mine.yaml"
    doubled.write_text(shipped.replace("\ntrain:\n  lr: 2e-3\n", "\ntrain:\n  lr: 2e-3\n  lr: 1e-3\n"))
    with pytest.raises(UserError) as refused:
        load_recipe([f"recipe={doubled}"])
    lines = f"lines {line} and {line + 1}"
    assert str(refused.value) == f"recipe {doubled}: train.lr is given twice ({lines}): give it once"
    sections = tmp_path / "sections.yaml"  # a whole section given twice: the second would replace the first
    sections.write_text(shipped + "\ntrain:\n  max_steps: 5\n")
    with pytest.raises(UserError, match=r"sections.yaml: train is given twice \(lines \d+ and \d+\): give it once$"):
        load_recipe([f"recipe={sections}"])
