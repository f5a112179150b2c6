"""The tree is lint-clean and formatted (ruff, configured in pyproject.toml): CI checks what a
contributor's editor would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
