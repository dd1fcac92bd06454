"""Builds kvpool's wheel as a user would, from a clean copy of what the wheel is made of.

A copy: setuptools keeps a build/ folder in the tree it builds, and a file deleted since
the last build would ride along.  No build isolation: the suite's own setuptools (the dev
extra), so the build needs no network.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# what the wheel is made of; the Dockerfile copies the same into its build stage
SOURCES = ("pyproject.toml", "README.md", "kvpool")


def build_wheel(out: Path) -> Path:
    """``pip wheel --no-deps`` of a clean copy of :data:`SOURCES` into ``out``; the wheel."""
    src = out / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"),
            *("--disable-pip-version-check", "--wheel-dir", str(out), str(src)),
        ],
        check=True,
        timeout=120,
    )
    (wheel,) = out.glob("kvpool-*.whl")
    return wheel
