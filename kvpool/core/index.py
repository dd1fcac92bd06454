"""The object index: where every object lives, who may read it, and what to evict.

Object life cycle::

    put_start ──> PENDING ──put_end──> READY ──evict / remove / client expiry──> gone
                     │                   │  └─drop_corrupt (a read failed its checksum)──> gone
                     │                   │
                     └─put_revoke / writer lease expiry──> gone (space reclaimed)
                                         └─(offload) demote: memory extent -> SSD extent
                                           (a node's copy: READY ─> DEMOTING ─done─> READY
                                            on SSD; abandoned or failed ─> gone)

Invariants (tested per transition and by property tests over random operation sequences):
- a PENDING object is invisible: ``exists``, ``prefix_lookup`` and ``get`` see READY only;
- every object holds exactly one live extent in a registered segment, and a segment's used
  bytes equal the sum of its objects' sizes (``check()`` asserts this);
- an object with an unexpired read lease or pin is never evicted, demoted or removed;
- a DEMOTING object is invisible and holds its memory and its SSD extent until its copy
  is reported done (then it is READY on SSD) or abandoned (then it is gone);
- probes (``exists``, ``prefix_lookup``) never take or renew a lease;
- after an eviction round a tier is at or below its high watermark, unless every object
  left in it is leased, pinned or pending;
- a put that needs space evicts inline; it fails with NoSpace only when nothing evictable
  is left that would make room;
- a copy a reader found corrupt leaves at once, leases or not (its bytes are wrong for
  everyone, and a reader overtaken by a later use of the extent fails its own checksum):
  lookups stop counting it and the next put of the key stores it again;
- an object has at least one byte: an empty value is refused (PoolError), never stored.

Demotion (``enable_offload``): evicting a memory object whose owner also contributes an SSD
segment moves it there instead of dropping it.  The move is logical at once (the object's
location is the SSD extent and the memory extent is free) and the index returns a
:class:`Demote` effect that the caller must carry out, copying the bytes, before it hands
out any later reservation; if the copy fails the caller reports ``demote_failed`` and the
object is dropped.  Readers verify checksums end to end, so a copy that was overtaken is a
miss, never wrong bytes.  An owner whose copies are deferred (``defer_copies``: a node,
which copies while the master serves others) gets ``in_flight`` Demote effects instead:
the object is DEMOTING until ``demote_done`` or ``demote_abandoned`` (see placement).

Time is a parameter (``now_ms``); the index never reads a clock.  Its two base classes
hold the rest: :mod:`kvpool.core.leases` answers readers (probes, read leases, pins and
their expiry), and :mod:`kvpool.core.placement`, under it, holds the state and makes room
(allocation, inline eviction, demotion, watermark rounds).  This module is the life cycle:
writes, restores, removals, ticks, and the checks of the invariants above.
"""

from __future__ import annotations

import heapq

from kvpool.core.leases import IndexLeases
from kvpool.core.objects import (
    Demote,
    Dropped,
    Event,
    IndexConfig,
    IndexStats,
    Location,
    NoRoom,
    ObjectRecord,
    ReadGrant,
    Reservation,
    State,
)
from kvpool.core.registry import Tier
from kvpool.core.space import Extent
from kvpool.errors import (
    ObjectBusy,
    ObjectNotFound,
    PoolError,
    StaleWrite,
    WriteConflict,
)

__all__ = [
    "Demote",
    "Dropped",
    "Event",
    "IndexConfig",
    "IndexStats",
    "Location",
    "NoRoom",
    "ObjectIndex",
    "ReadGrant",
    "Reservation",
    "State",
]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_READY, _PENDING, _DEMOTING = State.READY, State.PENDING, State.DEMOTING
_MEMORY, _SSD = Tier.MEMORY, Tier.SSD


class ObjectIndex(IndexLeases):
    """All objects of the pool, their placement, leases, pins and eviction order (reads
    and holds are :class:`~kvpool.core.leases.IndexLeases`; how room is made, and what
    leaves for it, is :class:`~kvpool.core.placement.IndexPlacement`)."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        super().__init__(config)
        self._writer_heap: list[tuple[int, str, str]] = []  # (expiry, key, writer), lazy

    # ----------------------------------------------------------------- clients, segments
    def register_client(self, client_id: str, now_ms: int, address: str = "") -> bool:
        self._now = max(self._now, now_ms)
        return self.registry.register(client_id, now_ms, address)

    def heartbeat(self, client_id: str, now_ms: int) -> None:
        self._now = max(self._now, now_ms)
        self.registry.heartbeat(client_id, now_ms)

    def add_segment(
        self,
        client_id: str,
        segment_id: str,
        capacity: int,
        tier: Tier = Tier.MEMORY,
        *,
        placeable: bool = True,
    ) -> None:
        """Add a segment; ``placeable=False`` keeps new objects out of it until
        :meth:`open_segment` (its owner first re-announces what it holds, see ``restore``)."""
        self.registry.add_segment(client_id, segment_id, capacity, tier, placeable)
        self._mem_segments = self._ssd_segments = None

    def open_segment(self, segment_id: str) -> None:
        """New objects may be placed in ``segment_id`` from now on."""
        self.registry.segment(segment_id).placeable = True
        self._mem_segments = self._ssd_segments = None

    def remove_client(self, client_id: str, reason: str = "expired_client") -> list[Event]:
        """Drop a client, its segments and every object in them at once."""
        segments = {s.segment_id for s in self.registry.drop(client_id)}
        self._mem_segments = self._ssd_segments = None
        gone = [o for o in self._objects.values() if o.segment.segment_id in segments]
        return [self._drop(o, reason, release_space=False) for o in gone]

    # ----------------------------------------------------------------------------- writes
    def put_start(
        self, key: str, size: int, writer: str, now_ms: int, parent: str | None = None
    ) -> tuple[Reservation | None, list[Event]]:
        """Reserve ``size`` bytes for ``key``.

        Returns ``(None, [])`` when the key is already READY (or DEMOTING: stored, on
        its way to SSD): a duplicate put is a no-op.  The events are inline evictions and
        demotions made to find room.  Raises WriteConflict when another writer holds the
        key PENDING, :class:`NoRoom` (a NoSpace carrying the events made meanwhile) when
        no room can be made now.
        """
        if now_ms > self._now:
            self._now = now_ms
        if size <= 0:
            raise PoolError(f"{key}: an object needs at least one byte, got size {size}")
        objects = self._objects
        obj = objects.get(key)
        if obj is not None:
            if obj.state is _READY or obj.state is _DEMOTING:
                return None, []
            if obj.writer != writer and obj.writer_expiry_ms > now_ms:
                raise WriteConflict(f"{key} is being written by {obj.writer}")
            self._drop(obj, "revoked")  # our own retry, or an expired writer
        events: list[Event] = []
        placed = self._allocate(_MEMORY, size, now_ms, events)
        if placed is None:
            self.stats.put_failures_no_space += 1
            if self._leaving_total and self._room_coming(self._segments(_MEMORY), size):
                raise NoRoom(
                    f"no room for {size} bytes yet: objects are being copied to their "
                    "node's SSD tier to make it",
                    events,
                    coming=True,
                )
            raise NoRoom(
                f"no memory segment can hold {size} bytes: every object is leased, pinned "
                "or being written (or the object is larger than any segment)",
                events,
            )
        seg, extent = placed
        expiry = now_ms + self.config.writer_ttl_ms
        loc = Location(seg.segment_id, seg.client_id, seg.tier, extent.offset, extent.length)
        objects[key] = ObjectRecord(
            key, _PENDING, seg, extent, parent, writer, expiry, _location=loc
        )
        self._pending += 1
        heapq.heappush(self._writer_heap, (expiry, key, writer))
        return Reservation(key, loc, expiry), events

    def put_end(self, key: str, writer: str, now_ms: int, checksum: int = 0) -> None:
        """Make a written object visible."""
        if now_ms > self._now:
            self._now = now_ms
        obj = self._objects.get(key)
        if obj is None or obj.state is not _PENDING or obj.writer != writer:
            obj = self._pending_of(key, writer)  # raises StaleWrite
        obj.state = _READY
        obj.checksum = checksum
        self._pending -= 1
        if obj.segment.tier is _MEMORY:
            self._ready[0] += 1
            self._mem_policy.on_insert(key, obj.parent)
        else:
            self._ready[1] += 1
            self._ssd_policy.on_insert(key, obj.parent)

    def put_revoke(self, key: str, writer: str) -> None:
        """Abandon a reservation; its space is free again."""
        self._drop(self._pending_of(key, writer), "revoked")

    def restore(
        self,
        key: str,
        segment_id: str,
        offset: int,
        size: int,
        checksum: int,
        now_ms: int,
        parent: str | None = None,
    ) -> bool:
        """Re-announce a READY object a node still holds (after a master restart).

        False when the key is already known elsewhere or there is no room for it: the node
        then drops its copy, since the index is the one truth about what is readable.  The
        same object announced again from the same place is True (a node may retry a
        re-announcement that failed part-way, and must not delete what is in use).

        In a memory segment the object takes exactly its extent (``offset`` is where its
        bytes are).  In an SSD segment ``offset`` is ignored: files are found by key, so
        an SSD extent only accounts for space and any free one will do (the owner cannot
        know the offsets a previous master handed out).
        """
        self._now = max(self._now, now_ms)
        seg = self.registry.segment(segment_id)
        known = self._objects.get(key)
        if known is not None:
            return (
                known.segment is seg
                and known.state is State.READY
                and known.checksum == checksum
                and known.extent.length == size
                and (seg.tier is Tier.SSD or known.extent.offset == offset)
            )
        if size <= 0:
            return False
        if seg.tier is Tier.SSD:
            placed = seg.space.allocate(size) if seg.space.free >= size else None
            if placed is None:
                return False
            extent = placed
        else:
            extent = Extent(offset, size)
            if not seg.space.take(extent):
                return False
        self._objects[key] = ObjectRecord(key, State.READY, seg, extent, parent, "", 0, checksum)
        self._ready[seg.tier is _SSD] += 1
        self._policies[seg.tier].on_insert(key, parent)
        return True

    # ------------------------------------------------------------------------ removals
    def remove(self, key: str, now_ms: int) -> Event:
        self._now = max(self._now, now_ms)
        obj = self._objects.get(key)
        if obj is None or obj.state is not State.READY:
            raise ObjectNotFound(key)
        if obj.held(now_ms):
            raise ObjectBusy(f"{key} is leased or pinned")
        return self._drop(obj, "removed")

    def drop_corrupt(self, key: str, segment_id: str, offset: int, checksum: int) -> Event | None:
        """A reader found the READY copy of ``key`` at ``segment_id``/``offset`` with
        ``checksum`` corrupt: drop it (None when that copy is no longer the one stored)."""
        obj = self._objects.get(key)
        if (
            obj is None
            or obj.state is not _READY
            or obj.segment.segment_id != segment_id
            or obj.extent.offset != offset
            or obj.checksum != checksum
        ):
            return None
        return self._drop(obj, "corrupt")

    # -------------------------------------------------------------------------- time, eviction
    def tick(self, now_ms: int) -> list[Event]:
        """Expire leases, writers and clients, then run watermark eviction rounds."""
        self._now = max(self._now, now_ms)
        events: list[Event] = []
        self._expire_holds(now_ms)
        self._expire_writers(now_ms, events)
        for client_id in self.registry.expired(now_ms):
            events.extend(self.remove_client(client_id))
        for tier in Tier:
            events.extend(self.eviction_round(tier, now_ms))
        return events

    def demote_failed(self, key: str) -> None:
        """The copy of a Demote effect failed: the object is gone."""
        obj = self._objects.get(key)
        if obj is not None:
            self.stats.demote_failures += 1
            self._drop(obj, "demote_failed")

    # --------------------------------------------------------------------- introspection
    def __len__(self) -> int:
        return len(self._objects)

    def count(self, tier: Tier | None = None, state: State = State.READY) -> int:
        """Objects in ``state`` (in ``tier``, or all); kept, not scanned."""
        if state is State.PENDING:
            return self._pending if tier is None or tier is _MEMORY else 0
        if state is State.DEMOTING:
            return self._demoting if tier is None or tier is _MEMORY else 0
        return sum(self._ready) if tier is None else self._ready[tier is _SSD]

    def location_of(self, key: str) -> Location | None:
        obj = self._objects.get(key)
        return obj.location() if obj is not None else None

    def state_of(self, key: str) -> State | None:
        obj = self._objects.get(key)
        return obj.state if obj is not None else None

    def check(self) -> None:
        """Assert the module's invariants (used by tests)."""
        per_segment: dict[str, int] = {}
        extents: dict[str, set[tuple[int, int]]] = {}  # segment -> objects' extents
        leaving: dict[str, int] = {}
        for obj in self._objects.values():
            taken = [(obj.segment, obj.extent)]
            if obj.state is State.DEMOTING:
                assert obj.target is not None and not obj.holds, f"{obj.key}: bad copy"
                taken.append(obj.target)
                sid = obj.segment.segment_id
                leaving[sid] = leaving.get(sid, 0) + obj.extent.length
            for seg, ext in taken:
                assert self.registry.segments.get(seg.segment_id) is seg, f"{obj.key}: dead"
                per_segment[seg.segment_id] = per_segment.get(seg.segment_id, 0) + ext.length
                extents.setdefault(seg.segment_id, set()).add((ext.offset, ext.length))
        assert leaving == self._leaving and sum(leaving.values()) == self._leaving_total
        for seg in self.registry.segments.values():
            seg.space.check()
            assert seg.space.used == per_segment.get(seg.segment_id, 0), seg.segment_id
            live = {(e.offset, e.length) for e in seg.space.live_extents()}
            mine = extents.get(seg.segment_id, set())
            assert live == mine, f"{seg.segment_id}: extents and objects disagree"
        objects = list(self._objects.values())
        for tier in Tier:
            ready = sum(1 for o in objects if o.state is State.READY and o.segment.tier is tier)
            assert self._ready[tier is _SSD] == ready, f"{tier.value}: READY count kept wrong"
            held = sum(1 for o in objects if o.holds and o.segment.tier is tier)
            assert self._held[tier is _SSD] == held, f"{tier.value}: held count kept wrong"
        assert self._pending == sum(1 for o in objects if o.state is State.PENDING)
        assert self._demoting == sum(1 for o in objects if o.state is State.DEMOTING)
        assert self._hold_entries == sum(len(o.holds) for o in objects)
        assert not any(o.holds for o in objects if o.state is State.PENDING)

    # --------------------------------------------------------------------------- internals
    def _pending_of(self, key: str, writer: str) -> ObjectRecord:
        obj = self._objects.get(key)
        if obj is None or obj.state is not State.PENDING or obj.writer != writer:
            raise StaleWrite(f"no pending write of {key} by {writer} (expired or revoked?)")
        return obj

    def _expire_writers(self, now_ms: int, events: list[Event]) -> None:
        heap = self._writer_heap
        while heap and heap[0][0] <= now_ms:
            expiry, key, writer = heapq.heappop(heap)
            obj = self._objects.get(key)
            if (
                obj is not None
                and obj.state is State.PENDING
                and obj.writer == writer
                and obj.writer_expiry_ms == expiry
            ):
                self.stats.revoked_writes += 1
                events.append(self._drop(obj, "writer_expired"))
