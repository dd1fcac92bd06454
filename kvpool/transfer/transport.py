"""The client's transport seam: how its bytes reach the segments the master names.

A :class:`Transport` opens a :class:`DataPath` to one storage owner (a node, or the
master's own segment) by its data address; a data path moves bytes between caller
buffers and ``(segment_id, offset)`` of that owner's segments, and reads objects of its
SSD tier.  The client holds one data path per owner, drops it when a transfer fails,
and opens it again on next use.  The transports:

- :class:`SharedMemoryTransport` (``"shm"``, the default): segments on this host are
  attached and copied into directly; every other segment is reached over TCP.
- :class:`TcpTransport` (``"tcp"``): every byte over kvpool's TCP data plane.
- :class:`~kvpool.transfer.in_process.InProcessTransport`: this process's own storage,
  plain memory copies (the embedded pool).

Another fabric (Mooncake's Transfer Engine, RDMA) is one more class with ``connect``.
Buffers are anything with the buffer protocol, NumPy arrays, or CPU tensors.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Any, Protocol

from kvpool.core.credentials import Credential
from kvpool.errors import ConfigError, KVPoolError
from kvpool.net import split_address
from kvpool.transfer.path import NodeDataPath

__all__ = [
    "TRANSPORTS",
    "DataPath",
    "Item",
    "SharedMemoryTransport",
    "TcpTransport",
    "Transport",
    "transport_named",
]

#: one transfer of a batch: segment id, offset in it, the caller's buffer
Item = tuple[str, int, Any]


class DataPath(Protocol):
    """What a client needs from a connection to one storage owner.

    Single transfers raise on failure (:class:`~kvpool.errors.TransferError` or
    :class:`~kvpool.errors.PeerTimeout` when the owner cannot be reached, the owner's
    refusal otherwise); batches return one result per item (None for success).
    ``shm_name`` is the segment's shared-memory name when the master's placement
    carries one; paths that do not use shared memory ignore it.
    """

    def write(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int: ...

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
        """:meth:`write` an object's bytes, and have its owner note ``key`` and
        ``checksum`` for its catalog as they land where it can (a tagged write through
        its data server).  True when it did: the master may then acknowledge the put
        without waiting for the owner to confirm the entry (``PutEnd.noted``)."""
        ...

    def read_into(
        self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = ""
    ) -> int: ...

    def read_checked(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        """:meth:`read_into`, returning the bytes' checksum
        (:func:`kvpool.storage.checksum.checksum`) to compare with the index's: over TCP
        computed as the bytes arrive, overlapping the rest of the transfer."""
        ...

    def write_many(self, items: Sequence[Item]) -> list[KVPoolError | None]: ...

    def write_many_noted(
        self, items: Sequence[Item], notes: Sequence[tuple[str, int]]
    ) -> tuple[list[KVPoolError | None], bool]:
        """:meth:`write_many` with each item's ``(key, checksum)`` for the owner's
        catalog, as :meth:`write_noted`; the bool: every item went where it was noted."""
        ...

    def read_many_into(self, items: Sequence[Item]) -> list[KVPoolError | None]: ...

    def read_many_checked(self, items: Sequence[Item]) -> list[KVPoolError | int]:
        """:meth:`read_many_into` with each read item's checksum in place of ``None``,
        as :meth:`read_checked` (over TCP each value is hashed as soon as it lands)."""
        ...

    def ssd_read_into(self, key: str, buffer: Any) -> int: ...

    def close(self) -> None: ...


class Transport(Protocol):
    """Opens data paths; one instance serves one client."""

    #: what config calls it (``"shm"``, ``"tcp"``, ``"in-process"``)
    name: str

    def connect(self, address: str) -> DataPath:
        """A data path to the storage owner serving at ``address`` (``host:port``);
        connecting may be deferred to the first transfer."""
        ...


class TcpTransport:
    """Every transfer over kvpool's TCP data plane (zero-copy into the destination)."""

    name = "tcp"
    _shared_memory = False

    def __init__(
        self,
        timeout_s: float = 10.0,
        *,
        credential: Credential | None = None,
        client_id: str = "",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.tls = tls  # verifies each node's data port (None: plain TCP)
        self.timeout_s = timeout_s
        self.credential = credential  # proved to each node's data port (None: no handshake)
        self.client_id = client_id

    def connect(self, address: str) -> NodeDataPath:
        host, port = split_address(address)
        return NodeDataPath(
            host,
            port,
            timeout_s=self.timeout_s,
            allow_shm=self._shared_memory,
            credential=self.credential,
            client_id=self.client_id,
            tls=self.tls,
        )


class SharedMemoryTransport(TcpTransport):
    """Shared memory for segments on this host (same host token), TCP for the rest."""

    name = "shm"
    _shared_memory = True


#: the transports a client can be configured with by name
TRANSPORTS: dict[str, type[TcpTransport]] = {
    SharedMemoryTransport.name: SharedMemoryTransport,
    TcpTransport.name: TcpTransport,
}


def transport_named(
    name: str,
    timeout_s: float = 10.0,
    *,
    credential: Credential | None = None,
    client_id: str = "",
    tls: ssl.SSLContext | None = None,
) -> TcpTransport:
    """The network transport called ``name`` in config (``"shm"`` or ``"tcp"``)."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        known = ", ".join(sorted(TRANSPORTS))
        raise ConfigError(f"transport {name!r} is not one of {known}") from None
    return cls(timeout_s, credential=credential, client_id=client_id, tls=tls)
