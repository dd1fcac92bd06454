"""A byte budget shared by the connection threads of one server.

A server that allocates a buffer per request (a segment server reads an SSD object into
memory before sending it, so a corrupt file is an error, never a payload) holds one per
busy connection; :class:`ByteBudget` bounds their sum.  A request that finds no room waits,
bounded; one larger than the whole budget passes when nothing else is held, so a large
object is slow under load but never impossible.
"""

from __future__ import annotations

import threading
import time

__all__ = ["ByteBudget"]


class ByteBudget:
    """``limit`` bytes, taken and given back by threads."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a byte budget must be positive, got {limit}")
        self.limit = limit
        self.held = 0
        self._cond = threading.Condition()

    def take(self, nbytes: int, timeout_s: float) -> bool:
        """Take ``nbytes``, waiting up to ``timeout_s`` for room; False when none came."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self.held and self.held + nbytes > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        """Give back what :meth:`take` took."""
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()
