"""The code style gates run as tests, so the README's one test command covers them too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed; run scripts/setup.sh")
    return found


def test_ruff_finds_nothing() -> None:
    done = subprocess.run(
        [_tool("ruff"), "check", "kvpool", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean_and_strict_on_the_core() -> None:
    done = subprocess.run(
        [_tool("mypy"), "kvpool"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
