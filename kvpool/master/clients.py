"""Who contributes storage to the master's pool: the storage owners' registrations,
heartbeats, segments and endpoints, and the owners dropped for a failed transfer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import Event
from kvpool.core.registry import Tier
from kvpool.datapath.shm import remove_if_owner_dead
from kvpool.errors import PoolError
from kvpool.node.catalog import Outbox
from kvpool.node.storage import LocalStorage
from kvpool.protocol import messages as m
from kvpool.protocol.data import Ok

__all__ = ["Endpoint", "MasterClients"]

log = logging.getLogger("kvpool.master")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How clients reach a segment's bytes."""

    data_address: str
    shm_name: str
    host_token: str


class MasterClients:
    """The master's storage owners and their segments' endpoints.

    Storage hosted in the master's own process (:meth:`attach_local`) is alive by
    definition, copies its demotions at once, and is never dropped on a reader's report;
    a remote owner copies on its own time (``defer_copies``) and gets its catalog
    changes with its heartbeat replies (``outbox``).
    """

    def __init__(
        self,
        index: ObjectIndex,
        outbox: Outbox,
        apply: Callable[[list[Event]], None],
        heartbeat_interval_ms: int,
    ) -> None:
        self.index = index
        self.outbox = outbox
        self.apply = apply  # carries out the index's effects (the master's)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.endpoints: dict[str, Endpoint] = {}  # segment_id -> endpoint
        self.addresses: dict[str, tuple[str, str]] = {}  # client id -> (data addr, token)
        self.local: dict[str, LocalStorage] = {}  # storage hosted in this very process
        # memory segment id -> (warm state, bytes warmed), as its remote owner last said
        self.warmth: dict[str, tuple[str, int]] = {}

    def warmth_of(self, segment_id: str) -> tuple[str, int] | None:
        """How far a memory segment's pages are faulted in, as its owner says (an
        in-process owner: now); None when its owner never said."""
        seg = self.index.registry.segments.get(segment_id)
        if seg is None:
            return None
        local = self.local.get(seg.client_id)
        if local is not None and local.segment_id == segment_id:
            warmth = local.warmth
            return (warmth.state, warmth.warmed) if warmth is not None else None
        return self.warmth.get(segment_id)

    def address_of(self, client_id: str) -> str:
        """The data address of a storage owner ("" : none known)."""
        return self.addresses.get(client_id, ("", ""))[0]

    def attach_local(self, storage: LocalStorage, now: int) -> None:
        """Register storage hosted in the master's own process (the embedded segment)."""
        # local first: it copies its demotions at once, and the master is its catalog
        self.local[storage.client_id] = storage
        self.register(m.Register(storage.client_id, storage.data_address, storage.host_token), now)
        if storage.segment is not None:
            self.add_segment(
                m.AddSegment(
                    storage.client_id,
                    storage.segment_id,
                    storage.segment.size,
                    "memory",
                    storage.shm_name,
                ),
                now,
            )
        if storage.ssd is not None:
            self.add_segment(
                m.AddSegment(storage.client_id, storage.ssd_segment_id, storage.ssd_limit, "ssd"),
                now,
            )
            self._restore_local_ssd(storage, now)

    def _restore_local_ssd(self, storage: LocalStorage, now: int) -> None:
        """What a previous run left on this SSD path is served again, not leaked: the
        same rules as a node's re-announcement (headers checked, refusals deleted)."""

        def restore(batch: list[tuple[str, int, int, int]]) -> list[bool]:
            req = m.Restore(storage.client_id, storage.ssd_segment_id, batch)
            return self.restore(req, now).values

        storage.announce_ssd(restore)

    def register(self, req: m.Register, now: int) -> m.RegisterReply:
        if req.client_id in self.index.registry.clients and req.client_id not in self.local:
            # Only a new run of a storage owner registers a known id (a node restarted
            # with the same SSD directory, or retrying a start that failed part-way):
            # what the old run held is gone from memory, and it re-announces its SSD
            # (``Restore``; what the index refuses there, the owner deletes itself).
            log.info("client %s registered again: dropping its previous run", req.client_id)
            self.apply(self.index.remove_client(req.client_id, reason="restarted"))
            self.forget_segments()
        new = self.index.register_client(req.client_id, now, req.data_address)
        self.addresses[req.client_id] = (req.data_address, req.host_token)
        if new:
            log.info("client %s registered (data %s)", req.client_id, req.data_address or "-")
        return m.RegisterReply(new, self.index.config.client_ttl_ms, self.heartbeat_interval_ms)

    def add_segment(self, req: m.AddSegment, now: int) -> Ok:
        try:
            tier = Tier(req.tier)
        except ValueError:
            raise PoolError(f"segment {req.segment_id!r}: unknown tier {req.tier!r}") from None
        if req.capacity <= 0:
            raise PoolError(f"segment {req.segment_id!r}: capacity must be positive")
        if req.client_id not in self.local and not self.address_of(req.client_id):
            # others' puts would be placed where nobody can write them
            raise PoolError(f"segment {req.segment_id!r}: {req.client_id} has no data address")
        self.index.add_segment(
            req.client_id, req.segment_id, req.capacity, tier, placeable=not req.restoring
        )
        address, token = self.addresses.get(req.client_id, ("", ""))
        self.endpoints[req.segment_id] = Endpoint(address, req.shm_name, token)
        if req.warm:
            self.warmth[req.segment_id] = (req.warm, req.warmed)
        if req.client_id not in self.local:
            self.outbox.watch(req.client_id)
            self.index.defer_copies(req.client_id)  # a node copies on its own time
        log.info(
            "segment %s: %d bytes of %s from %s",
            req.segment_id,
            req.capacity,
            tier.value,
            req.client_id,
        )
        return Ok()

    def heartbeat(self, req: m.Heartbeat, now: int) -> m.HeartbeatReply:
        self.index.heartbeat(req.client_id, now)
        segments = self.index.registry.segments
        for segment_id, state, warmed in req.warmth:
            seg = segments.get(segment_id)
            if seg is not None and seg.client_id == req.client_id:  # only its own
                self.warmth[segment_id] = (state, warmed)
        self.outbox.confirm(req.client_id)  # it applied the last reply's changes
        changes = self.outbox.take(req.client_id)
        return m.HeartbeatReply(changes.added, changes.removed)

    def restore(self, req: m.Restore, now: int) -> m.Bools:
        owner = self.index.registry.segments.get(req.segment_id)
        if owner is not None and owner.client_id != req.client_id:
            # only a segment's owner says what it holds: anyone else would map keys onto
            # another node's memory
            raise PoolError(
                f"segment {req.segment_id!r} is {owner.client_id}'s, not {req.client_id}'s: "
                "a node restores only its own segments"
            )
        restore, seg = self.index.restore, req.segment_id
        accepted = [restore(k, seg, off, n, csum, now) for k, off, n, csum in req.objects]
        if req.done and owner is not None:
            self.index.open_segment(seg)
        return m.Bools(accepted)

    def report_failure(self, req: m.ReportFailure, now: int) -> Ok:
        seg = self.index.registry.segments.get(req.segment_id)
        if seg is not None and seg.client_id not in self.local:  # local: alive by definition
            log.warning("dropping client %s: %s", seg.client_id, req.reason)
            self.apply(self.index.remove_client(seg.client_id, reason="transfer_failed"))
            self.forget_segments()
        return Ok()

    def forget_segments(self) -> None:
        """Forget the endpoints of segments no longer registered (the next tick at the
        latest), and the /dev/shm segment a dropped owner of this host left if it died."""
        for segment_id in list(self.endpoints):
            if segment_id not in self.index.registry.segments:
                self.warmth.pop(segment_id, None)
                ep = self.endpoints.pop(segment_id)
                if ep.shm_name and remove_if_owner_dead(ep.shm_name, ep.host_token):
                    log.info("removed %s: its owner is gone", ep.shm_name)
        self.outbox.forget_gone(self.index.registry.clients)
