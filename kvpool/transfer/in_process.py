"""The in-process transport: a client and the storage it reads and writes share a process.

The embedded pool (:class:`~kvpool.service.embedded.EmbeddedPool`) holds one memory
segment and an optional SSD tier in its own process; every transfer is a plain memory
copy (or a file read), and nothing listens on a socket.  There is one storage owner, so
every address leads to the same data path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.errors import KVPoolError, ObjectNotFound, UnknownSegment
from kvpool.storage.buffers import byte_view
from kvpool.storage.checksum import checksum
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import SsdStore
from kvpool.transfer.transport import Item

__all__ = ["InProcessPath", "InProcessTransport"]


class InProcessPath:
    """Copies between caller buffers and this process's own segment and SSD tier."""

    def __init__(self, segment: Segment | None, ssd: SsdStore | None) -> None:
        self.segment = segment
        self.ssd = ssd

    def _memory(self) -> Segment:
        if self.segment is None:
            raise UnknownSegment("this pool has no memory segment")
        return self.segment

    def write(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        return self._memory().write(offset, buffer)

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
        self.write(segment_id, offset, buffer)
        return False  # the master's own storage: the master is its catalog

    def read_into(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        return self._memory().read_into(offset, buffer)

    def read_checked(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        self.read_into(segment_id, offset, buffer)
        return checksum(byte_view(buffer))

    def write_many(self, items: Sequence[Item]) -> list[KVPoolError | None]:
        return [self._one(self.write, item) for item in items]

    def write_many_noted(
        self, items: Sequence[Item], notes: Sequence[tuple[str, int]]
    ) -> tuple[list[KVPoolError | None], bool]:
        return self.write_many(items), False

    def read_many_into(self, items: Sequence[Item]) -> list[KVPoolError | None]:
        return [self._one(self.read_into, item) for item in items]

    def read_many_checked(self, items: Sequence[Item]) -> list[KVPoolError | int]:
        done = self.read_many_into(items)
        return [
            checksum(byte_view(buffer)) if result is None else result
            for result, (_, _, buffer) in zip(done, items, strict=True)
        ]

    @staticmethod
    def _one(move: Any, item: Item) -> KVPoolError | None:
        try:
            move(*item)
        except KVPoolError as exc:
            return exc
        return None

    def ssd_read_into(self, key: str, buffer: Any) -> int:
        if self.ssd is None:
            raise ObjectNotFound(f"{key}: no SSD tier")
        return self.ssd.read_into(key, buffer)

    def close(self) -> None:
        pass  # the storage belongs to its owner, not to the path


class InProcessTransport:
    """The transport of a pool whose storage is in this process."""

    name = "in-process"

    def __init__(self, segment: Segment | None, ssd: SsdStore | None = None) -> None:
        self._path = InProcessPath(segment, ssd)

    def connect(self, address: str) -> InProcessPath:
        return self._path
