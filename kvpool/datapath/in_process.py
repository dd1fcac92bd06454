"""The in-process transport: a client and the storage it reads and writes share a process.

The embedded pool's transfers are plain memory copies (or file reads), nothing listens on
a socket, and with one storage owner every address leads to the same data path.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.datapath.data_ops import DataOp, OpResult, ReadOp, WriteOp
from kvpool.errors import KVPoolError, ObjectNotFound, UnknownSegment
from kvpool.storage.buffers import byte_view
from kvpool.storage.checksum import checksum
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import SsdStore

__all__ = ["InProcessPath", "InProcessTransport"]


class InProcessPath:
    """Copies between caller buffers and this process's own segment and SSD tier."""

    def __init__(self, segment: Segment | None, ssd: SsdStore | None) -> None:
        self.segment = segment
        self.ssd = ssd

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        """The ops (:mod:`kvpool.datapath.data_ops`), each a plain copy.  Nothing here
        can fail a whole list: each op's error is its result.  No write is noted (the
        master's own storage: the master is its catalog)."""
        results: list[OpResult] = []
        for op in ops:
            try:
                results.append(self._one(op))
            except KVPoolError as exc:
                results.append(exc)
        return results

    def _one(self, op: DataOp) -> OpResult:
        if isinstance(op, WriteOp):
            self._memory().write(op.offset, op.buffer)
            return None
        if isinstance(op, ReadOp):
            self._memory().read_into(op.offset, op.buffer)
            if op.running is not None:
                op.running.update(byte_view(op.buffer))
            return checksum(byte_view(op.buffer)) if op.checked else None
        if self.ssd is None:
            raise ObjectNotFound(f"{op.key}: no SSD tier")
        self.ssd.read_into(op.key, op.buffer)
        return None

    def _memory(self) -> Segment:
        if self.segment is None:
            raise UnknownSegment("this pool has no memory segment")
        return self.segment

    def close(self) -> None:
        pass  # the storage belongs to its owner, not to the path


class InProcessTransport:
    """The transport of a pool whose storage is in this process."""

    name = "in-process"

    def __init__(self, segment: Segment | None, ssd: SsdStore | None = None) -> None:
        self._path = InProcessPath(segment, ssd)

    def connect(self, address: str) -> InProcessPath:
        return self._path
