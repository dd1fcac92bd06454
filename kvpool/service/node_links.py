"""The master's own connections to storage nodes, for the work it asks of them.

The master never carries object bytes, but two effects of the index happen on a node's
own storage: a demotion (the node copies an object from its memory segment to its SSD
tier) and the deletion of SSD files the index dropped.  One blocking
:class:`~kvpool.transfer.segment_client.SegmentConnection` per node data address, made on
first use.
"""

from __future__ import annotations

import logging

from kvpool.core.index import Demote
from kvpool.errors import KVPoolError
from kvpool.transfer.segment_client import SegmentConnection

__all__ = ["NodeLinks"]

log = logging.getLogger("kvpool.master")


class NodeLinks:
    """Connections from the master to nodes' data servers, by data address."""

    def __init__(self, timeout_s: float = 10.0) -> None:
        self.timeout_s = timeout_s
        self._conns: dict[str, SegmentConnection] = {}

    def _connection(self, address: str) -> SegmentConnection:
        conn = self._conns.get(address)
        if conn is None:
            host, _, port = address.rpartition(":")  # as the node wrote it: host:port
            conn = SegmentConnection(host, int(port), timeout_s=self.timeout_s)
            self._conns[address] = conn
        return conn

    def demote(self, address: str, event: Demote) -> bool:
        """Have the node at ``address`` copy its own object to its SSD tier.  Blocking on
        purpose: the freed memory extent must not be handed out before the copy is done."""
        src = event.src
        try:
            self._connection(address).demote(
                src.segment_id, src.offset, src.size, event.key, event.checksum
            )
        except KVPoolError as exc:
            log.warning("demotion of %s on %s failed: %s", event.key, src.client_id, exc)
            return False
        return True

    def ssd_remove(self, address: str, client_id: str, keys: list[str]) -> None:
        """Delete SSD files the index dropped; failure only leaves orphans, cleared when the
        node restarts."""
        try:
            self._connection(address).ssd_remove(keys)
        except KVPoolError as exc:
            log.warning("could not delete %d SSD objects on %s: %s", len(keys), client_id, exc)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
