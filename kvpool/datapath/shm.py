"""The same-host path: copy straight to and from a node's shared-memory segment.

A client on the node's host attaches the segment by name and copies with memoryview/NumPy,
which releases the GIL for large copies: no socket, no kernel copy, no node thread.
:class:`ShmConnection` has the TCP connection's calls, so callers do not care which they hold.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

from kvpool.closing import Closing
from kvpool.errors import TransferError, UnknownSegment
from kvpool.storage.segment import SHM_DIR, Segment, owner_alive

__all__ = ["ShmConnection", "host_token", "remove_if_owner_dead"]

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


def _unlink_if_same(path: Path, fd: int) -> bool:
    """Unlink ``path`` if it is still the file open as ``fd`` (a new owner's segment of
    the same name is another file, and is left alone)."""
    try:
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return False
        path.unlink()
    except OSError:
        return False
    return True


def _same_file(fd_a: int, fd_b: int) -> bool:
    """Whether two open descriptors are the same file (not just the same name)."""
    if fd_a < 0 or fd_b < 0:
        return False
    try:
        a, b = os.fstat(fd_a), os.fstat(fd_b)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def remove_if_owner_dead(shm_name: str, token: str, directory: Path = SHM_DIR) -> bool:
    """Remove the segment file ``shm_name`` of the host ``token`` names, if that is this
    host and the segment's owner is dead; True if it was removed.

    The master calls it for each owner it drops, so a SIGKILLed node's memory goes back
    to the host even when no client touches the segment again.  A live owner's file (a
    node that was only slow) and another host's are never touched.
    """
    if not shm_name or "/" in shm_name or shm_name in {".", ".."}:
        return False
    try:
        if token != host_token(directory):
            return False
    except OSError:
        return False
    try:
        fd = os.open(Path(directory) / shm_name, os.O_RDONLY)
    except OSError:
        return False
    try:
        return not owner_alive(fd) and _unlink_if_same(Path(directory) / shm_name, fd)
    finally:
        os.close(fd)


# A segment's owner can die while its memory stays mapped here (SIGKILL leaves the file in
# ``/dev/shm``, and every copy into it still "works").  So each copy ends by asking whether
# the owner still holds its lock (:func:`~kvpool.storage.segment.owner_alive`, one system
# call): bytes written into a dead owner's segment are never acknowledged, and bytes read
# from it are not served.  The connection then unmaps the segment, removes its file (its
# owner will never do it) and raises :class:`~kvpool.errors.TransferError`, which the
# client reports like any failed transfer.
class ShmConnection(Closing):
    """Reads and writes of segments attached on this host, by segment id."""

    def __init__(self, directory: Path = SHM_DIR) -> None:
        self.directory = Path(directory)
        self._segments: dict[str, Segment] = {}
        self._owner_fds: dict[str, int] = {}  # segment id -> its file, to ask its owner
        self._lock = threading.Lock()

    def attach(self, segment_id: str, shm_name: str, size: int | None = None) -> None:
        """Map ``shm_name`` for ``segment_id``; with ``size``, check it is the right one.

        Every page is mapped in a background thread (see :meth:`Segment.attach`): ~0.2 s
        per GiB, once per process and segment, instead of a page fault per 4 KiB on later
        copies.  Not in the caller: the first read of a fresh process would wait for the
        whole segment (0.12 s for 512 MiB) where it needs a few MiB.  Raises
        :class:`~kvpool.errors.PoolError` when the name does not exist here.
        """
        segment = Segment.attach(shm_name, directory=self.directory, populate=False)
        segment.warm_in_background()
        if size is not None and segment.size != size:
            segment.close()
            raise UnknownSegment(
                f"shared memory {shm_name!r} has {segment.size} bytes, segment "
                f"{segment_id!r} has {size}: not the same segment"
            )
        try:
            fd = os.open(segment.path, os.O_RDONLY)
        except OSError as exc:
            segment.close()
            raise UnknownSegment(f"shared memory {shm_name!r} is gone: {exc}") from None
        drop: Segment | None
        with self._lock:
            current = self._segments.get(segment_id)
            if (
                current is not None
                and current.name == segment.name
                and _same_file(self._owner_fds.get(segment_id, -1), fd)
            ):
                # Another thread attached the same file first (two copies routed at once):
                # keep its mapping, which copies may be using now, and drop this one.
                drop, drop_fd = segment, fd
            else:
                drop = self._segments.pop(segment_id, None)
                drop_fd = self._owner_fds.pop(segment_id, -1)
                self._segments[segment_id] = segment
                self._owner_fds[segment_id] = fd
            # The fd is closed under the lock: check_owner asks it under the same lock, so
            # a copy never asks a closed (or reused) descriptor.
            if drop_fd >= 0:
                os.close(drop_fd)
        if drop is not None:
            drop.close()

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
            fd = self._owner_fds.pop(segment_id, -1)
            if fd >= 0:
                os.close(fd)
        if segment is not None:
            segment.close()

    def owner_alive(self, segment_id: str) -> bool:
        """Whether the process that owns the attached segment still lives."""
        with self._lock:
            fd = self._owner_fds.get(segment_id, -1)
            return fd >= 0 and owner_alive(fd)

    def check_owner(self, segment_id: str) -> None:
        """Raise TransferError (after unmapping and removing the segment) if its owner
        died: what was just copied must not count as stored, nor as read."""
        # Under the lock: another thread's attach or detach closes descriptors under it
        # too, so this never asks a closed one (EBADF) or one reused for another file.
        with self._lock:
            fd = self._owner_fds.get(segment_id, -1)
            if fd < 0 or owner_alive(fd):
                return
            segment = self._segments.get(segment_id)
            if segment is not None:
                with contextlib.suppress(OSError):
                    _unlink_if_same(segment.path, fd)
        self.detach(segment_id)
        raise TransferError(f"the owner of segment {segment_id!r} is gone (its lock is free)")

    def _segment(self, segment_id: str) -> Segment:
        # No lock: a dict lookup is atomic in CPython, and this is on every copy.
        segment = self._segments.get(segment_id)
        if segment is None:
            raise UnknownSegment(f"segment {segment_id!r} is not attached on this host")
        return segment

    def write(self, segment_id: str, offset: int, buffer: Any, *, check: bool = True) -> int:
        """Copy ``buffer`` to ``offset`` of the segment; returns the bytes written.
        TransferError if the segment's owner is dead (the bytes are not stored).  A batch
        passes ``check=False`` and calls :meth:`check_owner` once after its copies."""
        written = self._segment(segment_id).write(offset, buffer)
        if check:
            self.check_owner(segment_id)
        return written

    def read_into(self, segment_id: str, offset: int, buffer: Any, *, check: bool = True) -> int:
        """Fill ``buffer`` from ``offset`` of the segment; returns the bytes read.
        TransferError if the segment's owner is dead (the bytes are not served);
        ``check`` as in :meth:`write`."""
        read = self._segment(segment_id).read_into(offset, buffer)
        if check:
            self.check_owner(segment_id)
        return read

    def close(self) -> None:
        """Unmap every attached segment (never unlinks: the node owns them)."""
        with self._lock:
            segments = list(self._segments.values())
            fds = list(self._owner_fds.values())
            self._segments.clear()
            self._owner_fds.clear()
            for fd in fds:
                os.close(fd)
        for segment in segments:
            segment.close()
