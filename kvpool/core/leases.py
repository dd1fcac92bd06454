"""Reads and holds: who may read an object of the index, and what keeps it from leaving.

The part of :class:`~kvpool.core.index.ObjectIndex` that answers readers (its base class,
over :class:`~kvpool.core.placement.IndexPlacement`, which holds the state):

    exists(key) / prefix_lookup(keys)   probes: READY objects only, and no lease taken
    get(key, owner, now)                a read lease of ``lease_ttl_ms`` (a ReadGrant)
    pin(key, owner, now, ttl)           a hold of ``ttl`` ms, e.g. until a decode loaded it
    release(key, owner)                 one owner's lease or pin of one object ends
    release_owner(owner)                every lease and pin of an owner ends (a request
                                        finished or was aborted)
    active_leases(now)                  unexpired holds, counted exactly

Rules (the index's invariants are in ``index.py``): a lease and a pin are the same thing, a
*hold*: one expiry per (object, owner), which a later hold by the same owner only extends;
every hold has an owner and an expiry, and leaves at whichever comes first of its release,
its owner's release, its expiry (``_expire_holds``, run by ``tick`` and before holds are
counted) or the object leaving; probes never take or renew one (probes renewing leases
kept eviction from ever running in peer projects).  An object with an unexpired hold is
not a victim (``_evictable`` in placement).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvpool.core.objects import IndexConfig, ObjectRecord, ReadGrant, State
from kvpool.core.placement import IndexPlacement
from kvpool.core.registry import Tier
from kvpool.errors import ObjectNotFound

__all__ = ["IndexLeases"]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_READY = State.READY
_MEMORY, _SSD = Tier.MEMORY, Tier.SSD


class IndexLeases(IndexPlacement):
    """Probes, read leases and pins of the index (see the module docstring)."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        super().__init__(config)
        self._hold_heap: list[tuple[int, str, str]] = []  # (expiry, key, owner), lazy
        self._now = 0

    def exists(self, key: str) -> bool:
        """Probe without a lease (probes renewing leases blocked eviction in peer projects)."""
        obj = self._objects.get(key)
        return obj is not None and obj.state is State.READY

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys are READY; takes no lease."""
        objects = self._objects
        n = 0
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.state is not _READY:
                break
            n += 1
        return n

    def get(self, key: str, owner: str, now_ms: int) -> ReadGrant:
        """Grant a read lease of ``lease_ttl_ms`` on a READY object."""
        if now_ms > self._now:
            self._now = now_ms
        obj = self._objects.get(key)
        if obj is None or obj.state is not _READY:
            raise ObjectNotFound(key)
        expiry = self._hold(obj, owner, now_ms + self.config.lease_ttl_ms)
        (self._mem_policy if obj.segment.tier is _MEMORY else self._ssd_policy).on_access(key)
        return ReadGrant(key, obj.location(), obj.checksum, expiry)

    def pin(self, key: str, owner: str, now_ms: int, ttl_ms: int) -> None:
        """Hold an object for ``ttl_ms`` (e.g. until a decode pulled it); owner-released."""
        self._now = max(self._now, now_ms)
        obj = self._objects.get(key)
        if obj is None or obj.state is not State.READY:
            raise ObjectNotFound(key)
        self._hold(obj, owner, now_ms + ttl_ms)

    def release(self, key: str, owner: str) -> None:
        obj = self._objects.get(key)
        if obj is not None and obj.holds.pop(owner, None) is not None:
            self._unheld(obj)
        keys = self._owner_keys.get(owner)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._owner_keys[owner]

    def release_owner(self, owner: str) -> int:
        """Drop every lease and pin of ``owner`` (an aborted or finished request)."""
        keys = self._owner_keys.pop(owner, None)
        if keys is None:
            return 0
        objects = self._objects
        for key in keys:
            obj = objects.get(key)
            if obj is not None and obj.holds.pop(owner, None) is not None:
                self._unheld(obj)
        return len(keys)

    def active_leases(self, now_ms: int) -> int:
        """Unexpired leases and pins.  Expired ones are released first, as the next tick
        would do, so the kept count is exact."""
        self._expire_holds(now_ms)
        return self._hold_entries

    # --------------------------------------------------------------------------- internals
    def _hold(self, obj: ObjectRecord, owner: str, expiry: int) -> int:
        holds = obj.holds
        before = holds.get(owner)
        if before is None:
            if not holds:
                self._held[obj.segment.tier is _SSD] += 1
            self._hold_entries += 1
        elif before > expiry:
            expiry = before
        holds[owner] = expiry
        keys = self._owner_keys.get(owner)
        if keys is None:  # no set made and thrown away when the owner has one
            self._owner_keys[owner] = {obj.key}
        else:
            keys.add(obj.key)
        heapq.heappush(self._hold_heap, (expiry, obj.key, owner))
        return expiry

    def _unheld(self, obj: ObjectRecord) -> None:
        """One hold entry of ``obj`` was just removed."""
        self._hold_entries -= 1
        if not obj.holds:
            self._held[obj.segment.tier is _SSD] -= 1

    def _expire_holds(self, now_ms: int) -> None:
        heap = self._hold_heap
        while heap and heap[0][0] <= now_ms:
            expiry, key, owner = heapq.heappop(heap)
            obj = self._objects.get(key)
            if obj is not None and obj.holds.get(owner) == expiry:
                self.stats.expired_leases += 1
                self.release(key, owner)
