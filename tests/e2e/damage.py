"""A pool wrapper for e2e tests: records what the connector stores and damages it on demand.

It wraps the real in-process pool; "remove" deletes objects from it (a missing block),
"corrupt" makes them unreadable the way a checksum failure does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.connectors.store_pool import PoolClient
from kvpool.errors import ChecksumMismatch

__all__ = ["DamagingPool", "make_embedded"]


def make_embedded() -> PoolClient:
    try:
        from kvpool.service.embedded import EmbeddedPool
    except ImportError:  # the service layer is not there yet: use the unit tests' double
        from tests.connectors.fake_pool import FakePool

        return FakePool()
    pool: PoolClient = EmbeddedPool(segment_size=256 << 20)
    return pool


class DamagingPool:
    def __init__(self, inner: PoolClient) -> None:
        self.inner = inner
        self.stored: list[str] = []
        self.corrupt: set[str] = set()

    def damage(self, mode: str, count: int, start: int = 1) -> dict[str, Any]:
        keys = self.stored[start : start + count]
        for key in keys:
            if mode == "remove":
                self.inner.remove(key)
            elif mode == "corrupt":
                self.corrupt.add(key)
            else:
                raise ValueError(mode)
        return {"damaged": len(keys), "stored": len(self.stored)}

    def put_from(self, key: str, buffer: Any, *, parent: str | None = None) -> None:
        self.inner.put_from(key, buffer, parent=parent)
        if key not in self.stored:
            self.stored.append(key)

    def get_into(self, key: str, buffer: Any) -> int:
        if key in self.corrupt:
            raise ChecksumMismatch(f"{key}: checksum mismatch (damaged by the test)")
        return self.inner.get_into(key, buffer)

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self.inner.prefix_lookup(keys)

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.batch_exists(keys)

    def remove(self, key: str) -> bool:
        return self.inner.remove(key)

    def close(self) -> None:
        self.inner.close()
