"""Clients and the segments they contribute.

Invariants: every segment belongs to exactly one registered client, and segment ids are
unique across clients; a client is live while ``now < last_seen + client_ttl``, and the
index drops an expired client's segments (and their objects) in the tick that notices it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvpool.core.space import ExtentAllocator
from kvpool.errors import PoolError, UnknownClient, UnknownSegment

__all__ = ["ClientInfo", "Registry", "SegmentRecord", "Tier"]


class Tier(enum.Enum):
    MEMORY = "memory"
    SSD = "ssd"


@dataclass(slots=True)
class SegmentRecord:
    """The index's record of a segment a client contributes: its id, owner, tier and the
    extents taken in it (the bytes themselves live in the owner's mapping,
    ``kvpool.storage.segment.Segment``)."""

    segment_id: str
    client_id: str
    tier: Tier
    space: ExtentAllocator
    # False while its owner re-announces what the segment already holds: a put placed
    # there meanwhile could take the extent of an object not announced yet (which the
    # index would then refuse, and the node drop)
    placeable: bool = True

    @property
    def capacity(self) -> int:
        return self.space.capacity


@dataclass(slots=True)
class ClientInfo:
    client_id: str
    registered_ms: int
    last_seen_ms: int
    address: str = ""
    segment_ids: list[str] = field(default_factory=list)


class Registry:
    """Who is connected, since when, and which segments each one contributes."""

    def __init__(self, client_ttl_ms: int) -> None:
        self.client_ttl_ms = client_ttl_ms
        self.clients: dict[str, ClientInfo] = {}
        self.segments: dict[str, SegmentRecord] = {}

    def register(self, client_id: str, now_ms: int, address: str = "") -> bool:
        """Register or refresh; True when the client was not known (new or re-registering)."""
        info = self.clients.get(client_id)
        if info is None:
            self.clients[client_id] = ClientInfo(client_id, now_ms, now_ms, address)
            return True
        info.last_seen_ms = now_ms
        if address:
            info.address = address
        return False

    def heartbeat(self, client_id: str, now_ms: int) -> None:
        info = self.clients.get(client_id)
        if info is None:
            raise UnknownClient(f"client {client_id!r} is not registered; register again")
        info.last_seen_ms = now_ms

    def add_segment(
        self, client_id: str, segment_id: str, capacity: int, tier: Tier, placeable: bool = True
    ) -> SegmentRecord:
        info = self.clients.get(client_id)
        if info is None:
            raise UnknownClient(f"client {client_id!r} is not registered; register first")
        if segment_id in self.segments:
            seg = self.segments[segment_id]
            if seg.client_id == client_id and seg.capacity == capacity and seg.tier == tier:
                return seg  # re-adding the same segment is harmless
            raise PoolError(f"segment id {segment_id!r} is already registered")
        seg = SegmentRecord(segment_id, client_id, tier, ExtentAllocator(capacity), placeable)
        self.segments[segment_id] = seg
        info.segment_ids.append(segment_id)
        return seg

    def segment(self, segment_id: str) -> SegmentRecord:
        seg = self.segments.get(segment_id)
        if seg is None:
            raise UnknownSegment(f"segment {segment_id!r} is not registered")
        return seg

    def expired(self, now_ms: int) -> list[str]:
        return [
            c.client_id
            for c in self.clients.values()
            if now_ms >= c.last_seen_ms + self.client_ttl_ms
        ]

    def drop(self, client_id: str) -> list[SegmentRecord]:
        """Forget a client; returns its segments (the caller drops their objects)."""
        info = self.clients.pop(client_id, None)
        if info is None:
            return []
        return [self.segments.pop(s) for s in info.segment_ids if s in self.segments]

    def host_of(self, client_id: str) -> str:
        """The host of a client's data address (the client itself where it gave none):
        replicas go to other hosts first."""
        info = self.clients.get(client_id)
        address = info.address if info is not None else ""
        host = address.rpartition(":")[0]
        return host or f"client {client_id}"

    def tier_segments(self, tier: Tier) -> list[SegmentRecord]:
        """The segments of ``tier`` that new objects may be placed in."""
        return [s for s in self.segments.values() if s.tier is tier and s.placeable]
