"""The master's own connections to storage nodes, for the work it asks of them.

Demotions and the deletion of dropped SSD files happen on a node's own storage.  None of
it runs on the master's event loop: one slow or stopped node must not stop the master
serving everyone else.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable

from kvpool.closing import Closing
from kvpool.core.objects import Demote
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.errors import KVPoolError
from kvpool.security.peer import PeerSettings

__all__ = ["NodeLinks"]

log = logging.getLogger("kvpool.master")

#: jobs waiting per node: more than a watermark round demotes at once on a small node,
#: few enough that a stopped node holds little
QUEUE_DEPTH = 256

DemoteDone = Callable[[Demote, bool], None]
_Job = Callable[[SegmentConnection], None]


# Each node gets one worker thread, with its own blocking SegmentConnection and a bounded
# queue; every call on it ends within `timeout_s`.  A demotion's outcome comes back
# through the `done` callback, on the worker's thread (the master hands it to its loop); a
# job that finds the queue full fails at once, and one that waited longer than
# `timeout_s` behind a silent node fails without being sent, so a stalled node costs
# bounded memory and time, and its objects are dropped rather than waited for.
class _NodeWorker:
    """One node's connection, served by one thread from a bounded queue."""

    def __init__(self, address: str, peer: PeerSettings) -> None:
        host, _, port = address.rpartition(":")  # as the node wrote it: host:port
        self.conn = SegmentConnection(host, int(port), peer)
        self.jobs: queue.Queue[_Job | None] = queue.Queue(QUEUE_DEPTH)
        self.thread = threading.Thread(
            target=self._run, name=f"kvpool-node-link-{address}", daemon=True
        )
        self.thread.start()

    def submit(self, job: _Job) -> bool:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                job(self.conn)
            except Exception:  # a bug in one job must not end the node's link
                log.exception("node link job failed")
        self.conn.close()

    def stop(self, timeout_s: float) -> None:
        while True:  # make room for the sentinel: what is queued is abandoned
            try:
                self.jobs.put_nowait(None)
                break
            except queue.Full:
                with contextlib.suppress(queue.Empty):
                    self.jobs.get_nowait()
        self.thread.join(timeout_s)


class NodeLinks(Closing):
    """Work for nodes' data servers, by data address, off the caller's thread."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        #: how each node's data port is dialled: as "master", with the cluster secret
        #: and the pool's TLS context once the server has set them (:meth:`secure`)
        self.peer = PeerSettings(timeout_s, client_id="master")
        self._workers: dict[str, _NodeWorker] = {}

    @property
    def timeout_s(self) -> float:
        return self.peer.timeout_s

    def secure(self, peer: PeerSettings) -> None:
        """Dial each node's data port with ``peer`` from now on: the server knows the
        cluster secret (proved to each node) and its TLS context (verifying it) only once
        it starts; before the first link."""
        self.peer = peer

    def _worker(self, address: str) -> _NodeWorker:
        worker = self._workers.get(address)
        if worker is None:
            worker = self._workers[address] = _NodeWorker(address, self.peer)
        return worker

    def demote(self, address: str, event: Demote, done: DemoteDone) -> None:
        """Have the node at ``address`` copy its own object to its SSD tier; ``done``
        gets the outcome (on the worker's thread, or on the caller's when the node's
        queue is full)."""

        expires = time.monotonic() + self.timeout_s

        def job(conn: SegmentConnection) -> None:
            src = event.src
            if time.monotonic() > expires:  # waited behind a silent node: given up already
                done(event, False)
                return
            try:
                conn.demote(src.segment_id, src.offset, src.size, event.key, event.checksum)
            except KVPoolError as exc:
                log.warning("demotion of %s on %s failed: %s", event.key, src.client_id, exc)
                done(event, False)
                return
            done(event, True)

        if not self._worker(address).submit(job):
            log.warning("demotion of %s: %s has %d calls waiting", event.key, address, QUEUE_DEPTH)
            done(event, False)

    def ssd_remove(self, address: str, client_id: str, keys: list[str]) -> None:
        """Delete SSD files the index dropped; failure only leaves orphans, cleared when the
        node restarts."""

        def job(conn: SegmentConnection) -> None:
            try:
                conn.ssd_remove(keys)
            except KVPoolError as exc:
                log.warning("could not delete %d SSD objects on %s: %s", len(keys), client_id, exc)

        if not self._worker(address).submit(job):
            log.warning("not deleting %d SSD objects on %s: not answering", len(keys), client_id)

    def close(self) -> None:
        workers, self._workers = list(self._workers.values()), {}
        for worker in workers:  # a stopped node's thread is a daemon: not waited for long
            worker.stop(min(self.timeout_s, 1.0))
