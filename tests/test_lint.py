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


def test_ruff_format_leaves_every_file_as_it_is() -> None:
    """One layout everywhere, so a diff shows what changed and not who reformatted it."""
    done = subprocess.run(
        [_tool("ruff"), "format", "--check", "kvpool", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_is_clean_and_strict_on_the_core() -> None:
    done = subprocess.run([_tool("mypy"), "kvpool"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_module_docstrings_say_one_concept_in_ten_lines() -> None:
    """Rules stay beside the code they govern and reference material goes to docs/: a
    module's docstring is its one concept, ten lines at most."""
    import ast

    long = []
    for path in sorted((ROOT / "kvpool").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text()), clean=False)
        if doc and doc.count("\n") + 1 > 10:
            long.append(f"{path.relative_to(ROOT)}: {doc.count(chr(10)) + 1} lines")
    assert not long, "module docstrings over 10 lines:\n" + "\n".join(long)
