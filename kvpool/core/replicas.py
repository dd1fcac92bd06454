"""Replicas: an object's other copies, each in a memory segment of another owner.

Placed on other hosts first; a lost one (owner left, found corrupt, not written) is forgotten
while one copy is left.  A record's ``replicas`` is None for the usual object of one copy.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.core.objects import MAX_REPLICAS, CopyLost, Event, IndexStats, ObjectRecord, State
from kvpool.core.placement import Placer
from kvpool.core.registry import Registry, SegmentRecord, Tier
from kvpool.core.space import Extent

__all__ = ["Replicas", "touches"]

_MEMORY = Tier.MEMORY

Copy = tuple[SegmentRecord, Extent]
#: room for ``size`` bytes in a segment, made by the index's eviction (None: none)
RoomIn = Callable[[SegmentRecord, int], Copy | None]


class Replicas:
    """The other copies of an index's objects (see the module docstring)."""

    def __init__(self, registry: Registry, placer: Placer, stats: IndexStats) -> None:
        self._registry = registry
        self._placer = placer
        self._stats = stats

    def place(self, obj: ObjectRecord, want: int, room_in: RoomIn) -> list[Copy] | None:
        """Up to ``want`` more copies of ``obj``, each in a memory segment of an owner
        that holds none yet, on a host that holds none first (then the most free room).
        Room is made by evicting from the chosen segment only (``room_in``)."""
        size = obj.extent.length
        host = self._registry.host_of
        owners = {obj.segment.client_id}
        hosts = {host(obj.segment.client_id)}
        chosen: list[Copy] = []
        for _ in range(want):
            others = [s for s in self._placer.segments(_MEMORY) if s.client_id not in owners]
            if not others:
                break
            others.sort(key=lambda s: (host(s.client_id) in hosts, -s.space.free))
            placed = next(
                ((s, e) for s in others for e in (s.space.allocate(size),) if e is not None),
                None,
            )
            if placed is None:
                placed = room_in(others[0], size)
            if placed is None:
                break
            chosen.append(placed)
            owners.add(placed[0].client_id)
            hosts.add(host(placed[0].client_id))
        if len(chosen) < want:
            self._stats.replicas_short += 1
        return chosen or None

    def lose(self, obj: ObjectRecord, segment_ids: set[str], release: bool) -> bool:
        """Forget ``obj``'s copies in ``segment_ids`` (their space freed if ``release``).
        False, and nothing changed, when no copy would be left."""
        copies = obj.copies()
        keep = [c for c in copies if c[0].segment_id not in segment_ids]
        if not keep:
            return False
        if len(keep) == len(copies):
            return True
        if release:
            for seg, extent in copies:
                if seg.segment_id in segment_ids:
                    seg.space.release(extent)
        self._stats.replicas_lost += len(copies) - len(keep)
        first_seg, first_extent = keep[0]
        if first_seg is not obj.segment:
            obj.move(first_seg, first_extent)
        obj.replicas = keep[1:] or None
        return True

    def lost(self, obj: ObjectRecord, segment_ids: set[str], reason: str) -> list[Event]:
        """:meth:`lose` with their space freed, as events for their owners; [] when no
        copy would be left (the caller drops the object)."""
        gone = [s.client_id for s, _ in obj.copies() if s.segment_id in segment_ids]
        if not gone or not self.lose(obj, segment_ids, release=True):
            return []
        return [CopyLost(obj.key, owner, reason) for owner in gone]

    @staticmethod
    def leave(obj: ObjectRecord, release: bool) -> tuple[str, ...]:
        """``obj`` leaves the index: its other copies' owners (their space freed if
        ``release``).  Only for an object with replicas."""
        assert obj.replicas is not None
        if release:
            for other, extent in obj.replicas:
                other.space.release(extent)
        return tuple(s.client_id for s, _ in obj.replicas)

    @staticmethod
    def restore(obj: ObjectRecord, seg: SegmentRecord, offset: int, size: int) -> bool:
        """A node re-announces another copy of a READY memory object: kept as a replica
        at exactly its extent (False: not a copy the index can keep)."""
        copies = obj.copies()
        if (
            seg.tier is not _MEMORY
            or obj.segment.tier is not _MEMORY
            or len(copies) >= MAX_REPLICAS
            or any(s.client_id == seg.client_id for s, _ in copies)
        ):
            return False
        extent = Extent(offset, size)
        if not seg.space.take(extent):
            return False
        obj.replicas = [*(obj.replicas or ()), (seg, extent)]
        return True

    @staticmethod
    def check(obj: ObjectRecord) -> None:
        """Assert that ``obj``'s copies are on distinct owners, in memory, of one size."""
        if obj.replicas is None:
            return
        taken = obj.copies()
        owners = {seg.client_id for seg, _ in taken}
        assert obj.replicas and len(owners) == len(taken), f"{obj.key}: bad replicas"
        assert all(seg.tier is _MEMORY for seg, _ in taken), f"{obj.key}: replica tier"
        assert obj.state is not State.DEMOTING, f"{obj.key}: a demotion keeps one copy"
        assert all(e.length == obj.extent.length for _, e in taken), obj.key


def touches(obj: ObjectRecord, segment_ids: set[str]) -> bool:
    """``obj`` has a copy in one of ``segment_ids``."""
    if obj.segment.segment_id in segment_ids:
        return True
    return obj.replicas is not None and any(s.segment_id in segment_ids for s, _ in obj.replicas)
