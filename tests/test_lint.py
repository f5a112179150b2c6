"""The tree is lint-clean and formatted (ruff, configured in pyproject.toml): CI checks what a
contributor's editor would; and no product module outgrows what a reader takes in at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, code_folders


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]


MAX_MODULE_LINES = 450  # past this a module holds more than one idea: split it along its seam


def test_no_product_module_is_over_450_lines():
    files = [REPO / "train.py", *(path for root in code_folders() for path in (REPO / root).rglob("*.py"))]
    sizes = {path.relative_to(REPO).as_posix(): len(path.read_text().splitlines()) for path in files}
    long = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert not long, f"product modules over {MAX_MODULE_LINES} lines (split each along a seam): {long}"
