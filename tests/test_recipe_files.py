"""A user's own recipe file of the wrong shape is one line naming the file and what is wrong, before anything loads
(a section given as a list was an internal error). A key given twice: in one mapping of a recipe file it is refused
naming the key and both lines; on the command line overrides apply in order and the last wins, as in Hydra, so that
a script's defaults can come before what its user appends."""

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


def test_a_recipe_whose_aliases_expand_past_any_recipe_is_refused_and_a_few_aliases_read(tmp_path):
    """YAML's billion laughs (ten aliases of ten aliases, nine deep: 1 KB) pinned a core for good while the recipe
    was read (four deep took 29 s): aliases expanding past 100,000 values are one line, at once; a few read."""
    import time

    shipped = (recipes_dir() / "medusa.yaml").read_text()
    laughs = ["  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(shipped + "\nlaughs:\n" + "\n".join(laughs) + "\n")
    started = time.monotonic()
    with pytest.raises(UserError, match=r"bomb.yaml: its YAML aliases expand to more than 100,000 values: write them"):
        load_recipe([f"recipe={bomb}"])
    assert time.monotonic() - started < 10
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text(shipped.replace("\ntrain:\n  lr: 2e-3\n", "\ntrain:\n  lr: &lr 2e-3\n  weight_decay: *lr\n"))
    assert load_recipe([f"recipe={aliased}"]).train.weight_decay == 2e-3


@pytest.mark.parametrize(
    "text, message",
    [
        ("drafter: [1, 2]\n", "drafter must be a mapping of keys, not [1, 2]"),
        ("drafter: 5\n", "drafter must be a mapping of keys, not 5"),
        ("drafter: {type: medusa}\ntrain: [1]\n", "train must be a mapping of keys, not [1]"),
        ("drafter: {type: medusa}\nmonitor: off\n", "monitor must be a mapping of keys, not False"),
        ("- drafter\n", "top level must be a mapping of sections"),
        ("drafter: {type: medusa\n", "not valid YAML"),
        ("train: {lr: 1.0e-3}\n", "no drafter.type"),
    ],
)
def test_a_recipe_file_of_the_wrong_shape_is_one_line_naming_it(tmp_path, text, message):
    mine = tmp_path / "mine.yaml"
    mine.write_text(text)
    with pytest.raises(UserError) as refused:
        load_recipe([f"recipe={mine}"])
    assert str(refused.value).startswith(f"recipe {mine}: {message}")
