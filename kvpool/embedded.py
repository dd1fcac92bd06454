"""An in-process pool with no master: the same API as :class:`~kvpool.client.client.Client`.

For a single node (the store connector's ``backend: embedded``) and for tests.  It *is* a
Client, with two in-process seams instead of sockets: the master's request handler runs in
this process behind a lock, and bytes are copied straight to and from a local segment.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

from kvpool.client.client import Client
from kvpool.core.objects import IndexConfig
from kvpool.datapath.in_process import InProcessTransport
from kvpool.errors import KVPoolError
from kvpool.master.service import MasterService, monotonic_ms
from kvpool.node.storage import LocalStorage
from kvpool.protocol import messages as m

__all__ = ["TICK_INTERVAL_MS", "EmbeddedPool", "InProcessMaster"]

#: how often calls run the master's periodic work (what its tick loop does in a server)
TICK_INTERVAL_MS = 100


class InProcessMaster:
    """A :class:`~kvpool.client.master_link.MasterLink` to a handler in this process.

    Nothing to pipeline: a request is handled before ``call`` returns, so ``post`` is a
    call whose reply is dropped.  Leases, writers and clients still expire on time: the
    master's tick runs before a request once :data:`TICK_INTERVAL_MS` has passed.
    """

    pipelined = False

    def __init__(self, service: MasterService) -> None:
        self.service = service
        self._lock = threading.Lock()
        self._last_tick_ms = 0

    def call(
        self, request: m.MasterRequest, meanwhile: Callable[[], object] | None = None
    ) -> m.MasterReply:
        with self._lock:
            now = self.service.clock()
            if now - self._last_tick_ms >= TICK_INTERVAL_MS:
                self._last_tick_ms = now
                self.service.tick()
            reply = self.service.handle(request)
        if meanwhile is not None:
            meanwhile()
        return reply

    def post(self, request: m.MasterRequest) -> None:
        with contextlib.suppress(KVPoolError):
            self.call(request)

    def close(self) -> None:
        pass  # the service lives as long as the pool that made it


class EmbeddedPool(Client):
    """A whole pool inside this process."""

    def __init__(
        self,
        segment_size: int,
        *,
        config: IndexConfig | None = None,
        ssd_path: str = "",
        ssd_limit: int = 0,
        clock: Callable[[], int] = monotonic_ms,
    ) -> None:
        cfg = config or IndexConfig(enable_offload=bool(ssd_path))
        service = MasterService(cfg, clock=clock)  # a test's clock ends leases at its will
        # No data server is needed in-process, but LocalStorage owns the segment and SSD
        # tier the same way a node does; its server is simply never started.
        storage = LocalStorage(
            "embedded", segment_size, ssd_path=ssd_path, ssd_limit=ssd_limit, serve=False
        )
        service.attach_local(storage)
        super().__init__(
            "embedded",
            client_id="embedded-client",
            transport=InProcessTransport(storage.segment, storage.ssd),
            link=InProcessMaster(service),
        )
        self.service = service
        self.storage = storage

    def close(self) -> None:
        super().close()
        self.storage.close()
