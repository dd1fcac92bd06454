"""Pick the data path per segment: shared memory on the same host, TCP otherwise."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

from kvpool.closing import Closing
from kvpool.datapath.data_ops import DataOp, OpResult, ReadOp, SsdReadOp, WriteOp
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.shm import ShmConnection, host_token
from kvpool.errors import KVPoolError, PoolError
from kvpool.security.peer import PLAIN_PEER, PeerSettings
from kvpool.storage.buffers import byte_view
from kvpool.storage.checksum import checksum

__all__ = ["NodeDataPath", "Route"]

Route = Literal["shm", "tcp"]


class NodeDataPath(Closing):
    """Reads and writes of one node's segments by the fastest path available.

    :class:`NodeDataPath` is the :class:`~kvpool.datapath.transport.DataPath` of the network
    transports to one node: on first use of a segment it asks the node (``SegmentInfo``) for
    the segment's shared-memory name and host token; when the token equals this process's
    :func:`~kvpool.datapath.shm.host_token` and the segment attaches, every later access
    is a direct copy, else it goes over TCP.  The choice is made once per segment, and
    checked against each op's ``shm_name`` (a node restarted under the same segment id has a
    new one).  An op list is split by route: the shared-memory ops are copied here, the rest
    go to the node's :class:`~kvpool.datapath.segment_client.SegmentConnection` as one list
    (one pipelined batch per kind).

    A direct copy into a segment whose owner died raises
    :class:`~kvpool.errors.TransferError`, as a TCP transfer to a dead node does (see
    :mod:`kvpool.datapath.shm`), so the client reports it the same way.
    """

    def __init__(
        self, host: str, port: int, peer: PeerSettings = PLAIN_PEER, *, allow_shm: bool = True
    ) -> None:
        self.tcp = SegmentConnection(host, port, peer)
        self.shm = ShmConnection()
        self.allow_shm = allow_shm
        self._routes: dict[str, Route] = {}
        self._token = host_token() if allow_shm else ""
        self._lock = threading.Lock()

    def route(self, segment_id: str, shm_name: str = "") -> Route:
        """``"shm"`` or ``"tcp"`` for this segment (asks the node on first use).

        ``shm_name``, when the caller knows it (the master's placement carries it), is
        checked against the cached attachment: a node restarted under the same segment id
        has a new shared-memory name, and a stale mapping would take writes into memory
        nobody reads.  A mismatch drops the cached route and decides again.
        """
        with self._lock:
            known = self._routes.get(segment_id)
        if known is not None:
            if known == "tcp" or not shm_name or self.shm.name_of(segment_id) == shm_name:
                return known
            self.forget(segment_id)
        chosen: Route = "tcp"
        if self.allow_shm:
            info = self.tcp.info(segment_id)
            if info.host_token == self._token and info.shm_name:
                try:
                    self.shm.attach(segment_id, info.shm_name, info.size)
                    chosen = "shm"
                except PoolError:
                    chosen = "tcp"  # same token but not attachable (permissions): use TCP
        with self._lock:
            self._routes[segment_id] = chosen
        return chosen

    def prepare(self, segment_id: str, shm_name: str = "") -> None:
        """Set up now what the first op on ``segment_id`` would: the connection to its
        owner and, on the same host, its mapping (:meth:`route`)."""
        if self.route(segment_id, shm_name) == "tcp":
            self.tcp.connect()

    def forget(self, segment_id: str) -> None:
        """Drop the cached route (the segment was removed or its node restarted)."""
        with self._lock:
            self._routes.pop(segment_id, None)
        self.shm.detach(segment_id)

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        """The ops (:mod:`kvpool.datapath.data_ops`): direct copies where shared memory
        applies, one list over TCP for the rest (SSD reads always: the node's files are
        not mapped here).  A copy does not pass the node, so a noted write copied is
        stored, not noted (None); a checked read copied is hashed after the copy."""
        results: list[OpResult] = [None] * len(ops)
        over_tcp: list[int] = []
        copied: set[str] = set()  # segments copied to or from: their owner is asked once
        routes: dict[tuple[str, str], Route] = {}  # this list's routes, each decided once
        for i, op in enumerate(ops):
            if isinstance(op, SsdReadOp) or self._route(op, routes) != "shm":
                over_tcp.append(i)
                continue
            try:
                results[i] = self._copy(op)
            except KVPoolError as exc:
                results[i] = exc
            else:
                copied.add(op.segment_id)
        for segment_id in copied:
            # a dead owner fails the whole list to it, as a dead node does over TCP
            self.shm.check_owner(segment_id)
        if len(over_tcp) == len(ops):
            return self.tcp.run(ops)
        if over_tcp:
            done = self.tcp.run([ops[i] for i in over_tcp])
            for i, result in zip(over_tcp, done, strict=True):
                results[i] = result
        return results

    def _route(self, op: WriteOp | ReadOp, routes: dict[tuple[str, str], Route]) -> Route:
        place = (op.segment_id, op.shm_name)
        known = routes.get(place)
        if known is None:
            known = routes[place] = self.route(op.segment_id, op.shm_name)
        return known

    def _copy(self, op: WriteOp | ReadOp) -> int | None:
        """One op by shared memory; its owner is checked by the caller, once a segment."""
        if isinstance(op, WriteOp):
            self.shm.write(op.segment_id, op.offset, op.buffer, check=False)
            return None
        self.shm.read_into(op.segment_id, op.offset, op.buffer, check=False)
        if op.running is not None:  # hashed while the bytes are still in the cache
            op.running.update(byte_view(op.buffer))
        return checksum(byte_view(op.buffer)) if op.checked else None

    def close(self) -> None:
        self.tcp.close()
        self.shm.close()
