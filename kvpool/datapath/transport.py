"""The client's transport seam: how its bytes reach the segments the master names.

A :class:`Transport` opens a :class:`DataPath` to one storage owner by its data address; the
client holds one per owner, drops it when a transfer fails, and opens it again on next use.
Another fabric (Mooncake's Transfer Engine, RDMA) is one more class with ``connect``.
"""

from __future__ import annotations

from typing import Protocol

from kvpool.datapath.data_ops import DataPath
from kvpool.datapath.path import NodeDataPath
from kvpool.errors import ConfigError
from kvpool.net import split_address
from kvpool.security.peer import PLAIN_PEER, PeerSettings

__all__ = [
    "TRANSPORTS",
    "DataPath",
    "SharedMemoryTransport",
    "TcpTransport",
    "Transport",
    "transport_named",
]


class Transport(Protocol):
    """Opens data paths; one instance serves one client."""

    #: what config calls it (``"shm"``, ``"tcp"``, ``"in-process"``)
    name: str

    def connect(self, address: str) -> DataPath:
        """A data path to the storage owner serving at ``address`` (``host:port``);
        connecting may be deferred to the first transfer."""
        ...


# The transports: SharedMemoryTransport ("shm", the default): segments on this host are
# attached and copied into directly, every other segment is reached over TCP;
# TcpTransport ("tcp"): every byte over kvpool's TCP data plane; and
# kvpool.datapath.in_process.InProcessTransport: this process's own storage, plain memory
# copies (the embedded pool).  Buffers are anything with the buffer protocol, NumPy
# arrays, or CPU tensors.
class TcpTransport:
    """Every transfer over kvpool's TCP data plane (zero-copy into the destination).
    ``peer``: the timeout, credential, client id and TLS context each node's data port
    is dialled with."""

    name = "tcp"
    _shared_memory = False

    def __init__(self, peer: PeerSettings = PLAIN_PEER) -> None:
        self.peer = peer

    def connect(self, address: str) -> NodeDataPath:
        host, port = split_address(address)
        return NodeDataPath(host, port, self.peer, allow_shm=self._shared_memory)


class SharedMemoryTransport(TcpTransport):
    """Shared memory for segments on this host (same host token), TCP for the rest."""

    name = "shm"
    _shared_memory = True


#: the transports a client can be configured with by name
TRANSPORTS: dict[str, type[TcpTransport]] = {
    SharedMemoryTransport.name: SharedMemoryTransport,
    TcpTransport.name: TcpTransport,
}


def transport_named(name: str, peer: PeerSettings = PLAIN_PEER) -> TcpTransport:
    """The network transport called ``name`` in config (``"shm"`` or ``"tcp"``)."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        known = ", ".join(sorted(TRANSPORTS))
        raise ConfigError(f"transport {name!r} is not one of {known}") from None
    return cls(peer)
