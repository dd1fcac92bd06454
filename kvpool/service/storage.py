"""Storage a process contributes to the pool: a shared-memory segment, an optional SSD
tier, and the data server that lets clients read and write them directly.

Used by ``kvpool master`` (its embedded segment, the single-command default) and by
``kvpool node``.  The master never carries object bytes: clients reach this data server
over TCP, or attach the segment's shared memory when they share the host.
"""

from __future__ import annotations

import logging

import xxhash

from kvpool.core.index import Demote
from kvpool.errors import KVPoolError
from kvpool.storage.segment import Segment, remove_stale_segments
from kvpool.storage.ssd import SsdStore
from kvpool.transfer.shm import host_token
from kvpool.transfer.tcp import SegmentServer

__all__ = ["LocalStorage", "checksum"]

log = logging.getLogger("kvpool.storage")


def checksum(data: memoryview | bytes | bytearray) -> int:
    """The end-to-end checksum of an object's bytes (xxh3-64)."""
    return xxhash.xxh3_64_intdigest(data)


class LocalStorage:
    """One memory segment (+ SSD tier) owned by this process, served over TCP and shm."""

    def __init__(
        self,
        client_id: str,
        segment_size: int,
        *,
        host: str = "127.0.0.1",
        data_port: int = 0,
        ssd_path: str = "",
        ssd_limit: int = 0,
        timeout_s: float = 10.0,
    ) -> None:
        self.client_id = client_id
        self.segment_id = f"{client_id}/mem"
        self.ssd_segment_id = f"{client_id}/ssd"
        if segment_size:
            remove_stale_segments()  # what a SIGKILLed predecessor left in /dev/shm
        self.segment = Segment.create(segment_size) if segment_size else None
        # The index enforces the limit on value bytes; the store's own cap only guards
        # against accounting bugs, so it leaves room for per-file headers.
        self.ssd = (
            SsdStore.open(ssd_path, ssd_limit + ssd_limit // 100 + (1 << 20))
            if ssd_path and ssd_limit
            else None
        )
        self.ssd_limit = ssd_limit if self.ssd is not None else 0
        self.host_token = host_token()
        self.server = SegmentServer(
            host, data_port, timeout_s=timeout_s, host_token=self.host_token, ssd=self.ssd
        )
        if self.segment is not None:
            self.server.add_segment(self.segment_id, self.segment)
        self.data_address = ""

    def start(self) -> str:
        host, port = self.server.start()
        self.data_address = f"{host}:{port}"
        return self.data_address

    @property
    def shm_name(self) -> str:
        return self.segment.name if self.segment is not None else ""

    def demote(self, event: Demote) -> bool:
        """Copy a memory object to the SSD tier; False (a counted failure) when the bytes
        no longer match their checksum or the disk refuses them."""
        if self.segment is None or self.ssd is None:
            return False
        data = self.segment.view(event.src.offset, event.src.size)
        if event.checksum and checksum(data) != event.checksum:
            log.warning("not demoting %s: its bytes changed under it", event.key)
            return False
        try:
            self.ssd.put(event.key, data)
        except KVPoolError as exc:
            log.warning("demotion of %s failed: %s", event.key, exc)
            return False
        return True

    def forget_ssd(self, key: str) -> None:
        if self.ssd is not None:
            self.ssd.remove(key)

    def close(self) -> None:
        self.server.close()
        if self.segment is not None:
            self.segment.close()
