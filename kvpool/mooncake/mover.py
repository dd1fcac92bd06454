"""Mooncake's Transfer Engine as a byte mover: registered memory and batch reads.

One :class:`EngineMover` per worker rank, on Mooncake's peer-to-peer handshake (no
metadata service: a peer is named ``host:rpc_port``); memory regions are registered once,
and byte ranges of a peer's are read into its own, over ``rdma`` or the engine's ``tcp``.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

from kvpool.closing import Closing
from kvpool.config.fabrics import ENGINE_INSTALL
from kvpool.errors import ConfigError, TransferError

__all__ = ["MAX_BATCH", "EngineMover"]

_METADATA = "P2PHANDSHAKE"  # peers exchange segment descriptors directly, no service
_TIMEOUT_VAR = "MC_TRANSFER_TIMEOUT"
_MIN_ENGINE_TIMEOUT_S = 5  # the engine takes no less
# Requests per engine batch: the engine allocates a batch of this many slots per call.
MAX_BATCH = 1024


# The engine's listeners bind every interface: tests run it only inside a private network
# namespace (:mod:`kvpool.testing.mooncake`).  ``mooncake`` is imported only in
# :meth:`EngineMover.start`, so kvpool imports without the extra.
#
# Bounds: a sync read returns when every slice arrived, failed, or the engine's own timeout
# passed, ``MC_TRANSFER_TIMEOUT`` seconds (at least 5) plus one second per GiB; the engine
# reads the variable when it is constructed, so :meth:`EngineMover.start` sets it from the
# caller's timeout unless the environment already does.  A peer that is gone fails at once
# (its handshake port refuses), and a range outside the peer's registered memory is
# refused by the peer.
class EngineMover(Closing):
    """One started Transfer Engine and the memory it registered."""

    def __init__(self, engine: Any, hostname: str, protocol: str) -> None:
        self._engine = engine
        self.protocol = protocol
        #: this engine's name as peers reach it (``host:rpc_port``)
        self.endpoint = f"{hostname}:{engine.get_rpc_port()}"
        self._registered: list[int] = []

    @classmethod
    def start(cls, hostname: str, protocol: str, device_name: str, timeout_s: float) -> EngineMover:
        """Start an engine on ``hostname`` over ``protocol``; ConfigError when it cannot."""
        os.environ.setdefault(_TIMEOUT_VAR, str(max(_MIN_ENGINE_TIMEOUT_S, math.ceil(timeout_s))))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError(
                f"protocol: {protocol!r} over Mooncake's Transfer Engine needs the mooncake"
                f" extra ({exc}): {ENGINE_INSTALL}"
            ) from None
        engine = TransferEngine()
        rc = engine.initialize(hostname, _METADATA, protocol, device_name)
        if rc != 0:
            raise ConfigError(
                f"protocol: Mooncake's Transfer Engine did not start on {hostname} over"
                f" {protocol!r} (device_name {device_name!r}, code {rc}); check local_hostname"
                " and device_name in the node config"
            )
        return cls(engine, hostname, protocol)

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        """Register ``(address, length)`` regions, once, before any transfer uses them."""
        addrs = [a for a, _ in regions]
        rc = self._live().batch_register_memory(addrs, [n for _, n in regions])
        if rc != 0:
            raise TransferError(
                f"the Transfer Engine could not register {len(regions)} KV cache regions"
                f" (code {rc})"
            )
        self._registered += addrs

    def read(
        self,
        peer: str,
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
        deadline: float,
    ) -> None:
        """Read ``remote[i]`` of ``peer``'s registered memory into ``local[i]`` of ours,
        ``lengths[i]`` bytes each, in batches of :data:`MAX_BATCH`."""
        for at in range(0, len(local), MAX_BATCH):
            if time.monotonic() >= deadline:
                raise TransferError(f"timed out reading KV pages from {peer}")
            end = at + MAX_BATCH
            rc = self._live().batch_transfer_sync_read(
                peer, list(local[at:end]), list(remote[at:end]), list(lengths[at:end])
            )
            if rc < 0:
                raise TransferError(
                    f"the Transfer Engine's read from {peer} over {self.protocol} failed"
                    f" (code {rc}; the prefill is gone, or its memory is not registered)"
                )

    def _live(self) -> Any:
        if self._engine is None:
            raise TransferError("the Transfer Engine is closed")
        return self._engine

    def close(self) -> None:
        addrs, self._registered = self._registered, []
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if addrs:
            engine.batch_unregister_memory(addrs)
        # The engine goes now, by its last reference, not in a later garbage collection:
        # its destructor holds the GIL for seconds (it stops its threads), which, at a
        # collection's moment, stalls every thread of the process, a serving one included.
        del engine
