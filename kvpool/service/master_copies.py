"""The master's side of nodes' copies: starting them, applying what nodes report, and the
puts that wait for the room they make (:class:`NodeCopies`, a base of
:class:`~kvpool.service.master.MasterService`; the why is in :mod:`kvpool.service.copies`).

Rules: the index is touched on the master's thread only (reports queue up until
``settle``, which the server runs when one arrives, and ``handle`` before each request);
a copy not reported within ``copies.deadline_ms`` is abandoned; a held put is answered
when a copy ended and it then fits, or at ``room_wait_ms``, after abandoning the copies
older than that, so that it finds the room (or a NoSpace that says why).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpool.core.index import Demote, Event, ObjectIndex
from kvpool.protocol import messages as m
from kvpool.service.catalog import Outbox
from kvpool.service.copies import Copies, Later
from kvpool.service.metrics import MasterMetrics
from kvpool.service.node_links import NodeLinks

__all__ = ["NodeCopies"]


class NodeCopies:
    """Copies in flight on nodes, and replies held for them (see the module docstring)."""

    if TYPE_CHECKING:  # provided by MasterService
        index: ObjectIndex
        metrics: MasterMetrics
        outbox: Outbox
        copies: Copies
        clock: Callable[[], int]
        client_addresses: dict[str, tuple[str, str]]
        room_wait_ms: int
        laters: list[Later]
        may_wait: bool
        waits: bool

        node_links: NodeLinks

        def handle(self, request: m.MasterRequest) -> m.MasterReply: ...
        def _apply(self, events: list[Event]) -> None: ...

    def submit(self, request: m.MasterRequest) -> m.MasterReply | Later:
        """As ``handle``, but a put that only a node's copy in flight can make room for
        is a :class:`Later` (the server holds that reply; :meth:`settle` resolves it).
        ``handle`` alone answers such a put NoSpace at once."""
        if type(request) is not m.PutStart and type(request) is not m.BatchPutStart:
            return self.handle(request)
        reply = self._try_put(request)
        if reply is not None:
            return reply
        deadline = self.clock() + self.room_wait_ms

        def retry(final: bool) -> m.MasterReply | None:
            return self.handle(request) if final else self._try_put(request)

        later = Later(retry, deadline)
        self.laters.append(later)
        return later

    def _try_put(self, request: m.MasterRequest) -> m.MasterReply | None:
        """The put's reply, or None when it waits for room a copy in flight makes."""
        self.may_wait, self.waits = True, False
        try:
            reply = self.handle(request)
        finally:
            self.may_wait = False
        waits, self.waits = self.waits, False
        return None if waits else reply

    def settle(self, expire: bool = False) -> None:
        """Apply what nodes reported, and answer the held replies that can be: when a
        copy ended (room may be free), or at their deadline.  ``expire`` (the periodic
        tick): abandon the copies past their deadline first."""
        if expire and len(self.copies):
            self._abandon(self.copies.overdue(self.clock()))
        progressed = self._settle_copies()
        if not self.laters:
            return
        now = self.clock()
        for later in list(self.laters):
            if later.deliver is None:
                continue  # the server has not taken it yet
            final = now >= later.deadline_ms
            if final:  # the nodes that did not answer in time lose their copies
                self._abandon(self.copies.overdue(now, self.room_wait_ms))
            elif not progressed:
                continue
            reply = later.retry(final)
            if reply is not None:
                self.laters.remove(later)
                later.deliver(reply)

    def _settle_copies(self) -> bool:
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
            elif ok and self.index.location_of(event.key) is None:
                self._remote_ssd_remove(owner, [event.key])  # copied after we gave up
        return bool(reports)

    def _abandon(self, events: list[Demote]) -> None:
        for event in events:
            dropped = self.index.demote_abandoned(event)
            if dropped is not None:
                self.index.stall_copies(event.src.client_id, True)  # until it answers
                self.metrics.demote_failures.inc()
                self._apply([dropped])

    def _remote_ssd_remove(self, client_id: str, keys: list[str]) -> None:
        address = self.client_addresses.get(client_id, ("", ""))[0]
        if address:
            self.node_links.ssd_remove(address, client_id, keys)

    def _remote_demote(self, event: Demote) -> None:
        address = self.client_addresses.get(event.src.client_id, ("", ""))[0]
        if address:
            self.copies.start(address, event, self.clock())
        else:
            self._abandon([event])
