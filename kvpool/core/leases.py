"""Holds: the read leases and pins that keep an index's objects from leaving.

A lease and a pin are one thing here, a *hold*: one expiry per (object, owner).  Holds are
also kept per owner, so that an aborted request releases all of its holds at once.
"""

from __future__ import annotations

import heapq

from kvpool.core.objects import ObjectRecord
from kvpool.core.registry import Tier

__all__ = ["Holds"]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_SSD = Tier.SSD


class Holds:
    """Every hold of an index's objects, by owner and by expiry.

    Rules: every hold has an owner and an expiry; a later hold by the same owner only
    extends it; it leaves at whichever comes first of its release, its owner's release,
    its expiry (:meth:`expire`) or the object leaving (:meth:`clear`).  Probes never take
    or renew one (probes renewing leases kept eviction from ever running in peer
    projects); an object with an unexpired hold is not a victim (the index asks
    ``ObjectRecord.held``).

    Kept so: ``key in owned(owner)`` exactly when ``owner in record.holds``, and that
    record is the index's live record of ``key`` (:meth:`check`).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, str, str]] = []  # (expiry, key, owner), lazy
        # owner -> key -> the record it holds: a request's release needs no index lookup
        self._by_owner: dict[str, dict[str, ObjectRecord]] = {}
        # Counts kept as holds change, so that eviction rounds and metrics never scan.
        # Per tier as [memory, SSD], indexed by ``tier is _SSD`` (a bool is an int): a
        # dict keyed by Tier hashed the enum in Python code on every hold.
        self._held: list[int] = [0, 0]  # objects with any hold entry
        self.entries = 0  # (object, owner) holds present, expired or not

    def held_objects(self, tier: Tier) -> int:
        """Objects of ``tier`` with any hold entry (unexpired ones only, after
        :meth:`expire`)."""
        return self._held[tier is _SSD]

    def hold(self, obj: ObjectRecord, owner: str, expiry: int) -> int:
        """Hold ``obj`` for ``owner`` until ``expiry`` (or later, if it held it already);
        returns the hold's expiry."""
        holds = obj.holds
        if holds is None:
            holds = obj.holds = {}
        before = holds.get(owner)
        if before is None:
            if not holds:
                self._held[obj.segment.tier is _SSD] += 1
            self.entries += 1
        elif before > expiry:
            expiry = before
        holds[owner] = expiry
        owned = self._by_owner.get(owner)
        if owned is None:  # no dict made and thrown away when the owner has one
            self._by_owner[owner] = {obj.key: obj}
        else:
            owned[obj.key] = obj
        heapq.heappush(self._heap, (expiry, obj.key, owner))
        return expiry

    def release(self, key: str, owner: str) -> None:
        """``owner``'s hold of ``key`` ends (none: nothing happens)."""
        owned = self._by_owner.get(owner)
        if owned is None:
            return
        obj = owned.pop(key, None)
        if not owned:
            del self._by_owner[owner]
        if obj is not None and obj.holds and obj.holds.pop(owner, None) is not None:
            self._unheld(obj)

    def release_owner(self, owner: str) -> int:
        """Every hold of ``owner`` ends (an aborted or finished request); how many."""
        owned = self._by_owner.pop(owner, None)
        if owned is None:
            return 0
        for obj in owned.values():
            if obj.holds and obj.holds.pop(owner, None) is not None:
                self._unheld(obj)
        return len(owned)

    def expire(self, now_ms: int) -> int:
        """Release every hold expired at ``now_ms``; how many."""
        heap = self._heap
        expired = 0
        while heap and heap[0][0] <= now_ms:
            expiry, key, owner = heapq.heappop(heap)
            owned = self._by_owner.get(owner)
            obj = owned.get(key) if owned is not None else None
            if obj is not None and obj.holds and obj.holds.get(owner) == expiry:
                expired += 1
                self.release(key, owner)
        return expired

    def clear(self, obj: ObjectRecord) -> None:
        """``obj`` leaves the index, or may no longer be read (a copy in flight): every
        hold of it ends.  Only for an object with holds."""
        holds = obj.holds
        assert holds, f"{obj.key} has no holds to clear"
        self._held[obj.segment.tier is _SSD] -= 1
        self.entries -= len(holds)
        by_owner = self._by_owner
        key = obj.key
        for owner in holds:
            owned = by_owner.get(owner)
            if owned is not None:
                owned.pop(key, None)
                if not owned:
                    del by_owner[owner]
        obj.holds = None

    def moved_to_ssd(self, obj: ObjectRecord) -> None:
        """``obj`` moved from memory to SSD with its holds (a demotion)."""
        if obj.holds:
            self._held[0] -= 1
            self._held[1] += 1

    def check(self, objects: dict[str, ObjectRecord]) -> None:
        """Assert the kept counts and the class's rule against ``objects`` (tests)."""
        records = list(objects.values())
        for tier in Tier:
            held = sum(1 for o in records if o.holds and o.segment.tier is tier)
            assert self._held[tier is _SSD] == held, f"{tier.value}: held count kept wrong"
        assert self.entries == sum(len(o.holds or ()) for o in records)
        assert self.entries == sum(len(owned) for owned in self._by_owner.values())
        for owner, owned in self._by_owner.items():
            assert owned, f"{owner}: an empty entry kept"
            for key, obj in owned.items():
                holds = obj.holds or {}
                assert objects.get(key) is obj and owner in holds, f"{owner}: {key} stale"

    def _unheld(self, obj: ObjectRecord) -> None:
        """One hold entry of ``obj`` was just removed."""
        self.entries -= 1
        if not obj.holds:
            self._held[obj.segment.tier is _SSD] -= 1
            obj.holds = None  # an empty dict is 64 bytes an object
