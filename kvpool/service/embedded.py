"""An in-process pool with no master: the same API as :class:`~kvpool.service.client.Client`.

For a single node (the store connector's ``backend: embedded``) and for tests.  The
master's request handler runs in this process behind a lock, and bytes are copied
straight into and out of a local memory segment (and SSD tier, when given).  Nothing
listens on a socket.
"""

from __future__ import annotations

import threading
from typing import Any

from kvpool.core.index import IndexConfig
from kvpool.errors import ObjectNotFound
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error
from kvpool.service.client import Client
from kvpool.service.local_storage import LocalStorage
from kvpool.service.master import MasterService

__all__ = ["EmbeddedPool"]


class _LocalPath:
    """The data path to this process's own storage: plain memory copies."""

    def __init__(self, storage: LocalStorage) -> None:
        self.storage = storage
        self.tcp = self  # SSD reads are asked of ``path.tcp`` by the client

    def write(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        assert self.storage.segment is not None
        return self.storage.segment.write(offset, buffer)

    def read_into(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        assert self.storage.segment is not None
        return self.storage.segment.read_into(offset, buffer)

    def ssd_read_into(self, key: str, buffer: Any) -> int:
        if self.storage.ssd is None:
            raise ObjectNotFound(f"{key}: no SSD tier")
        return self.storage.ssd.read_into(key, buffer)

    def close(self) -> None:
        pass


class EmbeddedPool(Client):
    """A whole pool inside this process."""

    _pipelined = False  # call() below runs the master's handler: nothing to post on

    def __init__(
        self,
        segment_size: int,
        *,
        config: IndexConfig | None = None,
        ssd_path: str = "",
        ssd_limit: int = 0,
    ) -> None:
        super().__init__("embedded", client_id="embedded-client")
        cfg = config or IndexConfig(enable_offload=bool(ssd_path))
        self.service = MasterService(cfg)
        # No data server is needed in-process, but LocalStorage owns the segment and SSD
        # tier the same way a node does; its server is simply never started.
        self.storage = LocalStorage(
            "embedded", segment_size, ssd_path=ssd_path, ssd_limit=ssd_limit
        )
        self.service.attach_local(self.storage)
        self._local_path = _LocalPath(self.storage)
        self._service_lock = threading.Lock()
        self._last_tick_ms = 0

    def call(self, request: m.MasterRequest) -> m.MasterReply:
        with self._service_lock:
            now = self.service.clock()
            if now - self._last_tick_ms >= 100:  # what the master's tick loop would do
                self._last_tick_ms = now
                self.service.tick()
            reply = self.service.handle(request)
        if isinstance(reply, Error):
            raise reply.to_exception()
        return reply

    def _path(self, placement: m.Placement) -> Any:
        return self._local_path

    def _report(self, placement: m.Placement, exc: BaseException) -> None:
        pass  # nothing remote to blame

    def close(self) -> None:
        self.storage.close()
