"""Threads a test starts together and then waits for, every join bounded so that a hung
thread fails the test instead of hanging the suite."""

from __future__ import annotations

import threading
from collections.abc import Sequence

__all__ = ["run_threads"]


def run_threads(threads: Sequence[threading.Thread], timeout_s: float) -> list[threading.Thread]:
    """Start every thread, then join each for at most ``timeout_s``; the ones still alive."""
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return [t for t in threads if t.is_alive()]
