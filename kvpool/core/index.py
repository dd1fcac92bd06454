"""The object index: every object of the pool, where it lives, and its life cycle.

:class:`ObjectIndex` takes two-phase puts, leased reads, pins, removals, client expiry and
eviction, and returns their effects (:class:`Dropped`, :class:`Demote`) as values;
:data:`LIFE_CYCLE` below is the life cycle, with the invariants ``check()`` asserts.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.core.demotion import Demotions
from kvpool.core.eviction import EvictionPolicy, make_eviction_policy
from kvpool.core.leases import Holds
from kvpool.core.objects import (
    MAX_REPLICAS,
    CopyLost,
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
from kvpool.core.placement import Placer
from kvpool.core.registry import Registry, SegmentRecord, Tier
from kvpool.core.replicas import Replicas, touches
from kvpool.core.space import Extent
from kvpool.errors import (
    ObjectBusy,
    ObjectNotFound,
    PoolError,
    StaleWrite,
    WriteConflict,
)

__all__ = ["LIFE_CYCLE", "ObjectIndex"]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_READY, _PENDING, _DEMOTING = State.READY, State.PENDING, State.DEMOTING
_MEMORY, _SSD = Tier.MEMORY, Tier.SSD

# The object life cycle: (state, event) -> the state after it; None is "not in the index"
# (before a put or a restore, and gone: its space reclaimed).  Every change of an object's
# state goes through _move, which raises on a pair not listed here.
LIFE_CYCLE: dict[tuple[State | None, str], State | None] = {
    # a put: reserved, written, then visible
    (None, "put_start"): _PENDING,
    (_PENDING, "put_end"): _READY,
    (_PENDING, "revoked"): None,  # put_revoke, the writer's own retry, no copy written
    (_PENDING, "writer_expired"): None,
    (None, "restore"): _READY,  # a node re-announces what it holds (a master restarted)
    # a stored object leaves
    (_READY, "evicted"): None,
    (_READY, "removed"): None,
    (_READY, "corrupt"): None,  # a reader found this copy failing its checksum
    # demotion (offload) to the owner's SSD tier
    (_READY, "demoted"): _READY,  # copied at once: it lives at its SSD extent now
    (_READY, "demote_failed"): None,  # ... and that copy failed
    (_READY, "copy_started"): _DEMOTING,  # its owner (a node) copies it later
    (_DEMOTING, "copy_done"): _READY,  # on SSD, its memory extent free
    (_DEMOTING, "taken_back"): _READY,  # read or pinned meanwhile: in memory again
    (_DEMOTING, "demote_failed"): None,  # the copy failed, or was not answered in time
    (_DEMOTING, "removed"): None,
    # its owner left (expired, restarted, or a transfer to it failed)
    (_PENDING, "client_gone"): None,
    (_READY, "client_gone"): None,
    (_DEMOTING, "client_gone"): None,
}
# Invariants (tested per transition, by property tests over random operation sequences,
# and by check() where a scan can see them):
# - a PENDING object is invisible: exists, prefix_lookup and get see READY only;
# - every object holds exactly one live extent in a registered segment (a replicated one,
#   one per copy), and a segment's used bytes equal the sum of its objects' sizes;
# - an object with an unexpired read lease or pin is never evicted, demoted or removed;
# - a DEMOTING object holds its memory and its SSD extent until its copy is reported;
#   probes see it, and a read or pin takes it back (the pool never answers "not found"
#   for bytes it still holds), the copy's report then ignored;
# - probes (exists, prefix_lookup) never take or renew a lease;
# - after an eviction round a tier is at or below its high watermark, unless every
#   object left in it is leased, pinned or pending;
# - a put that needs space evicts inline; it fails with NoSpace only when nothing
#   evictable is left that would make room;
# - a copy a reader found corrupt leaves at once, leases or not (its bytes are wrong for
#   everyone, and a reader overtaken by a later use of the extent fails its own checksum):
#   lookups stop counting it and the next put of the key stores it again;
# - an object has at least one byte: an empty value is refused (PoolError), never stored.

# LIFE_CYCLE keyed by the state's name: a tuple holding an enum member hashes it in
# Python code, twice as slow as the whole lookup by name.
_NEXT = {(None if s is None else s.name, e): after for (s, e), after in LIFE_CYCLE.items()}
_STATES = {s for s, _ in LIFE_CYCLE if s is not None}


def _move(obj: ObjectRecord, event: str) -> State | None:
    """``obj`` takes ``event``: its state after it, set on it (None: it leaves the index,
    and the caller removes it).  A pair not in :data:`LIFE_CYCLE` is the index's own bug."""
    try:
        after = _NEXT[obj.state._name_, event]
    except KeyError:
        raise AssertionError(f"{obj.key}: {obj.state.name} takes no {event!r}") from None
    if after is not None:
        obj.state = after
    return after


def _to(state: State | None, event: str) -> State:
    """The state ``event`` takes an object in ``state`` to, staying in the index."""
    after = LIFE_CYCLE.get((state, event))
    assert after is not None, f"{state} takes no {event!r} that keeps an object"
    return after


# Transitions on the put path whose state is known there (a new object, put_end refuses
# all but PENDING, a victim is READY), looked up here once: two lookups a put into a full
# pool were 13% of its time.
_PUT, _RESTORED, _WRITTEN = _to(None, "put_start"), _to(None, "restore"), _to(_PENDING, "put_end")
assert LIFE_CYCLE[_READY, "evicted"] is None  # _allocate drops its victims itself


class ObjectIndex:
    """All objects of the pool: their placement, leases, pins and eviction order.

    Each object's state follows :data:`LIFE_CYCLE` (with the invariants listed there):
    PENDING while a put writes it, READY once visible, DEMOTING while its owner copies it
    to SSD.  Public methods take objects through it; the effects (:class:`Dropped`,
    :class:`Demote`, :class:`CopyLost`) are returned for the caller to carry out.
    """

    def __init__(self, config: IndexConfig | None = None) -> None:
        self.config = config or IndexConfig()
        self.registry = Registry(self.config.client_ttl_ms)
        self.stats = IndexStats()
        self._objects: dict[str, ObjectRecord] = {}
        self._holds = Holds()
        self._placer = Placer(self.registry)
        self._replicas = Replicas(self.registry, self._placer, self.stats)
        self._demotions = Demotions(self._placer)
        self._policies: dict[Tier, EvictionPolicy[Any]] = {
            t: make_eviction_policy(self.config.policy) for t in Tier
        }
        self._mem_policy = self._policies[_MEMORY]
        self._ssd_policy = self._policies[_SSD]
        # PENDING objects in expiry order (every writer gets the same TTL): a put leaves
        # it when it ends, so it holds the writes in flight only.  (A heap of every put's
        # expiry held each object for the TTL after its end: 100 bytes an object.)
        self._writing: OrderedDict[str, ObjectRecord] = OrderedDict()
        self._evictable_at = 0
        self._evictable_fn: Callable[[str], bool] | None = None
        # Counts kept as objects change, so that metrics, the status page and eviction
        # rounds never scan the whole index: at 500,000 objects one scan took 40-250 ms
        # of the master's event loop.  check() compares each with a scan.
        # Per tier, as [memory, SSD] lists indexed by ``tier is _SSD`` (a bool is an int):
        # a dict keyed by Tier hashed the enum in Python code twice per put and eviction.
        self._ready: list[int] = [0, 0]  # READY objects per tier

    # ----------------------------------------------------------------- clients, segments
    def register_client(self, client_id: str, now_ms: int, address: str = "") -> bool:
        return self.registry.register(client_id, now_ms, address)

    def heartbeat(self, client_id: str, now_ms: int) -> None:
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
        self._placer.segments_changed()

    def open_segment(self, segment_id: str) -> None:
        """New objects may be placed in ``segment_id`` from now on."""
        self.registry.segment(segment_id).placeable = True
        self._placer.segments_changed()

    def remove_client(self, client_id: str, reason: str = "expired_client") -> list[Event]:
        """Drop a client, its segments and every object in them at once; an object with
        a copy on another owner stays, with the copies left."""
        segments = {s.segment_id for s in self.registry.drop(client_id)}
        self._placer.segments_changed()
        gone = [o for o in self._objects.values() if touches(o, segments)]
        events: list[Event] = []
        for obj in gone:
            if obj.replicas is not None:
                dead = [s.client_id for s, _ in obj.copies() if s.segment_id in segments]
                if self._replicas.lose(obj, segments, release=False):
                    events.extend(CopyLost(obj.key, owner, reason) for owner in dead)
                    continue
            events.append(self._drop(obj, reason, release_space=False, event="client_gone"))
        return events

    # ----------------------------------------------------------------------------- writes
    def put_start(
        self,
        key: str,
        size: int,
        writer: str,
        now_ms: int,
        parent: str | None = None,
        replicas: int = 0,
    ) -> tuple[Reservation | None, list[Event]]:
        """Reserve ``size`` bytes for ``key``, in ``replicas`` copies (0: the config's
        ``replica_num``), each on another owner, on other hosts first.  Fewer owners
        than copies: as many copies as there are owners (counted in ``replicas_short``).

        Returns ``(None, [])`` when the key is already READY (or DEMOTING: stored, on
        its way to SSD): a duplicate put is a no-op.  The events are inline evictions and
        demotions made to find room.  Raises WriteConflict when another writer holds the
        key PENDING, :class:`NoRoom` (a NoSpace carrying the events made meanwhile) when
        no room can be made now.
        """
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
            placer = self._placer
            memory = placer.segments(_MEMORY)
            if placer.leaving_total and placer.room_coming(memory, size):
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
        if parent is not None:  # the parent's own key string: one copy of each key kept
            above = objects.get(parent)
            parent = above.key if above is not None else parent
        record = objects[key] = ObjectRecord(key, _PUT, seg, extent, parent, writer, expiry)
        self._writing[key] = record
        copies = replicas or self.config.replica_num
        if copies <= 1:
            return Reservation(key, loc, expiry), events
        if copies > MAX_REPLICAS:
            self._drop(record, "revoked")
            raise PoolError(f"{key}: replica_num must be in [1, {MAX_REPLICAS}], got {copies}")
        more = record.replicas = self._replicas.place(
            record, copies - 1, lambda seg, size: self._room_in(seg, size, now_ms, events)
        )
        others = () if more is None else tuple(_location(s, e) for s, e in more)
        return Reservation(key, loc, expiry, others), events

    def put_end(
        self,
        key: str,
        writer: str,
        now_ms: int,
        checksum: int = 0,
        unwritten: Sequence[str] = (),
    ) -> list[Event]:
        """Make a written object visible.  ``unwritten``: segments of its copies the
        writer could not write (those copies go; the events tell their owners)."""
        obj = self._objects.get(key)
        if obj is None or obj.state is not _PENDING or obj.writer != writer:
            obj = self._pending_of(key, writer)  # raises StaleWrite
        lost: list[Event] = []
        if unwritten:
            lost = self._replicas.lost(obj, set(unwritten), "unwritten")
            if obj.segment.segment_id in unwritten:  # no copy was written
                self._drop(obj, "revoked")
                raise StaleWrite(f"{key}: no copy of it was written")
        obj.state = _WRITTEN  # _move(obj, "put_end"), its state checked above
        obj.checksum = checksum
        obj.writer_expiry_ms = 0  # read only while PENDING: its int is freed
        del self._writing[key]
        # obj.key, not ``key``: the policy keeps the record's string, not a second copy
        if obj.segment.tier is _MEMORY:
            self._ready[0] += 1
            self._mem_policy.on_insert(obj.key, obj.parent)
        else:
            self._ready[1] += 1
            self._ssd_policy.on_insert(obj.key, obj.parent)
        return lost

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
        seg = self.registry.segment(segment_id)
        known = self._objects.get(key)
        if known is not None:
            if known.state is not State.READY or known.checksum != checksum:
                return False
            if known.extent.length != size:
                return False
            for copy_seg, copy_ext in known.copies():
                if copy_seg is seg:
                    return seg.tier is Tier.SSD or copy_ext.offset == offset
            return self._replicas.restore(known, seg, offset, size)
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
        self._objects[key] = ObjectRecord(key, _RESTORED, seg, extent, parent, "", 0, checksum)
        self._ready[seg.tier is _SSD] += 1
        self._policies[seg.tier].on_insert(key, parent)
        return True

    # ------------------------------------------------------------------------------ reads
    def exists(self, key: str) -> bool:
        """Probe without a lease (probes renewing leases blocked eviction in peer projects)."""
        obj = self._objects.get(key)
        return obj is not None and obj.state is not _PENDING

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """:meth:`exists` of each key.  In C when no write is in flight (the usual case of
        a lookup storm): a PENDING object is among the objects and in ``_writing``."""
        objects, writing = self._objects, self._writing
        if not writing:
            return list(map(objects.__contains__, keys))
        return [k in objects and k not in writing for k in keys]

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys are stored (READY, or DEMOTING); takes no lease."""
        objects = self._objects
        n = 0
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.state is _PENDING:
                break
            n += 1
        return n

    def get(self, key: str, owner: str, now_ms: int) -> ReadGrant:
        """Grant a read lease of ``lease_ttl_ms`` on a stored object."""
        obj = self._stored(key)
        expiry = self._holds.hold(obj, owner, now_ms + self.config.lease_ttl_ms)
        (self._mem_policy if obj.segment.tier is _MEMORY else self._ssd_policy).on_access(key)
        copies = 1 if obj.replicas is None else 1 + len(obj.replicas)
        return ReadGrant(key, obj.location(), obj.checksum, expiry, copies)

    def pin(self, key: str, owner: str, now_ms: int, ttl_ms: int) -> None:
        """Hold an object for ``ttl_ms`` (e.g. until a decode pulled it); owner-released."""
        self._holds.hold(self._stored(key), owner, now_ms + ttl_ms)

    def _stored(self, key: str) -> ObjectRecord:
        """The READY record of ``key`` for a read or pin; a copy in flight is taken back."""
        obj = self._objects.get(key)
        if obj is None or obj.state is _PENDING:
            raise ObjectNotFound(key)
        if obj.state is _DEMOTING:
            self._take_back(obj)
        return obj

    def release(self, key: str, owner: str) -> None:
        """``owner``'s lease or pin of ``key`` ends."""
        self._holds.release(key, owner)

    def release_owner(self, owner: str) -> int:
        """Drop every lease and pin of ``owner`` (an aborted or finished request)."""
        return self._holds.release_owner(owner)

    def active_leases(self, now_ms: int) -> int:
        """Unexpired leases and pins.  Expired ones are released first, as the next tick
        would do, so the kept count is exact."""
        self._expire_holds(now_ms)
        return self._holds.entries

    # ------------------------------------------------------------------------ removals
    def remove(self, key: str, now_ms: int) -> Event:
        obj = self._objects.get(key)
        if obj is None or obj.state is _PENDING:
            raise ObjectNotFound(key)
        if obj.held(now_ms):
            raise ObjectBusy(f"{key} is leased or pinned")
        return self._drop(obj, "removed")

    def drop_corrupt(self, key: str, segment_id: str, offset: int, checksum: int) -> Event | None:
        """A reader found the READY copy of ``key`` at ``segment_id``/``offset`` with
        ``checksum`` corrupt: drop it (None when that copy is no longer one stored).  Of
        a replicated object only that copy goes (:class:`CopyLost`)."""
        obj = self._objects.get(key)
        if obj is None or obj.state is not _READY or obj.checksum != checksum:
            return None
        if not any(s.segment_id == segment_id and e.offset == offset for s, e in obj.copies()):
            return None
        if obj.replicas is not None:
            lost = self._replicas.lost(obj, {segment_id}, "corrupt")
            if lost:
                return lost[0]
        return self._drop(obj, "corrupt")

    # ---------------------------------------------------------------------- time, eviction
    def tick(self, now_ms: int) -> list[Event]:
        """Expire leases, writers and clients, then run watermark eviction rounds."""
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
        evictable objects, and more if needed to get back under the watermark.

        Memory bytes of copies in flight count as gone (or a round would demote
        everything while they copy).  Afterwards the tier is under its watermark unless
        everything left in it is leased, pinned or pending."""
        placer = self._placer
        capacity, used = placer.usage(tier)
        limit = self.config.high_watermark * capacity
        if capacity == 0 or used - placer.leaving_of(tier) < limit:
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
                if evicted >= want and placer.usage(tier)[1] - placer.leaving_of(tier) < limit:
                    return events
        return events

    def usage(self, tier: Tier) -> tuple[int, int]:
        """(capacity, used) bytes over every segment of a tier."""
        return self._placer.usage(tier)

    # ------------------------------------------------------------- demotion, copies in flight
    def defer_copies(self, owner: str) -> None:
        """``owner`` (a node) copies its demotions while the index serves others: they
        are DEMOTING until reported :meth:`demote_done` or :meth:`demote_abandoned`
        (:meth:`~kvpool.core.demotion.Demotions.defer`)."""
        self._demotions.defer(owner)

    def stall_copies(self, owner: str, stalled: bool) -> None:
        """``owner`` stopped answering copies (its victims are dropped, not demoted), or
        answered again."""
        self._demotions.stall(owner, stalled)

    def demote_done(self, event: Demote) -> bool:
        """The owner copied an ``in_flight`` demotion: READY on SSD, its memory extent
        free.  False when the object is no longer that copy's (abandoned, dropped)."""
        obj = self._demotions.reported(self._objects, event)
        if obj is None:
            return False
        self._demotions.done(obj)
        _move(obj, "copy_done")
        self._ready[1] += 1  # SSD
        self._ssd_policy.on_insert(obj.key, obj.parent)
        return True

    def demote_abandoned(self, event: Demote) -> Dropped | None:
        """An ``in_flight`` copy failed, or its owner did not answer in time: the object
        is gone, both extents free (a late copy is refused by the owner's checksum check
        if the memory was rewritten meanwhile).  None when it was no longer that copy's."""
        obj = self._demotions.reported(self._objects, event)
        if obj is None:
            return None
        self.stats.demote_failures += 1
        return self._drop(obj, "demote_failed")

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
            return len(self._writing) if tier is None or tier is _MEMORY else 0
        if state is State.DEMOTING:
            return self._demotions.in_flight if tier is None or tier is _MEMORY else 0
        return sum(self._ready) if tier is None else self._ready[tier is _SSD]

    def location_of(self, key: str) -> Location | None:
        obj = self._objects.get(key)
        return obj.location() if obj is not None else None

    def copies_of(self, key: str) -> list[Location]:
        """Where every copy of ``key`` is (the one reads are granted first); [] if none."""
        obj = self._objects.get(key)
        return [] if obj is None else [_location(s, e) for s, e in obj.copies()]

    def state_of(self, key: str) -> State | None:
        obj = self._objects.get(key)
        return obj.state if obj is not None else None

    def check(self) -> None:
        """Assert the invariants that a scan can see (each object in a state of
        :data:`LIFE_CYCLE`), and every kept count (used by tests)."""
        per_segment: dict[str, int] = {}
        extents: dict[str, set[tuple[int, int]]] = {}  # segment -> objects' extents
        self._demotions.check(self._objects)
        for obj in self._objects.values():
            assert obj.state in _STATES, f"{obj.key}: {obj.state} is not in LIFE_CYCLE"
            taken = obj.copies()
            self._replicas.check(obj)
            if obj.target is not None:  # DEMOTING: its SSD extent is taken too
                taken.append(obj.target)
            for seg, ext in taken:
                assert self.registry.segments.get(seg.segment_id) is seg, f"{obj.key}: dead"
                per_segment[seg.segment_id] = per_segment.get(seg.segment_id, 0) + ext.length
                extents.setdefault(seg.segment_id, set()).add((ext.offset, ext.length))
        for seg in self.registry.segments.values():
            seg.space.check()
            assert seg.space.used == per_segment.get(seg.segment_id, 0), seg.segment_id
            assert seg.space.taken_runs() == _runs(extents.get(seg.segment_id, set())), (
                f"{seg.segment_id}: extents and objects disagree"
            )
        objects = list(self._objects.values())
        for tier in Tier:
            ready = sum(1 for o in objects if o.state is State.READY and o.segment.tier is tier)
            assert self._ready[tier is _SSD] == ready, f"{tier.value}: READY count kept wrong"
        pending = [o for o in objects if o.state is State.PENDING]
        assert list(self._writing.values()) == sorted(pending, key=lambda o: o.writer_expiry_ms)
        assert all(self._writing[o.key] is o for o in pending)
        assert not any(o.holds for o in objects if o.state is State.PENDING)
        self._holds.check(self._objects)

    # ------------------------------------------------------------------ internals: writes
    def _pending_of(self, key: str, writer: str) -> ObjectRecord:
        obj = self._objects.get(key)
        if obj is None or obj.state is not State.PENDING or obj.writer != writer:
            raise StaleWrite(f"no pending write of {key} by {writer} (expired or revoked?)")
        return obj

    def _expire_writers(self, now_ms: int, events: list[Event]) -> None:
        writing = self._writing
        while writing:
            obj = next(iter(writing.values()))  # O(1): an OrderedDict keeps its head
            if obj.writer_expiry_ms > now_ms:
                return
            self.stats.revoked_writes += 1
            events.append(self._drop(obj, "writer_expired"))

    def _expire_holds(self, now_ms: int) -> None:
        self.stats.expired_leases += self._holds.expire(now_ms)

    # ---------------------------------------------------------------- internals: eviction
    def _evictable(self, now_ms: int) -> Callable[[str], bool]:
        """The ``can_evict`` a policy is given: only READY objects without an unexpired
        lease or pin are victims.  Kept for the last ``now_ms`` asked: the puts of one
        request share their time."""
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

    def _evictable_in(self, seg: SegmentRecord, now_ms: int) -> Callable[[str], bool]:
        can_evict = self._evictable(now_ms)
        return lambda k: can_evict(k) and self._objects[k].segment is seg

    def _evictable_count(self, tier: Tier, now_ms: int) -> int:
        self._expire_holds(now_ms)  # then every hold left is unexpired
        return self._ready[tier is _SSD] - self._holds.held_objects(tier)

    def _allocate(
        self, tier: Tier, size: int, now_ms: int, events: list[Event]
    ) -> tuple[SegmentRecord, Extent] | None:
        """Find room in ``tier``, evicting inline (best victims first) while that helps:
        a put fails only when nothing evictable is left that would make room, or when
        copies in flight will make it (then evicting more would only demote more)."""
        placer = self._placer
        segments = placer.segments(tier)
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
                if placer.leaving_total and placer.room_coming(segments, size):
                    return None
                victims = policy.choose_victims(1, self._evictable(now_ms))
                if not victims:
                    return None
                victim = objects[victims[0]]
                if demote:
                    self._evict(victim, now_ms, events)
                    continue
                if victim.replicas is not None:  # copies in segments not placeable now
                    self.stats.evictions += 1
                    events.append(self._drop(victim, "evicted"))
                    continue
                # _drop of a READY victim (can_evict said so) of this tier's one segment;
                # READY --evicted--> gone is asserted against LIFE_CYCLE at import
                key = victim.key
                extent = victim.extent
                del objects[key]
                self._ready[tier is _SSD] -= 1
                policy.on_remove(key)
                if victim.holds:  # expired ones only, or it would not be a victim
                    self._holds.clear(victim)
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
            placed = placer.fit(segments, size)
            if placed is not None:
                return placed
            if placer.leaving_total and placer.room_coming(segments, size):
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

    def _evict(self, obj: ObjectRecord, now_ms: int, events: list[Event]) -> None:
        """Drop a victim, or demote it (``enable_offload``) when its owner also contributes
        an SSD segment with room.

        A demotion is logical at once: the object's location is the SSD extent, its memory
        extent is free, and the :class:`Demote` effect is the caller's to carry out,
        copying the bytes, before it hands out any later reservation; if the copy fails the
        caller reports ``demote_failed`` and the object is dropped.  Readers verify
        checksums end to end, so a copy that was overtaken is a miss, never wrong bytes.
        An owner whose copies are deferred (:meth:`defer_copies`) gets an ``in_flight``
        Demote instead, and the object is DEMOTING until the copy is reported."""
        if obj.segment.tier is _MEMORY and self.config.enable_offload:
            owner = obj.segment.client_id
            demotions = self._demotions
            dst = None if demotions.stalled(owner) else self._ssd_room(obj, now_ms, events)
            if dst is not None:
                if obj.replicas is not None:  # the SSD copy is the one kept
                    others = {seg.segment_id for seg, _ in obj.replicas}
                    events.extend(self._replicas.lost(obj, others, "demoted"))
                self._mem_policy.on_remove(obj.key)
                self._ready[0] -= 1  # memory
                self.stats.demotions += 1
                if demotions.deferred(owner):
                    if obj.holds:  # expired ones only (or it would not be a victim)
                        self._holds.clear(obj)  # none may read it while it is copied
                    _move(obj, "copy_started")
                    events.append(demotions.start(obj, dst))
                    return
                _move(obj, "demoted")
                self._ready[1] += 1  # -> SSD
                self._holds.moved_to_ssd(obj)  # only expired ones, or it would not be evicted
                events.append(demotions.now(obj, dst))
                self._ssd_policy.on_insert(obj.key, obj.parent)
                return
        self.stats.evictions += 1
        events.append(self._drop(obj, "evicted"))

    def _ssd_room(
        self, obj: ObjectRecord, now_ms: int, events: list[Event]
    ) -> tuple[SegmentRecord, Extent] | None:
        """An SSD extent on the same client as ``obj`` (it copies the bytes locally)."""
        owner = obj.segment.client_id
        for seg in self._placer.owner_segments(_SSD, owner):
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

    def _take_back(self, obj: ObjectRecord) -> None:
        """A DEMOTING object is wanted again: READY in memory, its SSD extent free."""
        self._demotions.take_back(obj)
        _move(obj, "taken_back")
        self._ready[0] += 1  # memory
        self._mem_policy.on_insert(obj.key, obj.parent)
        self.stats.copies_taken_back += 1

    def _drop(
        self, obj: ObjectRecord, reason: str, release_space: bool = True, event: str = ""
    ) -> Dropped:
        """An object leaves by ``event`` (its ``reason`` where none is given): its space,
        its counts, its policy entry and its holds."""
        _move(obj, event or reason)
        key = obj.key
        seg = obj.segment
        del self._objects[key]
        also: tuple[str, ...] = ()
        if obj.replicas is not None:
            also = self._replicas.leave(obj, release_space)
        if release_space:
            seg.space.release(obj.extent)
        if obj.state is _READY:
            self._ready[seg.tier is _SSD] -= 1
            (self._mem_policy if seg.tier is _MEMORY else self._ssd_policy).on_remove(key)
        elif obj.state is _DEMOTING:
            self._demotions.leave(obj, release_space)
        else:
            del self._writing[key]
        if obj.holds:
            self._holds.clear(obj)
        return Dropped(key, seg.tier, reason, seg.client_id, also)

    # ------------------------------------------------------- internals: room for a replica
    def _room_in(
        self, seg: SegmentRecord, size: int, now_ms: int, events: list[Event]
    ) -> tuple[SegmentRecord, Extent] | None:
        """An extent of ``size`` in memory segment ``seg``, evicting objects with a copy
        there while that helps (never when copies in flight will make the room)."""
        if seg.space.capacity < size:
            return None
        can_evict = self._evictable(now_ms)
        objects = self._objects

        def here(key: str) -> bool:
            return can_evict(key) and any(s is seg for s, _ in objects[key].copies())

        while True:
            extent = seg.space.allocate(size)
            if extent is not None:
                return seg, extent
            if self._placer.leaving_total and self._placer.room_coming([seg], size):
                return None
            victims = self._mem_policy.choose_victims(1, here)
            if not victims:
                return None
            self._evict(objects[victims[0]], now_ms, events)


def _runs(extents: set[tuple[int, int]]) -> list[Extent]:
    """Non-overlapping (offset, length) pairs as maximal runs (touching ones merged)."""
    runs: list[Extent] = []
    for offset, length in sorted(extents):
        if runs and runs[-1].end == offset:
            runs[-1] = Extent(runs[-1].offset, runs[-1].length + length)
        else:
            assert not runs or runs[-1].end < offset, f"extents overlap at {offset}"
            runs.append(Extent(offset, length))
    return runs


def _location(seg: SegmentRecord, extent: Extent) -> Location:
    return Location(seg.segment_id, seg.client_id, seg.tier, extent.offset, extent.length)
