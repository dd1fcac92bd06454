"""Placement: where an object of the index goes, and what leaves to make room for it.

The part of :class:`~kvpool.core.index.ObjectIndex` that finds space (its lowest base
class; it holds the index's state, ``leases.py`` the reads and holds, and ``index.py`` the
life cycle of objects):

    _allocate(tier, size, now, events)  an extent in ``tier``, evicting inline (best victims
                                        first, one at a time) while that makes room
    _evict(obj, now, events)            drop an object, or demote it to an SSD segment of
                                        its owner when ``enable_offload`` (a Demote effect)
    eviction_round(tier, now)           watermark eviction of one tier (``tick`` runs it)
    usage(tier)                         (capacity, used) bytes of a tier
    _drop(obj, reason)                  an object leaves: its space, counts, policy, holds
    defer_copies(owner) / stall_copies  an owner whose demotions are copied while the index
                                        serves others (a node), or whose copies stopped
                                        being answered (its victims are then dropped)

Copies in flight (owners with deferred copies): a demoted object is DEMOTING, invisible,
and holds both its memory extent and its SSD extent until the caller reports the copy
done or abandoned, so the memory is never reused under a copy and the SSD copy is never
read before it exists.  Their memory bytes are *leaving*: an eviction round counts them as
gone (or it would demote everything while they copy), and a put that only they would make
room for stops evicting and fails with ``NoRoom(coming=True)``, for the caller to retry
when they are done, instead of demoting the whole tier for one object.

Rules (the index's invariants, see ``index.py``): only READY objects without an unexpired
lease or pin are victims (``_evictable``); a put fails with NoSpace only when nothing
evictable is left that would make room; after an eviction round a tier is at or below its
high watermark unless everything left in it is leased, pinned or pending.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    State,
)
from kvpool.core.registry import Registry, Segment, Tier
from kvpool.core.space import Extent

__all__ = ["IndexPlacement"]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_READY, _DEMOTING = State.READY, State.DEMOTING
_MEMORY, _SSD = Tier.MEMORY, Tier.SSD


class IndexPlacement:
    """The index's state, and how room is made in it (see the module docstring)."""

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
        self._owner_keys: dict[str, set[str]] = {}  # owner -> keys it holds
        # Counts kept as objects change, so that metrics, the status page and eviction
        # rounds never scan the whole index: at 500,000 objects one scan took 40-250 ms
        # of the master's event loop.  ObjectIndex.check() compares each with a scan.
        # Per tier, as [memory, SSD] lists indexed by ``tier is _SSD`` (a bool is an int):
        # a dict keyed by Tier hashed the enum in Python code twice per put and eviction.
        self._ready: list[int] = [0, 0]  # READY objects per tier
        self._held: list[int] = [0, 0]  # objects with any hold entry
        self._pending = 0  # PENDING objects (all in memory segments)
        self._hold_entries = 0  # (object, owner) holds present, expired or not
        self._deferred: set[str] = set()  # owners whose demotions are copied later
        self._stalled: set[str] = set()  # ... and whose copies stopped being answered
        self._demoting = 0  # DEMOTING objects
        self._leaving: dict[str, int] = {}  # memory segment -> bytes of its copies in flight
        self._leaving_total = 0

    def defer_copies(self, owner: str) -> None:
        """``owner`` copies its demotions while the index goes on (see the module doc)."""
        self._deferred.add(owner)

    def stall_copies(self, owner: str, stalled: bool) -> None:
        """``owner`` stopped answering copies (its victims are dropped, not demoted), or
        answered again."""
        if stalled:
            self._stalled.add(owner)
        else:
            self._stalled.discard(owner)

    def _expire_holds(self, now_ms: int) -> None:
        """Release every lease and pin expired at ``now_ms`` (``leases.py``'s)."""
        raise NotImplementedError

    def eviction_round(self, tier: Tier, now_ms: int) -> list[Event]:
        """If the tier is at or above its high watermark, evict ``eviction_ratio`` of its
        evictable objects, and more if needed to get back under the watermark."""
        capacity, used = self.usage(tier)
        limit = self.config.high_watermark * capacity
        if capacity == 0 or used - self._leaving_of(tier) < limit:
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
                if evicted >= want and self.usage(tier)[1] - self._leaving_of(tier) < limit:
                    return events
        return events

    def usage(self, tier: Tier) -> tuple[int, int]:
        """(capacity, used) bytes over every segment of a tier."""
        segs = self._segments(tier)
        return sum(s.capacity for s in segs), sum(s.space.used for s in segs)

    def _leaving_of(self, tier: Tier) -> int:
        return self._leaving_total if tier is _MEMORY else 0

    def _room_coming(self, segments: list[Segment], size: int) -> bool:
        """Copies in flight will make room for ``size`` bytes in one of ``segments``."""
        leaving = self._leaving
        return any(
            seg.segment_id in leaving
            and seg.space.capacity - seg.space.used + leaving[seg.segment_id] >= size
            for seg in segments
        )

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
        t = tier is _SSD
        return self._ready[t] - self._held[t]

    def _allocate(
        self, tier: Tier, size: int, now_ms: int, events: list[Event]
    ) -> tuple[Segment, Extent] | None:
        """Find room in ``tier``, evicting inline (best victims first) while that helps."""
        segments = self._segments(tier)
        policy = self._mem_policy if tier is _MEMORY else self._ssd_policy
        # One victim at a time: KV objects are mostly of one size, so one eviction
        # usually makes exactly the room needed (and asking for more costs checks).
        if len(segments) == 1:  # the usual case: no search over segments (~30% of a put)
            only = segments[0]
            space = only.space
            if space.capacity < size:
                return None
            # Victims are dropped here rather than through _evict_one/_evict/_drop: this
            # loop runs for nearly every put of a full pool, and those layers were half of
            # its time.  Demotion (offload) still takes _evict.
            demote = self.config.enable_offload and tier is _MEMORY
            objects = self._objects
            while True:
                if space.capacity - space.used >= size:
                    extent = space.allocate(size)
                    if extent is not None:
                        return only, extent
                if self._leaving_total and self._room_coming(segments, size):
                    return None
                victims = policy.choose_victims(1, self._evictable(now_ms))
                if not victims:
                    return None
                victim = objects[victims[0]]
                if demote:
                    self._evict(victim, now_ms, events)
                    continue
                # _drop of a READY victim (can_evict said so) of this tier's one segment
                key = victim.key
                extent = victim.extent
                del objects[key]
                self._ready[tier is _SSD] -= 1
                policy.on_remove(key)
                if victim.holds:  # expired ones only, or it would not be a victim
                    self._clear_holds(victim)
                self.stats.evictions += 1
                events.append(Dropped(key, tier, "evicted", only.client_id))
                if extent.length == size and space.used == space.capacity:
                    # A full segment has no free extent, so releasing this one and
                    # allocating ``size`` would hand back this very extent: keep it live
                    # (the usual case: one block out, one of the same size in).
                    return only, extent
                space.release(extent)
        if not any(s.capacity >= size for s in segments):
            return None
        while True:
            placed = self._fit(segments, size)
            if placed is not None:
                return placed
            if self._leaving_total and self._room_coming(segments, size):
                return None
            if not self._evict_one(policy, now_ms, events):
                return None

    def _evict_one(self, policy: EvictionPolicy[Any], now_ms: int, events: list[Event]) -> bool:
        """Evict (or demote) the policy's best victim; False when nothing is evictable."""
        victims = policy.choose_victims(1, self._evictable(now_ms))
        if not victims:
            return False
        self._evict(self._objects[victims[0]], now_ms, events)
        return True

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
            owner = obj.segment.client_id
            stalled = owner in self._stalled
            dst = None if stalled else self._ssd_room(obj, now_ms, events)
            if dst is not None and owner in self._deferred:
                self._start_copy(obj, dst, events)
                return
            if dst is not None:
                seg, extent = dst
                src = obj.location()
                self._mem_policy.on_remove(obj.key)
                obj.segment.space.release(obj.extent)
                self._ready[0] -= 1  # memory -> SSD
                self._ready[1] += 1
                if obj.holds:  # only expired ones, or it would not be evicted
                    self._held[0] -= 1
                    self._held[1] += 1
                obj.move(seg, extent)
                self._ssd_policy.on_insert(obj.key, obj.parent)
                self.stats.demotions += 1
                events.append(Demote(obj.key, src, obj.location(), obj.checksum))
                return
        self.stats.evictions += 1
        events.append(self._drop(obj, "evicted"))

    def _start_copy(
        self, obj: ObjectRecord, dst: tuple[Segment, Extent], events: list[Event]
    ) -> None:
        """A deferred demotion: DEMOTING, both extents held, its memory bytes leaving."""
        self._mem_policy.on_remove(obj.key)
        self._ready[0] -= 1  # memory
        if obj.holds:  # expired ones only (or it would not be a victim): none may read it
            self._clear_holds(obj)
        obj.state = _DEMOTING
        obj.target = dst
        seg_id = obj.segment.segment_id
        self._leaving[seg_id] = self._leaving.get(seg_id, 0) + obj.extent.length
        self._leaving_total += obj.extent.length
        self._demoting += 1
        self.stats.demotions += 1
        seg, extent = dst
        dst_loc = Location(seg.segment_id, seg.client_id, seg.tier, extent.offset, extent.length)
        events.append(Demote(obj.key, obj.location(), dst_loc, obj.checksum, True))

    def demote_done(self, event: Demote) -> bool:
        """The owner copied an ``in_flight`` demotion: READY on SSD, its memory extent
        free.  False when the object is no longer that copy's (abandoned, dropped)."""
        obj = self._copying(event)
        if obj is None or obj.target is None:
            return False
        seg, extent = obj.target
        self._end_copy(obj)
        obj.segment.space.release(obj.extent)
        obj.move(seg, extent)
        obj.target = None
        obj.state = _READY
        self._ready[1] += 1  # SSD
        self._ssd_policy.on_insert(obj.key, obj.parent)
        return True

    def demote_abandoned(self, event: Demote) -> Dropped | None:
        """An ``in_flight`` copy failed, or its owner did not answer in time: the object
        is gone, both extents free (a late copy is refused by the owner's checksum check
        if the memory was rewritten meanwhile).  None when it was no longer that copy's."""
        obj = self._copying(event)
        if obj is None:
            return None
        self.stats.demote_failures += 1
        return self._drop(obj, "demote_failed")

    def _copying(self, event: Demote) -> ObjectRecord | None:
        obj = self._objects.get(event.key)
        if obj is None or obj.state is not _DEMOTING or obj.target is None:
            return None
        seg, extent = obj.target
        if seg.segment_id != event.dst.segment_id or extent.offset != event.dst.offset:
            return None
        return obj

    def _end_copy(self, obj: ObjectRecord) -> None:
        """The copy of a DEMOTING object is over, done or not: its bytes left."""
        seg_id = obj.segment.segment_id
        left = self._leaving.get(seg_id, 0) - obj.extent.length
        if left > 0:
            self._leaving[seg_id] = left
        else:
            self._leaving.pop(seg_id, None)
        self._leaving_total -= obj.extent.length
        self._demoting -= 1

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
            self._ready[seg.tier is _SSD] -= 1
            (self._mem_policy if seg.tier is _MEMORY else self._ssd_policy).on_remove(key)
        elif obj.state is _DEMOTING:
            self._end_copy(obj)
            if release_space and obj.target is not None:
                obj.target[0].space.release(obj.target[1])
        else:
            self._pending -= 1
        if obj.holds:
            self._clear_holds(obj)
        return Dropped(key, seg.tier, reason, seg.client_id)

    def _clear_holds(self, obj: ObjectRecord) -> None:
        self._held[obj.segment.tier is _SSD] -= 1
        self._hold_entries -= len(obj.holds)
        owner_keys = self._owner_keys
        key = obj.key
        for owner in obj.holds:
            keys = owner_keys.get(owner)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del owner_keys[owner]
        obj.holds = {}
