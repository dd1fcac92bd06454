"""The ``kvpool`` engine: kvpool's own master and storage nodes, through :class:`kvpool.Client`.

The shared pool of a P/D cluster: every process opens its own client (a connection to the
master plus direct data paths to the nodes); metadata goes to the master, bytes go
straight to the node that owns the segment.
"""

from __future__ import annotations

from kvpool.engines.kvpool_client import ClientEngine

__all__ = ["MasterEngine"]


class MasterEngine(ClientEngine):
    """kvpool's master as a :class:`~kvpool.engines.base.PoolEngine`."""

    engine = "kvpool"

    @classmethod
    def connect(cls, master: str, *, timeout_s: float) -> MasterEngine:
        """An engine for the master at ``host:port``; connects on first use, and every
        call waits at most ``timeout_s``."""
        from kvpool.service.client import Client

        return cls(Client(master, timeout_s=timeout_s))
