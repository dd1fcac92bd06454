"""Waiting on conditions, not clocks: the one polling helper every test uses.

A test that needs something to happen in another thread or process waits for the
condition itself, bounded by a deadline, instead of sleeping a fixed time and hoping.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["async_wait_until", "wait_until"]

T = TypeVar("T")


def _met(predicate: Callable[[], T], deadline: float, timeout_s: float, what: str) -> T | None:
    """The predicate's value when truthy; None to poll again; AssertionError past the
    deadline (asked once more at the deadline, so a condition met late still counts)."""
    value = predicate()
    if value:
        return value
    if time.monotonic() >= deadline:
        raise AssertionError(f"condition not met in {timeout_s}s: {what or predicate!r}")
    return None


def wait_until(
    predicate: Callable[[], T], timeout_s: float = 15.0, *, interval_s: float = 0.02, what: str = ""
) -> T:
    """Poll ``predicate`` until it returns something truthy and return that value; raise
    :class:`AssertionError` (naming ``what``) when ``timeout_s`` passes first."""
    deadline = time.monotonic() + timeout_s
    while (value := _met(predicate, deadline, timeout_s, what)) is None:
        time.sleep(interval_s)
    return value


async def async_wait_until(
    predicate: Callable[[], T], timeout_s: float = 15.0, *, interval_s: float = 0.02, what: str = ""
) -> T:
    """:func:`wait_until` for a test running on an event loop (the loop keeps running)."""
    deadline = time.monotonic() + timeout_s
    while (value := _met(predicate, deadline, timeout_s, what)) is None:
        await asyncio.sleep(interval_s)
    return value
