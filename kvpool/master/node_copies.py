"""What the master waits on nodes for without waiting in its loop: :class:`NodeCopies`,
the nodes' copies in flight (their why: :mod:`kvpool.master.copies`), their catalogs
(:mod:`kvpool.node.catalog`), and the replies held for either meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import Demote, Event
from kvpool.errors import PeerTimeout
from kvpool.master.copies import Copies, Later
from kvpool.master.metrics import MasterMetrics
from kvpool.master.node_links import NodeLinks
from kvpool.node.catalog import Outbox
from kvpool.protocol import messages as m
from kvpool.protocol.data import error_reply

__all__ = ["Handler", "NodeCopies"]


class Handler(Protocol):
    """What answers the requests :meth:`NodeCopies.submit` may hold: the master, or a
    layer over it (a tenant's)."""

    def handle(self, request: m.MasterRequest) -> m.MasterReply: ...

    def try_put(self, request: m.PutStart | m.BatchPutStart) -> m.MasterReply | None: ...


class NodeCopies:
    """Copies in flight on nodes, and the replies held for them or for a node's catalog.

    The index is touched on the master's thread only: reports queue up until ``settle``
    (which the server runs when one arrives) or :meth:`settle_copies` (which the master
    runs before each request).
    """

    def __init__(
        self,
        index: ObjectIndex,
        outbox: Outbox,
        metrics: MasterMetrics,
        clock: Callable[[], int],
        apply: Callable[[list[Event]], None],
        address_of: Callable[[str], str],
        heartbeat_interval_ms: int,
    ) -> None:
        self.index = index
        self.outbox = outbox
        self.metrics = metrics
        self.clock = clock
        self.apply = apply  # carries out the index's effects (the master's)
        self.address_of = address_of  # a storage owner's data address ("" : none)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.links = NodeLinks()  # demotions and SSD deletions on remote nodes
        # a copy not reported within the deadline is abandoned
        self.copies = Copies(self.links, int(self.links.timeout_s * 1000))
        self.room_wait_ms = 1000  # how long a put may wait for room a copy makes
        self.catalog_wait_ms = 2 * heartbeat_interval_ms + 2000  # ... for its node's catalog
        self.laters: list[Later] = []  # replies the server holds, resolved by settle()
        self._settling = False  # settle() is running (a delivery may call it again)
        self._settle_again = False

    def submit(self, request: m.MasterRequest, via: Handler) -> m.MasterReply | Later:
        """``via.handle(request)``, but some replies wait (the server holds them;
        :meth:`settle` answers them): a put that only a node's copy in flight can make
        room for; a put into a node's segment until the node has its catalog entry; and
        a node's heartbeat until there is a change for it (a long poll).  ``handle``
        alone never waits: the room a copy would make is NoSpace at once."""
        kind = type(request)
        if kind is m.PutStart or kind is m.BatchPutStart:
            assert isinstance(request, (m.PutStart, m.BatchPutStart))
            return self._submit_put(request, via)
        reply = via.handle(request)
        if isinstance(reply, m.HeartbeatReply) and not (reply.added or reply.removed):
            assert isinstance(request, m.Heartbeat)
            if request.client_id in self.outbox:
                return self._later(self._long_poll(request.client_id), self.heartbeat_interval_ms)
        elif isinstance(request, (m.PutEnd, m.BatchPutEnd)) and not request.noted:
            # a noted PutEnd's node has the entry already (from the write's tag)
            keys = [request.key] if isinstance(request, m.PutEnd) else request.keys
            need = self._unconfirmed(keys)
            if need:
                return self._later(self._confirmed(need, reply), self.catalog_wait_ms)
        return reply

    def _later(self, retry: Callable[[bool], m.MasterReply | None], wait_ms: int) -> Later:
        later = Later(retry, self.clock() + wait_ms)
        self.laters.append(later)
        return later

    def _long_poll(self, owner: str) -> Callable[[bool], m.MasterReply | None]:
        def retry(final: bool) -> m.MasterReply | None:
            if not final and not self.outbox.has_changes(owner):
                return None
            changes = self.outbox.take(owner)
            return m.HeartbeatReply(changes.added, changes.removed)

        return retry

    def _unconfirmed(self, keys: list[str]) -> dict[str, int]:
        """Node -> how many catalog adds it must confirm before these puts are answered."""
        need: dict[str, int] = {}
        outbox = self.outbox
        for key in keys:
            loc = self.index.location_of(key)
            if loc is not None and loc.client_id in outbox:
                seq = outbox.seq(loc.client_id)
                if outbox.confirmed(loc.client_id) < seq:
                    need[loc.client_id] = seq
        return need

    def _confirmed(
        self, need: dict[str, int], reply: m.MasterReply
    ) -> Callable[[bool], m.MasterReply | None]:
        def retry(final: bool) -> m.MasterReply | None:
            if all(self.outbox.confirmed(o) >= seq for o, seq in need.items()):
                return reply
            if not final:
                return None
            return error_reply(
                PeerTimeout(
                    f"the node(s) {', '.join(sorted(need))} did not confirm the put in "
                    f"{self.catalog_wait_ms} ms: it may not survive a master restart"
                )
            )

        return retry

    def _submit_put(
        self, request: m.PutStart | m.BatchPutStart, via: Handler
    ) -> m.MasterReply | Later:
        """A held put is answered when a copy ended and it then fits, or at
        ``room_wait_ms``, after abandoning the copies older than that, so that it finds
        the room (or a NoSpace that says why)."""
        reply = via.try_put(request)
        if reply is not None:
            return reply
        seen = self.copies.reported

        def retry(final: bool) -> m.MasterReply | None:
            nonlocal seen
            if final:  # the nodes that did not answer in time lose their copies
                self._abandon(self.copies.overdue(self.clock(), self.room_wait_ms))
                return via.handle(request)
            if self.copies.reported == seen:
                return None  # no copy ended since the last try
            seen = self.copies.reported
            return via.try_put(request)

        return self._later(retry, self.room_wait_ms)

    def settle(self, expire: bool = False) -> None:
        """Apply what nodes reported, and answer the held replies that can be.
        ``expire`` (the periodic tick): abandon the copies past their deadline first."""
        if expire and len(self.copies):
            self._abandon(self.copies.overdue(self.clock()))
        self.settle_copies()
        if self._settling:  # a delivery served more requests: the outer pass goes again
            self._settle_again = True
            return
        self._settling = True
        try:
            self._settle_again = True
            while self._settle_again and self.laters:
                self._settle_again = False
                now = self.clock()
                for later in list(self.laters):
                    if later.deliver is None or later not in self.laters:
                        continue  # the server has not taken it yet, or it was answered
                    reply = later.retry(now >= later.deadline_ms)
                    if reply is not None:
                        self.laters.remove(later)
                        later.deliver(reply)
        finally:
            self._settling = False

    def settle_copies(self) -> bool:
        """Apply the nodes' copy reports; True when any arrived."""
        reports = self.copies.take_reports()
        for event, ok, in_flight in reports:
            owner = event.src.client_id
            self.index.stall_copies(owner, False)  # it answers
            if in_flight and ok and self.index.demote_done(event):
                self.metrics.offloads.inc()
                # the node's catalog lists its memory objects, for re-announcing after a
                # restart: this one's memory extent is no longer its own
                self.outbox.remove(owner, event.key)
            elif in_flight:
                self._abandon([event])
            # A copy that ended after it was abandoned may leave a file: it is not
            # deleted from here, since the node may have re-announced it meanwhile (a
            # delete racing that would take a listed object's file); the node's next
            # announcement serves it or deletes it.
        return bool(reports)

    def _abandon(self, events: list[Demote]) -> None:
        for event in events:
            dropped = self.index.demote_abandoned(event)
            if dropped is not None:
                self.index.stall_copies(event.src.client_id, True)  # until it answers
                self.metrics.demote_failures.inc()
                self.apply([dropped])

    def ssd_remove(self, client_id: str, keys: list[str]) -> None:
        """Delete a remote owner's SSD copies of ``keys`` (on its link thread)."""
        address = self.address_of(client_id)
        if address:
            self.links.ssd_remove(address, client_id, keys)

    def demote(self, event: Demote) -> None:
        """Start a remote owner's copy of a demoted object; the object stays DEMOTING
        until it reports back (or is abandoned)."""
        address = self.address_of(event.src.client_id)
        if address:
            self.copies.start(address, event, self.clock())
        else:
            self._abandon([event])
