"""The documentation: the README stays short and links only to pages that exist, the docs site builds
with `mkdocs build --strict` (no broken link, every page in the nav), and the README's commands are
real commands of this checkout (each recipe and override resolves, `--cfg`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from draftsmith.cli import recipe_args
from draftsmith.recipe import load_recipe
from tests.helpers import REPO


def test_the_readme_is_short_and_its_links_resolve():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (REPO / target).exists(), target


def test_every_relative_link_of_the_docs_is_a_file():
    """A link to a folder shows on GitHub and is a missing page on the rendered site, which has no folder index."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http", "mailto:")):
                assert (page.parent / target).is_file(), f"{page.relative_to(REPO)}: {target}"


@pytest.mark.slow  # runs an entry point (the fast tier stays within its 2 minutes)
def test_the_docs_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "recipe" / "index.html").is_file()


def test_the_readme_commands_resolve(tmp_path):
    """Each draftsmith command of the README's path: its recipe and overrides load (what `--cfg` does)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.splitlines()]
    commands = [shlex.split(line.split(" # ")[0]) for line in lines if line.startswith("draftsmith ")]
    assert [command[1] for command in commands] == ["train", "eval", "export", "monitor"]
    for command in commands:
        load_recipe([*recipe_args(command[1:]), f"output_dir={tmp_path}"])


def test_the_eval_pages_first_command_reads_files_that_exist(tmp_path):
    """docs/eval.md's first command named eval.data=[code.jsonl,math.jsonl], files nothing makes: its recipe and
    overrides resolve, and every eval.data file it names is in the checkout."""
    block = re.search(r"```bash\n(.*?)```", (REPO / "docs" / "eval.md").read_text(), flags=re.S).group(1)
    command = shlex.split(block.splitlines()[0])
    assert command[:3] == ["python", "-m", "eval"]
    cfg = load_recipe([*command[3:], f"output_dir={tmp_path}"])
    assert cfg.eval.data and all((REPO / path).is_file() for path in cfg.eval.data), cfg.eval.data


def test_every_shipped_recipe_is_named_in_the_recipes_page():
    """docs/recipes.md's "Shipped recipes" names each recipe file the package ships (`recipe=NAME`)."""
    text = (REPO / "docs" / "recipes.md").read_text()
    listed = text[text.index("Shipped recipes:") :].split("\n\n")[0]
    named = set(re.findall(r"`([a-z0-9_]+)`", listed))
    shipped = {path.stem for path in (REPO / "recipes").glob("*.yaml")}
    assert "medusa" in shipped and shipped <= named, sorted(shipped - named)
