"""The values the object index works with: its config, locations, grants and the effects it
returns.  Small frozen values, no behaviour beyond trivial derivations.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from kvpool.core.registry import SegmentRecord, Tier
from kvpool.core.space import Extent
from kvpool.errors import NoSpace

__all__ = [
    "MAX_REPLICAS",
    "CopyLost",
    "Demote",
    "Dropped",
    "Event",
    "IndexConfig",
    "IndexStats",
    "Location",
    "NoRoom",
    "ObjectRecord",
    "ReadGrant",
    "Reservation",
    "State",
]


#: the most copies one object may have (each on another storage owner)
MAX_REPLICAS = 8


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    # being copied to its owner's SSD tier by the owner itself, while the index serves
    # others: invisible to readers, both extents held until the copy is done or abandoned
    DEMOTING = "demoting"


@dataclass(frozen=True, slots=True)
class IndexConfig:
    high_watermark: float = 0.9
    eviction_ratio: float = 0.1
    lease_ttl_ms: int = 11_000
    writer_ttl_ms: int = 30_000
    client_ttl_ms: int = 120_000
    enable_offload: bool = False
    policy: str = "prefix_aware"  # an eviction policy name (or alias): core.eviction
    replica_num: int = 1  # copies of each object a put asks for when it names none

    def __post_init__(self) -> None:
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ValueError(f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")
        if not 1 <= self.replica_num <= MAX_REPLICAS:
            raise ValueError(f"replica_num must be in [1, {MAX_REPLICAS}], got {self.replica_num}")
        for name in ("lease_ttl_ms", "writer_ttl_ms", "client_ttl_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


# The values made on every put, read and eviction (Location, Reservation, ReadGrant,
# Dropped, Demote) are frozen ``msgspec.Struct`` types rather than frozen dataclasses: a
# frozen dataclass's generated ``__init__`` makes one ``object.__setattr__`` call per field,
# and those constructors were a third of the index's time per block; a Struct is built in C
# (about 0.11 µs against 0.9 µs for a Location here).  They are equal by value, hashable,
# printable, and assignment raises AttributeError.  No encoding happens here: msgspec is
# only the value type.
#
# They and :class:`ObjectRecord` are made with ``gc=False`` (not tracked by the cycle
# collector): none of them can be part of a reference cycle (the values hold strings, ints,
# enum members and each other; a record holds its segment, extent, location and a dict of
# owner -> expiry, none of which refers back to a record), and each put made several, whose
# young-generation collections were ~10% of a put's time.  Keep it so: a field that could
# refer back to a record or value would make a cycle the collector cannot see.
class Location(msgspec.Struct, frozen=True, gc=False):
    segment_id: str
    client_id: str
    tier: Tier
    offset: int
    size: int


class Reservation(msgspec.Struct, frozen=True, gc=False):
    """Where a writer must put the bytes before calling put_end: ``location``, and the
    same bytes at each of ``replicas`` (the object's other copies, each on another owner)."""

    key: str
    location: Location
    writer_expiry_ms: int
    replicas: tuple[Location, ...] = ()


class ReadGrant(msgspec.Struct, frozen=True, gc=False):
    """A read lease on the copy at ``location``; ``copies``: how many the object has (a
    reader whose copy fails reports it, and asks again for another)."""

    key: str
    location: Location
    checksum: int
    lease_expiry_ms: int
    copies: int = 1


class Dropped(msgspec.Struct, frozen=True, gc=False):
    """An object left the index; ``reason`` is evicted, removed, expired_client, revoked,
    writer_expired, demote_failed or corrupt (a reader found it failing its checksum).
    ``also``: the other owners that held a copy of it (replicas)."""

    key: str
    tier: Tier
    reason: str
    client_id: str = ""
    also: tuple[str, ...] = ()


class CopyLost(msgspec.Struct, frozen=True, gc=False):
    """One copy of a replicated object left (``reason``: corrupt, unwritten or demoted:
    a demotion keeps one copy); the object stays readable from its other copies."""

    key: str
    client_id: str
    reason: str


class Demote(msgspec.Struct, frozen=True, gc=False):
    """Copy ``src`` (memory) to ``dst`` (SSD).

    Not ``in_flight`` (an owner that copies at once, in the caller's process): the index
    already points at ``dst`` and the copy must be done before any later reservation.
    ``in_flight`` (an owner whose copies are deferred, a node): the object is DEMOTING
    until the caller reports ``demote_done`` or ``demote_abandoned``."""

    key: str
    src: Location
    dst: Location
    checksum: int
    in_flight: bool = False


Event = Dropped | Demote | CopyLost


class NoRoom(NoSpace):
    """NoSpace from ``put_start``, with the effects of the inline evictions it made on
    the way (the caller must still carry them out).  ``coming``: copies in flight will
    free enough memory once done (or abandoned), so the put may be tried again then."""

    def __init__(self, message: str, events: list[Event], coming: bool = False) -> None:
        super().__init__(message)
        self.events = events
        self.coming = coming


@dataclass(slots=True)
class IndexStats:
    evictions: int = 0
    demotions: int = 0
    demote_failures: int = 0
    copies_taken_back: int = 0  # copies in flight abandoned because a reader wanted them
    expired_leases: int = 0
    revoked_writes: int = 0
    put_failures_no_space: int = 0
    replicas_lost: int = 0  # copies gone with their owner or found corrupt, object kept
    replicas_short: int = 0  # puts placed with fewer copies than asked (too few owners)


class ObjectRecord(msgspec.Struct, gc=False):
    """One object of the index (mutable: the index changes it in place).  A Struct rather
    than a slotted dataclass: one is made per put, and a Struct is built in C.  Not tracked
    by the GC (see the comment above :class:`Location`).  It keeps nothing that can be made
    again when asked (its :class:`Location`) or that most objects never have (``holds``
    is None until the first lease): at millions of objects every field is master memory."""

    key: str
    state: State
    segment: SegmentRecord
    extent: Extent
    parent: str | None
    writer: str
    writer_expiry_ms: int
    checksum: int = 0
    holds: dict[str, int] | None = None  # owner -> expiry (leases and pins); None: none
    # DEMOTING: the SSD segment and extent reserved for the copy (the memory extent stays)
    target: tuple[SegmentRecord, Extent] | None = None
    # the object's other copies, each in a memory segment of another owner (None: one
    # copy, the usual case).  Only memory objects have them: a demotion keeps one.
    replicas: list[tuple[SegmentRecord, Extent]] | None = None

    def location(self) -> Location:
        s, e = self.segment, self.extent
        return Location(s.segment_id, s.client_id, s.tier, e.offset, e.length)

    def move(self, segment: SegmentRecord, extent: Extent) -> None:
        """The object now lives at ``extent`` of ``segment`` (demotion)."""
        self.segment, self.extent = segment, extent

    def copies(self) -> list[tuple[SegmentRecord, Extent]]:
        """Every copy, the one reads are granted first."""
        first = (self.segment, self.extent)
        return [first] if self.replicas is None else [first, *self.replicas]

    def held(self, now_ms: int) -> bool:
        holds = self.holds
        if not holds:  # the common case, and on the eviction hot path
            return False
        return any(exp > now_ms for exp in holds.values())
