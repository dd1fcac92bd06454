"""The object index: where every object lives, who may read it, and what to evict.

Object life cycle::

    put_start ──> PENDING ──put_end──> READY ──evict / remove / client expiry──> gone
                     │                   │
                     └─put_revoke / writer lease expiry──> gone (space reclaimed)
                                         └─(offload) demote: memory extent -> SSD extent

Invariants (tested per transition and by property tests over random operation sequences):
- a PENDING object is invisible: ``exists``, ``prefix_lookup`` and ``get`` see READY only;
- every object holds exactly one live extent in a registered segment, and a segment's used
  bytes equal the sum of its objects' sizes (``check()`` asserts this);
- an object with an unexpired read lease or pin is never evicted, demoted or removed;
- probes (``exists``, ``prefix_lookup``) never take or renew a lease;
- after an eviction round a tier is at or below its high watermark, unless every object
  left in it is leased, pinned or pending;
- a put that needs space evicts inline; it fails with NoSpace only when nothing evictable
  is left that would make room.

Demotion (``enable_offload``): evicting a memory object whose owner also contributes an SSD
segment moves it there instead of dropping it.  The move is logical at once (the object's
location is the SSD extent and the memory extent is free) and the index returns a
:class:`Demote` effect that the caller must carry out, copying the bytes, before it hands
out any later reservation; if the copy fails the caller reports ``demote_failed`` and the
object is dropped.  Readers verify checksums end to end, so a copy that was overtaken is a
miss, never wrong bytes.

Time is a parameter (``now_ms``); the index never reads a clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.eviction import EvictionPolicy, make_eviction_policy
from kvpool.core.objects import (
    Demote,
    Dropped,
    Event,
    IndexConfig,
    IndexStats,
    Location,
    ObjectRecord,
    ReadGrant,
    Reservation,
    State,
)
from kvpool.core.registry import Registry, Segment, Tier
from kvpool.core.space import Extent
from kvpool.errors import (
    NoSpace,
    ObjectBusy,
    ObjectNotFound,
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
    "ObjectIndex",
    "ReadGrant",
    "Reservation",
    "State",
]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_READY, _PENDING = State.READY, State.PENDING
_MEMORY, _SSD = Tier.MEMORY, Tier.SSD


class ObjectIndex:
    """All objects of the pool, their placement, leases, pins and eviction order."""

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self.registry = Registry(self.config.client_ttl_ms)
        self.stats = IndexStats()
        self._objects: dict[str, ObjectRecord] = {}
        self._policies: dict[Tier, EvictionPolicy[Any]] = {
            t: make_eviction_policy(self.config.policy) for t in Tier
        }
        self._mem_policy = self._policies[_MEMORY]
        self._ssd_policy = self._policies[_SSD]
        # each tier's segments, kept until add_segment or remove_client changes them
        self._mem_segments: list[Segment] | None = None
        self._ssd_segments: list[Segment] | None = None
        self._evictable_at = 0
        self._evictable_fn: Callable[[str], bool] | None = None
        self._owner_keys: dict[str, set[str]] = {}
        self._hold_heap: list[tuple[int, str, str]] = []  # (expiry, key, owner), lazy
        self._writer_heap: list[tuple[int, str, str]] = []  # (expiry, key, writer), lazy
        self._now = 0
        # Counts kept as objects change, so that metrics, the status page and eviction
        # rounds never scan the whole index: at 500,000 objects one scan took 40-250 ms
        # of the master's event loop.  check() compares each with a scan.
        self._ready: dict[Tier, int] = dict.fromkeys(Tier, 0)  # READY objects per tier
        self._held: dict[Tier, int] = dict.fromkeys(Tier, 0)  # objects with any hold entry
        self._pending = 0  # PENDING objects (all in memory segments)
        self._hold_entries = 0  # (object, owner) holds present, expired or not

    # ----------------------------------------------------------------- clients, segments
    def register_client(self, client_id: str, now_ms: int, address: str = "") -> bool:
        self._now = max(self._now, now_ms)
        return self.registry.register(client_id, now_ms, address)

    def heartbeat(self, client_id: str, now_ms: int) -> None:
        self._now = max(self._now, now_ms)
        self.registry.heartbeat(client_id, now_ms)

    def add_segment(
        self, client_id: str, segment_id: str, capacity: int, tier: Tier = Tier.MEMORY
    ) -> None:
        self.registry.add_segment(client_id, segment_id, capacity, tier)
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

        Returns ``(None, [])`` when the key is already READY: a duplicate put is a no-op.
        The events are inline evictions and demotions made to find room.
        Raises WriteConflict when another writer holds the key PENDING, NoSpace when no
        room can be made.
        """
        if now_ms > self._now:
            self._now = now_ms
        if size <= 0:
            raise ValueError(f"object size must be positive, got {size}")
        objects = self._objects
        obj = objects.get(key)
        if obj is not None:
            if obj.state is _READY:
                return None, []
            if obj.writer != writer and obj.writer_expiry_ms > now_ms:
                raise WriteConflict(f"{key} is being written by {obj.writer}")
            self._drop(obj, "revoked")  # our own retry, or an expired writer
        events: list[Event] = []
        placed = self._allocate(_MEMORY, size, now_ms, events)
        if placed is None:
            self.stats.put_failures_no_space += 1
            raise NoSpace(
                f"no memory segment can hold {size} bytes: every object is leased, pinned "
                "or being written (or the object is larger than any segment)"
            )
        seg, extent = placed
        expiry = now_ms + self.config.writer_ttl_ms
        obj = ObjectRecord(key, _PENDING, seg, extent, parent, writer, expiry)
        objects[key] = obj
        self._pending += 1
        heapq.heappush(self._writer_heap, (expiry, key, writer))
        return Reservation(key, obj.location(), expiry), events

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
        self._ready[obj.segment.tier] += 1
        policy = self._mem_policy if obj.segment.tier is _MEMORY else self._ssd_policy
        policy.on_insert(key, obj.parent)

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
        self._ready[seg.tier] += 1
        self._policies[seg.tier].on_insert(key, parent)
        return True

    # ------------------------------------------------------------------------------ reads
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

    def remove(self, key: str, now_ms: int) -> Event:
        self._now = max(self._now, now_ms)
        obj = self._objects.get(key)
        if obj is None or obj.state is not State.READY:
            raise ObjectNotFound(key)
        if obj.held(now_ms):
            raise ObjectBusy(f"{key} is leased or pinned")
        return self._drop(obj, "removed")

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

    def eviction_round(self, tier: Tier, now_ms: int) -> list[Event]:
        """If the tier is at or above its high watermark, evict ``eviction_ratio`` of its
        evictable objects, and more if needed to get back under the watermark."""
        capacity, used = self.usage(tier)
        limit = self.config.high_watermark * capacity
        if capacity == 0 or used < limit:
            return []
        policy = self._policies[tier]
        evictable = self._evictable_count(tier, now_ms)
        want = max(1, math.ceil(self.config.eviction_ratio * evictable))
        events: list[Event] = []
        evicted = 0
        while True:
            victims = policy.choose_victims(max(want - evicted, 16), self._evictable(now_ms))
            if not victims:
                break
            for key in victims:
                self._evict(self._objects[key], now_ms, events)
                evicted += 1
                if evicted >= want and self.usage(tier)[1] < limit:
                    return events
        return events

    def usage(self, tier: Tier) -> tuple[int, int]:
        """(capacity, used) bytes over every segment of a tier."""
        segs = self._segments(tier)
        return sum(s.capacity for s in segs), sum(s.space.used for s in segs)

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
        return sum(self._ready.values()) if tier is None else self._ready[tier]

    def active_leases(self, now_ms: int) -> int:
        """Unexpired leases and pins.  Expired ones are released first, as the next tick
        would do, so the kept count is exact."""
        self._expire_holds(now_ms)
        return self._hold_entries

    def location_of(self, key: str) -> Location | None:
        obj = self._objects.get(key)
        return obj.location() if obj is not None else None

    def state_of(self, key: str) -> State | None:
        obj = self._objects.get(key)
        return obj.state if obj is not None else None

    def check(self) -> None:
        """Assert the module's invariants (used by tests)."""
        per_segment: dict[str, int] = {}
        for obj in self._objects.values():
            seg = obj.segment
            assert self.registry.segments.get(seg.segment_id) is seg, f"{obj.key}: dead segment"
            per_segment[seg.segment_id] = per_segment.get(seg.segment_id, 0) + obj.extent.length
        for seg in self.registry.segments.values():
            seg.space.check()
            assert seg.space.used == per_segment.get(seg.segment_id, 0), seg.segment_id
            live = {(e.offset, e.length) for e in seg.space.live_extents()}
            mine = {
                (o.extent.offset, o.extent.length)
                for o in self._objects.values()
                if o.segment is seg
            }
            assert live == mine, f"{seg.segment_id}: extents and objects disagree"
        objects = list(self._objects.values())
        for tier in Tier:
            ready = sum(1 for o in objects if o.state is State.READY and o.segment.tier is tier)
            assert self._ready[tier] == ready, f"{tier.value}: READY count kept wrong"
            held = sum(1 for o in objects if o.holds and o.segment.tier is tier)
            assert self._held[tier] == held, f"{tier.value}: held count kept wrong"
        assert self._pending == sum(1 for o in objects if o.state is State.PENDING)
        assert self._hold_entries == sum(len(o.holds) for o in objects)
        assert not any(o.holds for o in objects if o.state is State.PENDING)

    # --------------------------------------------------------------------------- internals
    def _pending_of(self, key: str, writer: str) -> ObjectRecord:
        obj = self._objects.get(key)
        if obj is None or obj.state is not State.PENDING or obj.writer != writer:
            raise StaleWrite(f"no pending write of {key} by {writer} (expired or revoked?)")
        return obj

    def _hold(self, obj: ObjectRecord, owner: str, expiry: int) -> int:
        holds = obj.holds
        before = holds.get(owner)
        if before is None:
            if not holds:
                self._held[obj.segment.tier] += 1
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
            self._held[obj.segment.tier] -= 1

    def _evictable(self, now_ms: int) -> Callable[[str], bool]:
        """The ``can_evict`` a policy is given: READY, and no unexpired lease or pin.
        Kept for the last ``now_ms`` asked: the puts of one request share their time."""
        if now_ms == self._evictable_at and self._evictable_fn is not None:
            return self._evictable_fn
        objects = self._objects

        def can_evict(key: str) -> bool:
            obj = objects.get(key)
            return (
                obj is not None and obj.state is _READY and (not obj.holds or not obj.held(now_ms))
            )

        self._evictable_at, self._evictable_fn = now_ms, can_evict
        return can_evict

    def _evictable_in(self, seg: Segment, now_ms: int) -> Callable[[str], bool]:
        can_evict = self._evictable(now_ms)
        return lambda k: can_evict(k) and self._objects[k].segment is seg

    def _segments(self, tier: Tier) -> list[Segment]:
        """``registry.tier_segments(tier)``, made again only after segments change."""
        # two attributes rather than a dict keyed by Tier: an Enum's hash is Python code
        if tier is _MEMORY:
            segs = self._mem_segments
            if segs is None:
                segs = self._mem_segments = self.registry.tier_segments(tier)
        else:
            segs = self._ssd_segments
            if segs is None:
                segs = self._ssd_segments = self.registry.tier_segments(tier)
        return segs

    def _evictable_count(self, tier: Tier, now_ms: int) -> int:
        self._expire_holds(now_ms)  # then every hold left is unexpired
        return self._ready[tier] - self._held[tier]

    def _allocate(
        self, tier: Tier, size: int, now_ms: int, events: list[Event]
    ) -> tuple[Segment, Extent] | None:
        """Find room in ``tier``, evicting inline (best victims first) while that helps."""
        segments = self._segments(tier)
        policy = self._mem_policy if tier is _MEMORY else self._ssd_policy
        can_evict: Callable[[str], bool] | None = None  # made on the first eviction only
        if len(segments) == 1:  # the usual case: no search over segments (~30% of a put)
            only = segments[0]
            space = only.space
            if space.capacity < size:
                return None
            while True:
                if space.capacity - space.used >= size:
                    extent = space.allocate(size)
                    if extent is not None:
                        return only, extent
                if can_evict is None:
                    can_evict = self._evictable(now_ms)
                victims = policy.choose_victims(1, can_evict)
                if not victims:
                    return None
                self._evict(self._objects[victims[0]], now_ms, events)
        if not any(s.capacity >= size for s in segments):
            return None
        while True:
            placed = self._fit(segments, size)
            if placed is not None:
                return placed
            # one victim at a time: KV objects are mostly of one size, so one eviction
            # usually makes exactly the room needed (and asking for more costs checks)
            if can_evict is None:
                can_evict = self._evictable(now_ms)
            victims = policy.choose_victims(1, can_evict)
            if not victims:
                return None
            self._evict(self._objects[victims[0]], now_ms, events)

    @staticmethod
    def _fit(segments: list[Segment], size: int) -> tuple[Segment, Extent] | None:
        """Allocate in the segment with the most free space that has a large enough hole."""
        if len(segments) > 1:  # one segment (the usual case) needs no ordering
            segments = sorted(segments, key=lambda s: s.space.free, reverse=True)
        for seg in segments:
            if seg.space.free >= size:
                extent = seg.space.allocate(size)
                if extent is not None:
                    return seg, extent
        return None

    def _evict(self, obj: ObjectRecord, now_ms: int, events: list[Event]) -> None:
        if obj.segment.tier is _MEMORY and self.config.enable_offload:
            dst = self._ssd_room(obj, now_ms, events)
            if dst is not None:
                seg, extent = dst
                src = obj.location()
                self._mem_policy.on_remove(obj.key)
                obj.segment.space.release(obj.extent)
                self._ready[_MEMORY] -= 1
                self._ready[_SSD] += 1
                if obj.holds:  # only expired ones, or it would not be evicted
                    self._held[_MEMORY] -= 1
                    self._held[_SSD] += 1
                obj.move(seg, extent)
                self._ssd_policy.on_insert(obj.key, obj.parent)
                self.stats.demotions += 1
                events.append(Demote(obj.key, src, obj.location(), obj.checksum))
                return
        self.stats.evictions += 1
        events.append(self._drop(obj, "evicted"))

    def _ssd_room(
        self, obj: ObjectRecord, now_ms: int, events: list[Event]
    ) -> tuple[Segment, Extent] | None:
        """An SSD extent on the same client as ``obj`` (it copies the bytes locally)."""
        owner = obj.segment.client_id
        ssd = [s for s in self._segments(_SSD) if s.client_id == owner]
        for seg in ssd:
            while True:
                extent = seg.space.allocate(obj.extent.length)
                if extent is not None:
                    return seg, extent
                victims = self._ssd_policy.choose_victims(4, self._evictable_in(seg, now_ms))
                if not victims:
                    break
                for key in victims:
                    self.stats.evictions += 1
                    events.append(self._drop(self._objects[key], "evicted"))
        return None

    def _drop(self, obj: ObjectRecord, reason: str, release_space: bool = True) -> Dropped:
        key = obj.key
        seg = obj.segment
        del self._objects[key]
        if release_space:
            seg.space.release(obj.extent)
        if obj.state is _READY:
            self._ready[seg.tier] -= 1
            (self._mem_policy if seg.tier is _MEMORY else self._ssd_policy).on_remove(key)
        else:
            self._pending -= 1
        if obj.holds:
            self._held[seg.tier] -= 1
            self._hold_entries -= len(obj.holds)
            owner_keys = self._owner_keys
            for owner in obj.holds:
                keys = owner_keys.get(owner)
                if keys is not None:
                    keys.discard(key)
                    if not keys:
                        del owner_keys[owner]
        return Dropped(key, seg.tier, reason, seg.client_id)

    def _expire_holds(self, now_ms: int) -> None:
        heap = self._hold_heap
        while heap and heap[0][0] <= now_ms:
            expiry, key, owner = heapq.heappop(heap)
            obj = self._objects.get(key)
            if obj is not None and obj.holds.get(owner) == expiry:
                self.stats.expired_leases += 1
                self.release(key, owner)

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
