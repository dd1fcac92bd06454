"""A test double of the pool client (kvpool.Client / EmbeddedPool methods), in memory.

Only for unit tests of the store connector: it has the agreed methods and lets a test
break things on purpose (an outage, a corrupt or missing object).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from kvpool.errors import ChecksumMismatch, ObjectNotFound, PeerTimeout, WriteConflict

__all__ = ["FakePool"]


class FakePool:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.parents: dict[str, str | None] = {}
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

    def put_from(self, key: str, buffer: Any, *, parent: str | None = None) -> None:
        self._check("put_from")
        if key in self.conflict:
            raise WriteConflict(key)
        if key not in self.objects:  # duplicate put is a no-op
            self.objects[key] = bytes(memoryview(buffer).cast("B"))
            self.parents[key] = parent

    def get_into(self, key: str, buffer: Any) -> int:
        self._check("get_into")
        if key not in self.objects:
            raise ObjectNotFound(key)
        if key in self.corrupt:
            raise ChecksumMismatch(key)
        self.leases += 1
        try:
            data = self.objects[key]
            view = memoryview(buffer).cast("B")
            view[: len(data)] = data
            return len(data)
        finally:
            self.leases -= 1

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

    def remove(self, key: str) -> bool:
        self._check("remove")
        return self.objects.pop(key, None) is not None

    def close(self) -> None:
        self.closed = True
