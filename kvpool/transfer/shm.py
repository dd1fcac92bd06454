"""The same-host path: copy straight to and from a node's shared-memory segment.

A client on the node's host attaches the segment by name (see
:class:`~kvpool.storage.segment.Segment`) and copies with memoryview/NumPy, which
releases the GIL for large copies.  No socket, no kernel copy, no node thread.

:class:`ShmConnection` has the same ``write`` / ``read_into`` calls as
:class:`~kvpool.transfer.segment_server.SegmentConnection`, so callers do not care which one
they hold.  :func:`host_token` says whether two processes can share memory at all.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

from kvpool.closing import Closing
from kvpool.errors import UnknownSegment
from kvpool.storage.segment import SHM_DIR, Segment

__all__ = ["ShmConnection", "host_token"]

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_token(directory: Path = SHM_DIR) -> str:
    """An id shared exactly by processes that see the same shared-memory directory.

    Boot id (same kernel) plus the device and inode of ``/dev/shm`` (same tmpfs mount:
    containers on one host usually have their own).  Equal tokens mean a segment name
    created by one process can be attached by the other.
    """
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError:
        boot = os.uname().nodename
    st = os.stat(directory)
    return f"{boot}:{st.st_dev}:{st.st_ino}"


class ShmConnection(Closing):
    """Reads and writes of segments attached on this host, by segment id."""

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()

    def attach(self, segment_id: str, shm_name: str, size: int | None = None) -> None:
        """Map ``shm_name`` for ``segment_id``; with ``size``, check it is the right one.

        Every page is mapped now (see :meth:`Segment.attach`): ~0.2 s per GiB, once per
        process and segment, instead of a page fault per 4 KiB on later copies.  Raises
        :class:`~kvpool.errors.PoolError` when the name does not exist here.
        """
        segment = Segment.attach(shm_name)
        if size is not None and segment.size != size:
            segment.close()
            raise UnknownSegment(
                f"shared memory {shm_name!r} has {segment.size} bytes, segment "
                f"{segment_id!r} has {size}: not the same segment"
            )
        with self._lock:
            old = self._segments.pop(segment_id, None)
            self._segments[segment_id] = segment
        if old is not None:
            old.close()

    def name_of(self, segment_id: str) -> str | None:
        """The shared-memory name attached for ``segment_id`` (``None``: not attached)."""
        segment = self._segments.get(segment_id)
        return None if segment is None else segment.name

    def has(self, segment_id: str) -> bool:
        with self._lock:
            return segment_id in self._segments

    def detach(self, segment_id: str) -> None:
        """Unmap ``segment_id`` (e.g. when its node left the pool)."""
        with self._lock:
            segment = self._segments.pop(segment_id, None)
        if segment is not None:
            segment.close()

    def _segment(self, segment_id: str) -> Segment:
        # No lock: a dict lookup is atomic in CPython, and this is on every copy.
        segment = self._segments.get(segment_id)
        if segment is None:
            raise UnknownSegment(f"segment {segment_id!r} is not attached on this host")
        return segment

    def write(self, segment_id: str, offset: int, buffer: Any) -> int:
        """Copy ``buffer`` to ``offset`` of the segment; returns the bytes written."""
        return self._segment(segment_id).write(offset, buffer)

    def read_into(self, segment_id: str, offset: int, buffer: Any) -> int:
        """Fill ``buffer`` from ``offset`` of the segment; returns the bytes read."""
        return self._segment(segment_id).read_into(offset, buffer)

    def close(self) -> None:
        """Unmap every attached segment (never unlinks: the node owns them)."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
        for segment in segments:
            segment.close()

