"""Stop strings that start in P's token and end in D's text.  Pure.

D checks its stop strings against its own text only, so one begun by P's token and
finished by D's is the proxy's to find.  Streaming, P's trailing text that could begin one
is held back (as vLLM holds back its own) until D's text shows whether it does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StopAcross", "stop_strings", "straddling_stop"]


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    return [s for s in stop if isinstance(s, str) and s] if isinstance(stop, list) else []


def straddling_stop(first: str, then: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string that starts inside ``first`` and ends inside ``then``, as
    ``(position in first + then, stop string)``."""
    text, cut = first + then, len(first)
    found: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, cut - len(stop) + 1)
        at = text.find(stop, start, cut + len(stop) - 1)
        if 0 <= at < cut and (found is None or at < found[0]):
            found = (at, stop)
    return found


class StopAcross:
    """Streaming: what of P's text to send at once, then what of each D piece, and where
    a straddling stop string ends the answer."""

    def __init__(self, first: str, stops: list[str], include_stop: bool) -> None:
        self._stops = stops
        self._include = include_stop
        self._pending = first  # P's held-back tail, then D's text after it
        self._from_first = len(first)  # how many chars of pending came from P
        self.first_out = self._release()

    @property
    def active(self) -> bool:
        return self._from_first > 0

    def _release(self) -> str:
        """Send what can no longer begin a straddling stop; keep the rest."""
        keep = len(self._pending)
        for at in range(self._from_first):
            tail = self._pending[at:]
            if any(stop.startswith(tail) and len(stop) > len(tail) for stop in self._stops):
                keep = at
                break
        out, self._pending = self._pending[:keep], self._pending[keep:]
        self._from_first = max(0, self._from_first - keep)
        if not self._from_first:
            out, self._pending = out + self._pending, ""
        return out

    def feed(self, piece: str, final: bool = False) -> tuple[str, str | None]:
        """``(text to send, the stop string that ended the answer or None)``."""
        if not self.active:
            return piece, None
        first = self._pending[: self._from_first]
        hit = straddling_stop(first, self._pending[self._from_first :] + piece, self._stops)
        if hit is not None:
            at, stop = hit
            text = (first + self._pending[self._from_first :] + piece)[:at]
            self._pending, self._from_first = "", 0
            return text + (stop if self._include else ""), stop
        self._pending += piece
        if final:
            out, self._pending, self._from_first = self._pending, "", 0
            return out, None
        return self._release(), None
