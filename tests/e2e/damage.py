"""A pool wrapper for e2e tests: records what the connector stores and damages it on demand.

It wraps the real in-process pool (:class:`~kvpool.service.embedded.EmbeddedPool`):
"remove" deletes objects from it (a missing block); "corrupt" overwrites the first bytes
of the stored object inside the pool's memory segment, so that the pool's own checksum
has to catch it; "zero" serves zeros of the right size in place of the stored bytes (a
pool that lost data without noticing) — the control that shows the tests' comparison of
outputs would notice wrong KV.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.protocol import messages as m
from kvpool.service.embedded import EmbeddedPool

__all__ = ["DamagingPool", "corrupt_in_place", "make_embedded"]


def make_embedded() -> EmbeddedPool:
    return EmbeddedPool(segment_size=256 << 20)


def corrupt_in_place(pool: EmbeddedPool, key: str) -> None:
    """Flip the first bytes of ``key``'s stored copy (found as any reader finds it)."""
    placement = pool.call(m.Get("test-damage", key))
    assert isinstance(placement, m.Placement) and placement.placed, key
    try:
        segment = pool.storage.segment
        assert segment is not None
        original = bytearray(64)
        segment.read_into(placement.offset, memoryview(original))
        segment.write(placement.offset, bytes(b ^ 0xFF for b in original))
    finally:
        pool.call(m.Release("test-damage", [key]))


class DamagingPool:
    def __init__(self, inner: EmbeddedPool) -> None:
        self.inner = inner
        self.stored: list[str] = []
        self.zeroed: set[str] = set()

    def damage(self, mode: str, count: int, start: int = 1) -> dict[str, Any]:
        keys = self.stored[start : start + count]
        for key in keys:
            if mode == "remove":
                self.inner.remove(key)
            elif mode == "corrupt":
                corrupt_in_place(self.inner, key)
            elif mode == "zero":
                self.zeroed.add(key)
            else:
                raise ValueError(mode)
        return {"damaged": len(keys), "stored": len(self.stored)}

    def put_from(self, key: str, buffer: Any, *, parent: str | None = None) -> None:
        self.inner.put_from(key, buffer, parent=parent)
        if key not in self.stored:
            self.stored.append(key)

    def get_into(self, key: str, buffer: Any) -> int:
        n = self.inner.get_into(key, buffer)
        if key in self.zeroed:
            view = memoryview(buffer).cast("B")
            view[:n] = bytes(n)
        return n

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self.inner.prefix_lookup(keys)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.batch_exists(keys)

    def remove(self, key: str) -> bool:
        return self.inner.remove(key)

    def close(self) -> None:
        self.inner.close()
