"""The values the object index works with: its config, where objects are, what it grants,
and the effects it returns (events).  Small frozen dataclasses, no behaviour beyond
trivial derivations.

The values made on every put, read and eviction (Location, Reservation, ReadGrant,
Dropped, Demote) have hand-written ``__init__`` methods that set their slots through the
slot descriptors: the generated frozen ``__init__`` makes one ``object.__setattr__`` call
per field, about twice the cost, and these constructors were a third of the index's time
per block.  They stay frozen (assignment raises FrozenInstanceError), equal and hashable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpool.core.registry import Segment, Tier
from kvpool.core.space import Extent

__all__ = [
    "Demote",
    "Dropped",
    "Event",
    "IndexConfig",
    "IndexStats",
    "Location",
    "ObjectRecord",
    "ReadGrant",
    "Reservation",
    "State",
]


class State(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class IndexConfig:
    high_watermark: float = 0.9
    eviction_ratio: float = 0.1
    lease_ttl_ms: int = 11_000
    writer_ttl_ms: int = 30_000
    client_ttl_ms: int = 120_000
    enable_offload: bool = False
    policy: str = "default"

    def __post_init__(self) -> None:
        if not 0.0 < self.high_watermark <= 1.0:
            raise ValueError(f"high_watermark must be in (0, 1], got {self.high_watermark}")
        if not 0.0 < self.eviction_ratio <= 1.0:
            raise ValueError(f"eviction_ratio must be in (0, 1], got {self.eviction_ratio}")
        for name in ("lease_ttl_ms", "writer_ttl_ms", "client_ttl_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def _slot_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    setter: Callable[[Any, Any], None] = getattr(cls, name).__set__
    return setter


@dataclass(frozen=True, slots=True, init=False)
class Location:
    segment_id: str
    client_id: str
    tier: Tier
    offset: int
    size: int

    def __init__(self, segment_id: str, client_id: str, tier: Tier, offset: int, size: int):
        _loc_segment_id(self, segment_id)
        _loc_client_id(self, client_id)
        _loc_tier(self, tier)
        _loc_offset(self, offset)
        _loc_size(self, size)


_loc_segment_id = _slot_setter(Location, "segment_id")
_loc_client_id = _slot_setter(Location, "client_id")
_loc_tier = _slot_setter(Location, "tier")
_loc_offset = _slot_setter(Location, "offset")
_loc_size = _slot_setter(Location, "size")


@dataclass(frozen=True, slots=True, init=False)
class Reservation:
    """Where a writer must put the bytes before calling put_end."""

    key: str
    location: Location
    writer_expiry_ms: int

    def __init__(self, key: str, location: Location, writer_expiry_ms: int) -> None:
        _res_key(self, key)
        _res_location(self, location)
        _res_writer_expiry_ms(self, writer_expiry_ms)


_res_key = _slot_setter(Reservation, "key")
_res_location = _slot_setter(Reservation, "location")
_res_writer_expiry_ms = _slot_setter(Reservation, "writer_expiry_ms")


@dataclass(frozen=True, slots=True, init=False)
class ReadGrant:
    key: str
    location: Location
    checksum: int
    lease_expiry_ms: int

    def __init__(self, key: str, location: Location, checksum: int, lease_expiry_ms: int):
        _grant_key(self, key)
        _grant_location(self, location)
        _grant_checksum(self, checksum)
        _grant_lease_expiry_ms(self, lease_expiry_ms)


_grant_key = _slot_setter(ReadGrant, "key")
_grant_location = _slot_setter(ReadGrant, "location")
_grant_checksum = _slot_setter(ReadGrant, "checksum")
_grant_lease_expiry_ms = _slot_setter(ReadGrant, "lease_expiry_ms")


@dataclass(frozen=True, slots=True, init=False)
class Dropped:
    """An object left the index; ``reason`` is evicted, removed, expired_client, revoked,
    writer_expired or demote_failed."""

    key: str
    tier: Tier
    reason: str
    client_id: str = ""

    def __init__(self, key: str, tier: Tier, reason: str, client_id: str = "") -> None:
        _drop_key(self, key)
        _drop_tier(self, tier)
        _drop_reason(self, reason)
        _drop_client_id(self, client_id)


_drop_key = _slot_setter(Dropped, "key")
_drop_tier = _slot_setter(Dropped, "tier")
_drop_reason = _slot_setter(Dropped, "reason")
_drop_client_id = _slot_setter(Dropped, "client_id")


@dataclass(frozen=True, slots=True, init=False)
class Demote:
    """Copy ``src`` (memory) to ``dst`` (SSD) now; the index already points at ``dst``."""

    key: str
    src: Location
    dst: Location
    checksum: int

    def __init__(self, key: str, src: Location, dst: Location, checksum: int) -> None:
        _demote_key(self, key)
        _demote_src(self, src)
        _demote_dst(self, dst)
        _demote_checksum(self, checksum)


_demote_key = _slot_setter(Demote, "key")
_demote_src = _slot_setter(Demote, "src")
_demote_dst = _slot_setter(Demote, "dst")
_demote_checksum = _slot_setter(Demote, "checksum")


Event = Dropped | Demote


@dataclass(slots=True)
class IndexStats:
    evictions: int = 0
    demotions: int = 0
    demote_failures: int = 0
    expired_leases: int = 0
    revoked_writes: int = 0
    put_failures_no_space: int = 0


@dataclass(slots=True)
class ObjectRecord:
    key: str
    state: State
    segment: Segment
    extent: Extent
    parent: str | None
    writer: str
    writer_expiry_ms: int
    checksum: int = 0
    holds: dict[str, int] = field(default_factory=dict)  # owner -> expiry (leases and pins)
    # location() made once (a put and every read of the object return it); move() clears it
    _location: Location | None = field(default=None, repr=False, compare=False)

    def location(self) -> Location:
        loc = self._location
        if loc is None:
            s, e = self.segment, self.extent
            loc = self._location = Location(s.segment_id, s.client_id, s.tier, e.offset, e.length)
        return loc

    def move(self, segment: Segment, extent: Extent) -> None:
        """The object now lives at ``extent`` of ``segment`` (demotion); use this, not
        assignment, so that location() is made again."""
        self.segment, self.extent = segment, extent
        self._location = None

    def held(self, now_ms: int) -> bool:
        if not self.holds:  # the common case, and on the eviction hot path
            return False
        return any(exp > now_ms for exp in self.holds.values())
