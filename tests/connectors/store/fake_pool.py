"""A test double of a pool engine (:class:`kvpool.engines.PoolEngine`), in memory.

Only for unit tests of the store connector: it keeps the engine's rules (per-key batch
answers, a duplicate put is a no-op, a failed read is a miss, a pin lasts until its owner's
release or its TTL on the pool's clock ``now_ms``) and lets a test break things on purpose
(an outage, a corrupt or missing object, a write conflict, a fill that evicts everything
not pinned).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvpool.engines import MISS, POOL_TTL
from kvpool.errors import KVPoolError, ObjectBusy, PeerTimeout, WriteConflict
from kvpool.storage.buffers import byte_view, writable_byte_view

__all__ = ["FakePool"]


class FakePool:
    engine = "fake"

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.parents: dict[str, str | None] = {}
        self.pins: dict[str, dict[str, int]] = {}  # owner -> key -> expiry (ms)
        self.now_ms = 0
        self.lease_ttl_ms = 11_000  # what a POOL_TTL pin lasts
        self.calls: Counter[str] = Counter()
        self.down = False
        self.corrupt: set[str] = set()
        self.conflict: set[str] = set()
        self.leases = 0  # open read leases: must be 0 between calls
        self.closed = False

    def _check(self, name: str) -> None:
        self.calls[name] += 1
        if self.down:
            raise PeerTimeout("fake pool is down")

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        self._check("batch_put_parts")
        results: list[KVPoolError | None] = []
        for i, (key, ps) in enumerate(zip(keys, parts, strict=True)):
            if key in self.conflict:
                results.append(WriteConflict(key))
                continue
            if key not in self.objects:  # a duplicate put is a no-op
                self.objects[key] = b"".join(bytes(byte_view(p)) for p in ps)
                self.parents[key] = None if parents is None else parents[i]
            results.append(None)
        return results

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        """As an engine that reads in place (Mooncake on a registered cache): the bytes
        land in the parts before the read is known good, so a corrupt or wrong-sized
        object leaves garbage there (0xEE) and answers MISS."""
        self._check("batch_get_parts")
        sizes = []
        self.leases += 1
        try:
            for key, ps in zip(keys, parts, strict=True):
                views = [writable_byte_view(p) for p in ps]
                total = sum(len(v) for v in views)
                data = self.objects.get(key)
                if data is None:
                    sizes.append(MISS)
                    continue
                bad = key in self.corrupt or len(data) != total
                stream = b"\xee" * total if bad else data
                at = 0
                for view in views:
                    view[:] = stream[at : at + len(view)]
                    at += len(view)
                sizes.append(MISS if bad else total)
        finally:
            self.leases -= 1
        return sizes

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        self._check("prefix_lookup")
        n = 0
        for key in keys:
            if key not in self.objects:
                break
            n += 1
        return n

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        self._check("batch_exists")
        return [k in self.objects for k in keys]

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        self._check("pin")
        expiry = self.now_ms + (self.lease_ttl_ms if ttl_ms == POOL_TTL else ttl_ms)
        held = [k for k in keys if k in self.objects]
        mine = self.pins.setdefault(owner, {})
        for key in held:
            mine[key] = max(mine.get(key, 0), expiry)
        return len(held)

    def release(self, owner: str) -> int:
        self._check("release")
        return len(self.pins.pop(owner, {}))

    def pinned(self) -> set[str]:
        """Keys some owner pins now (unexpired on ``now_ms``)."""
        return {k for held in self.pins.values() for k, exp in held.items() if exp > self.now_ms}

    def fill(self) -> int:
        """What a fill by other traffic does to a full pool: every object nobody pins now is
        evicted.  Returns how many were."""
        keep = self.pinned()
        gone = [k for k in self.objects if k not in keep]
        for key in gone:
            del self.objects[key]
        return len(gone)

    def remove(self, key: str) -> bool:
        self._check("remove")
        if key in self.pinned():
            raise ObjectBusy(f"{key} is pinned")
        return self.objects.pop(key, None) is not None

    def health(self) -> dict[str, Any]:
        self._check("health")
        return {"objects": len(self.objects)}

    def close(self) -> None:
        self.closed = True
