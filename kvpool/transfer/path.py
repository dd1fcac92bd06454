"""Pick the data path per segment: shared memory on the same host, TCP otherwise.

:class:`NodeDataPath` is the :class:`~kvpool.transfer.transport.DataPath` of the network
transports to one node: on first use of a segment it asks the node (``SegmentInfo``) for
the segment's shared-memory name and host token; when the token equals this process's
:func:`~kvpool.transfer.shm.host_token` and the segment attaches, every later access
is a direct copy, else it goes over TCP.  The choice is made once per segment.

A direct copy into a segment whose owner died raises
:class:`~kvpool.errors.TransferError`, as a TCP transfer to a dead node does (see
:mod:`kvpool.transfer.shm`), so the client reports it the same way.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence
from typing import Any, Literal, cast

from kvpool.closing import Closing
from kvpool.core.credentials import Credential
from kvpool.errors import KVPoolError, PoolError
from kvpool.storage.buffers import byte_view
from kvpool.storage.checksum import checksum
from kvpool.transfer.segment_client import SegmentConnection
from kvpool.transfer.shm import ShmConnection, host_token

__all__ = ["NodeDataPath", "Route"]

Route = Literal["shm", "tcp"]


class NodeDataPath(Closing):
    """Reads and writes of one node's segments by the fastest path available."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout_s: float = 10.0,
        allow_shm: bool = True,
        credential: Credential | None = None,
        client_id: str = "",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.tcp = SegmentConnection(
            host, port, timeout_s, credential=credential, client_id=client_id, tls=tls
        )
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

    def forget(self, segment_id: str) -> None:
        """Drop the cached route (the segment was removed or its node restarted)."""
        with self._lock:
            self._routes.pop(segment_id, None)
        self.shm.detach(segment_id)

    def write(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        """Write ``buffer`` at ``offset``; ``shm_name`` as in :meth:`route`."""
        if self.route(segment_id, shm_name) == "shm":
            return self.shm.write(segment_id, offset, buffer)
        return self.tcp.write(segment_id, offset, buffer)

    def write_noted(
        self,
        segment_id: str,
        offset: int,
        buffer: Any,
        key: str,
        checksum: int,
        *,
        shm_name: str = "",
    ) -> bool:
        """As :meth:`write`; over TCP the write carries ``key`` and ``checksum`` for the
        node's catalog (True).  A shared-memory copy does not pass the node (False)."""
        if self.route(segment_id, shm_name) == "shm":
            self.shm.write(segment_id, offset, buffer)
            return False
        self.tcp.write(segment_id, offset, buffer, key=key, checksum=checksum)
        return True

    def read_into(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        """Fill ``buffer`` from ``offset``; ``shm_name`` as in :meth:`route`."""
        if self.route(segment_id, shm_name) == "shm":
            return self.shm.read_into(segment_id, offset, buffer)
        return self.tcp.read_into(segment_id, offset, buffer)

    def read_checked(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        """:meth:`read_into` and the bytes' checksum: over TCP hashed as they arrive, a
        shared-memory copy hashed after it."""
        if self.route(segment_id, shm_name) == "shm":
            self.shm.read_into(segment_id, offset, buffer)
            return checksum(byte_view(buffer))
        return self.tcp.read_checked(segment_id, offset, buffer)

    def write_many(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | None]:
        """Many writes: direct copies where shared memory applies, one TCP pipeline for
        the rest.  One result per item, as :meth:`SegmentConnection.write_many`."""
        return self._many(items, write=True)

    def write_many_noted(
        self, items: Sequence[tuple[str, int, Any]], notes: Sequence[tuple[str, int]]
    ) -> tuple[list[KVPoolError | None], bool]:
        """As :meth:`write_many`, the TCP items tagged with their notes; True when every
        item went over TCP (a shared-memory copy does not pass the node)."""
        noted = all(self.route(segment_id) == "tcp" for segment_id, _, _ in items)
        return self._many(items, write=True, notes=notes), noted

    def read_many_into(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | None]:
        """Many reads into caller buffers; see :meth:`write_many`."""
        return self._many(items, write=False)

    def read_many_checked(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | int]:
        """:meth:`read_many_into` with each read item's checksum (over TCP hashed as each
        value lands, while the rest of the batch arrives)."""
        return cast("list[KVPoolError | int]", self._many(items, write=False, checked=True))

    def _many(
        self,
        items: Sequence[tuple[str, int, Any]],
        *,
        write: bool,
        notes: Sequence[tuple[str, int]] | None = None,
        checked: bool = False,
    ) -> list[Any]:
        """One result per item: its error, or None (a checked read: its checksum)."""
        results: list[KVPoolError | int | None] = [None] * len(items)
        over_tcp: list[int] = []
        copied: set[str] = set()  # segments copied to or from: their owner is asked once
        for i, (segment_id, offset, buffer) in enumerate(items):
            if self.route(segment_id) != "shm":
                over_tcp.append(i)
                continue
            try:
                if write:
                    self.shm.write(segment_id, offset, buffer, check=False)
                else:
                    self.shm.read_into(segment_id, offset, buffer, check=False)
                    if checked:
                        results[i] = checksum(byte_view(buffer))
                copied.add(segment_id)
            except KVPoolError as exc:
                results[i] = exc
        for segment_id in copied:
            # a dead owner fails the whole batch to it, as a dead node does over TCP
            self.shm.check_owner(segment_id)
        if over_tcp:
            batch = [items[i] for i in over_tcp]
            done: Sequence[KVPoolError | int | None]
            if write:
                tags = [notes[i] for i in over_tcp] if notes else None
                done = self.tcp.write_many(batch, tags)
            elif checked:
                done = self.tcp.read_many_checked(batch)
            else:
                done = self.tcp.read_many_into(batch)
            for i, result in zip(over_tcp, done, strict=True):
                results[i] = result
        return results

    def ssd_read_into(self, key: str, buffer: Any) -> int:
        """An object of the node's SSD tier into ``buffer`` (always over TCP: the files
        are the node's, not mapped here)."""
        return self.tcp.ssd_read_into(key, buffer)

    def close(self) -> None:
        self.tcp.close()
        self.shm.close()
