"""Python code run in a fresh interpreter, for tests that must see what an import pulls in
(or fails to) without whatever this process has imported already hiding it."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["run_python"]


def run_python(
    code: str,
    *argv: str,
    warnings: str = "ignore",
    timeout_s: float = 240,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python -W <warnings> -c <code> <argv…>`` in a child, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-W", warnings, "-c", code, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=check,
    )
