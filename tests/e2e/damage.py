"""A pool wrapper for e2e tests: records what the connector stores and damages it on demand.

It wraps the real in-process pool (:class:`~kvpool.embedded.EmbeddedPool`, as the
embedded engine does):
"remove" deletes objects from it (a missing block); "corrupt" overwrites the first bytes
of the stored object inside the pool's memory segment, so that the pool's own checksum
has to catch it; "zero" serves zeros of the right size in place of the stored bytes (a
pool that lost data without noticing) — the control that shows the tests' comparison of
outputs would notice wrong KV.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvpool.embedded import EmbeddedPool
from kvpool.engines import EmbeddedEngine
from kvpool.errors import KVPoolError
from kvpool.protocol import messages as m
from kvpool.storage.buffers import writable_byte_view

__all__ = ["DamagingPool", "corrupt_in_place", "hold_puts", "make_embedded", "release_puts"]


def make_embedded(size: int = 256 << 20) -> EmbeddedPool:
    return EmbeddedPool(segment_size=size)


def hold_puts() -> dict[str, Any]:
    """Make the installed pool's puts wait (a slow node) until :func:`release_puts`."""
    from kvpool.connectors.store.pool import EmbeddedPools

    pool = EmbeddedPools.peek()
    assert isinstance(pool, DamagingPool), "hold_puts needs the embedded test pool"
    pool.open_gate.clear()
    return {"held": True}


def release_puts() -> dict[str, Any]:
    from kvpool.connectors.store.pool import EmbeddedPools

    pool = EmbeddedPools.peek()
    assert isinstance(pool, DamagingPool)
    pool.open_gate.set()
    return {"held_puts": pool.held_puts}


def corrupt_in_place(pool: EmbeddedPool, key: str, client: str = "test-damage") -> None:
    """Flip the first bytes of ``key``'s stored copy (found as any reader finds it, leased
    to ``client`` meanwhile)."""
    placement = pool.call(m.Get(client, key))
    assert isinstance(placement, m.Placement) and placement.placed, key
    try:
        segment = pool.storage.segment
        assert segment is not None
        original = bytearray(64)
        segment.read_into(placement.offset, memoryview(original))
        segment.write(placement.offset, bytes(b ^ 0xFF for b in original))
    finally:
        pool.call(m.Release(client, [key]))


class DamagingPool:
    """A :class:`~kvpool.engines.PoolEngine` over the embedded pool that remembers what was
    stored, in order, and damages it on demand."""

    engine = "embedded"

    def __init__(self, inner: EmbeddedPool) -> None:
        self.inner = inner
        self._engine = EmbeddedEngine(inner)
        self.stored: list[str] = []
        self.zeroed: set[str] = set()
        self.open_gate = threading.Event()  # cleared: puts wait (hold_puts)
        self.open_gate.set()
        self.held_puts = 0  # puts that waited at the gate

    def damage(self, mode: str, count: int, start: int = 1) -> dict[str, Any]:
        keys = self.stored[start:][:count]  # start < 0: counted from the last one stored
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

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        if not self.open_gate.is_set():
            self.held_puts += 1
            self.open_gate.wait()
        results = self._engine.batch_put_parts(keys, parts, parents=parents)
        for key, error in zip(keys, results, strict=True):
            if error is None and key not in self.stored:
                self.stored.append(key)
        return results

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        sizes = self._engine.batch_get_parts(keys, parts)
        for key, ps, n in zip(keys, parts, sizes, strict=True):
            if key in self.zeroed and n > 0:
                for part in ps:
                    view = writable_byte_view(part)
                    view[:] = bytes(len(view))
        return sizes

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self._engine.batch_exists(keys)

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self._engine.prefix_lookup(keys)

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        return self._engine.pin(keys, owner, ttl_ms)

    def release(self, owner: str) -> int:
        return self._engine.release(owner)

    def remove(self, key: str) -> bool:
        return self._engine.remove(key)

    def health(self) -> dict[str, Any]:
        return self._engine.health()

    def close(self) -> None:
        self._engine.close()
