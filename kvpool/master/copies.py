"""Demotions in flight on nodes, and the replies that wait for the room they make.

A node copies a demoted object to its SSD tier on its own time (the object is DEMOTING
meanwhile); a put that only those copies would make room for is answered :class:`Later`.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Callable

from kvpool.core.objects import Demote
from kvpool.master.node_links import NodeLinks
from kvpool.protocol import messages as m

__all__ = ["Copies", "Later"]

_CopyId = tuple[str, str, int]  # key, SSD segment, SSD offset: one copy of one object


def copy_id(event: Demote) -> _CopyId:
    return event.key, event.dst.segment_id, event.dst.offset


class Later:
    """A reply not ready yet.  ``retry(final)`` gives the reply, or None to wait on;
    with ``final`` (the deadline passed) it must give one.  The server sets
    ``deliver``, which sends it."""

    __slots__ = ("deadline_ms", "deliver", "retry")

    def __init__(self, retry: Callable[[bool], m.MasterReply | None], deadline_ms: int) -> None:
        self.retry = retry
        self.deadline_ms = deadline_ms
        self.deliver: Callable[[m.MasterReply], None] | None = None

    def then(self, out: Callable[[m.MasterReply], m.MasterReply]) -> None:
        """Give the reply, once there is one, through ``out`` (a layer's view of it)."""
        retry = self.retry

        def mapped(final: bool) -> m.MasterReply | None:
            reply = retry(final)
            return None if reply is None else out(reply)

        self.retry = mapped


class Copies:
    """The node copies in flight.

    Each copy goes through :class:`~kvpool.master.node_links.NodeLinks`, and the
    outcomes the link threads report are collected into a thread-safe queue; the master
    applies them on its own thread (``take_reports``), so the index is still touched by
    one thread only.  A copy not reported within its deadline is *overdue*: the master
    abandons it (the object is dropped, its memory free again) and stops copying to that
    owner until it answers.

    A put answered :class:`Later` has that connection's reply (and only that
    connection's) held while the master serves everyone else; the put is tried again
    whenever a copy finished, and at the deadline gets the final answer (stored, or
    NoSpace).  Copies and waits are both bounded, so a silent node costs a put at most
    ``room_wait_ms`` and never the master."""

    def __init__(self, links: NodeLinks, deadline_ms: int) -> None:
        self.links = links
        self.deadline_ms = deadline_ms
        #: called (on a link thread) when a report arrives; the server wakes its loop
        self.wakeup: Callable[[], object] = lambda: None
        self._reports: queue.SimpleQueue[tuple[Demote, bool]] = queue.SimpleQueue()
        self._in_flight: dict[_CopyId, tuple[Demote, int]] = {}  # -> (event, started)
        self.reported = 0  # outcomes taken so far

    def __len__(self) -> int:
        return len(self._in_flight)

    def start(self, address: str, event: Demote, now_ms: int) -> None:
        self._in_flight[copy_id(event)] = (event, now_ms)
        self.links.demote(address, event, self._report)

    def _report(self, event: Demote, ok: bool) -> None:
        self._reports.put((event, ok))  # any thread
        with contextlib.suppress(RuntimeError):  # the loop closed: the master is stopping
            self.wakeup()

    def has_reports(self) -> bool:
        return not self._reports.empty()

    def take_reports(self) -> list[tuple[Demote, bool, bool]]:
        """(event, copied, still in flight) for every outcome reported so far; a copy
        no longer in flight was abandoned as overdue before its owner answered."""
        out: list[tuple[Demote, bool, bool]] = []
        while True:
            try:
                event, ok = self._reports.get_nowait()
            except queue.Empty:
                self.reported += len(out)
                return out
            out.append((event, ok, self._in_flight.pop(copy_id(event), None) is not None))

    def overdue(self, now_ms: int, age_ms: int | None = None) -> list[Demote]:
        """Copies started ``age_ms`` (default: the deadline) or more ago, now abandoned."""
        cutoff = now_ms - (self.deadline_ms if age_ms is None else age_ms)
        late = [cid for cid, (_, started) in self._in_flight.items() if started <= cutoff]
        return [self._in_flight.pop(cid)[0] for cid in late]
