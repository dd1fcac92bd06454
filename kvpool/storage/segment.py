"""A memory segment in POSIX shared memory that other local processes can attach.

A file under ``/dev/shm`` mapped with :mod:`mmap`, opened here rather than with
``multiprocessing.shared_memory``: on Python 3.11 every ``SharedMemory`` (even an attach)
registers with the ``resource_tracker``, which unlinks the block when *any* attaching
process exits; wrong for a segment owned by one node.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import time
import weakref
from pathlib import Path
from typing import Any

from kvpool.closing import Closing
from kvpool.errors import ConfigError, NoSpace, PoolError
from kvpool.storage.buffers import byte_view, copy_bytes, writable_byte_view
from kvpool.storage.pages import Warmer, Warmth, populate

__all__ = [
    "SHM_DIR",
    "Segment",
    "check_range",
    "owner_alive",
    "pid_alive",
    "populate",
    "remove_stale_segments",
]

log = logging.getLogger("kvpool.segment")

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
# Default names carry the creator's pid, so leftovers of a killed process can be found.
_DEFAULT_NAME = re.compile(r"^kvpool-(\d+)-[0-9a-f]{12}$")


# - Pages are populated up front (:mod:`kvpool.storage.pages`): in the owner at creation
#   or soon after (:meth:`Segment.warm_in_background`), and in every process that
#   attaches (in the background there: a reader's first copy must not wait for a whole
#   segment's pages, kvpool.datapath.shm).  A first write to a page otherwise costs a
#   page fault in *each* process that touches it: a 1 MiB copy into untouched pages took
#   ~9x one into pages written before.  ``posix_fallocate`` already committed the
#   memory; populating adds the page tables (2 MiB per GiB per process) and moves the
#   zeroing to start-up.
_populate = populate  # create()/attach() take a ``populate`` flag that shadows it


def check_range(offset: int, length: int, size: int, what: str = "segment") -> None:
    """Raise :class:`PoolError` unless ``[offset, offset + length)`` lies inside ``size``."""
    if offset < 0 or length < 0 or offset + length > size:
        raise PoolError(
            f"access of {length} bytes at offset {offset} is outside {what} of {size} bytes"
        )


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink default-named segments whose creating process is gone; return their names.

    A node killed with SIGKILL never runs :meth:`Segment.close`, so its segment would
    hold memory until reboot.  A node calls this at start-up.  Only names made by
    :meth:`Segment.create` without an explicit name (``kvpool-<pid>-<hex>``) are
    considered.  The owner's ``flock`` says whether it lives, not the pid in the name: a
    process in another PID namespace names its segment by a pid that means another
    process (or none) here.
    """
    removed: list[str] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _DEFAULT_NAME.match(entry.name)
        if match and _abandoned(entry, int(match.group(1))):
            try:
                entry.unlink()
            except OSError:
                continue
            removed.append(entry.name)
    return removed


def _unlink_owned(path: Path, creator: int) -> None:
    """A collected or exiting owner's name goes; a forked child's exit leaves it."""
    if os.getpid() == creator:
        with contextlib.suppress(OSError):
            path.unlink()


def _abandoned(path: Path, pid: int) -> bool:
    """No process holds the segment's lock, and it is not one being created right now
    (between ``open`` and ``flock`` in :meth:`Segment.create`: its pid lives and the
    file is new)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if owner_alive(fd):
            return False
        if not pid_alive(pid):
            return True
        return time.time() - os.fstat(fd).st_mtime > _CREATE_GRACE_S
    finally:
        os.close(fd)


_CREATE_GRACE_S = 5.0


# - The owner holds an exclusive ``flock`` on its file for as long as it lives; the kernel
#   drops it when the owner dies, however it dies.  So another process tells a live owner
#   from a dead one with one non-blocking ``flock`` (:func:`owner_alive`): a same-host
#   writer asks before it acknowledges bytes written into the segment.
def owner_alive(fd: int) -> bool:
    """Whether the owner of the segment file open as ``fd`` still lives (holds its lock).

    A shared lock is refused exactly while the owner holds its exclusive one; taken, it is
    dropped at once (many processes may ask together: shared locks never exclude each
    other).  One system call, no I/O.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _check_name(name: str) -> None:
    if not _NAME.match(name) or name in {".", ".."}:
        raise ValueError(f"invalid segment name {name!r}: use 1-200 of [A-Za-z0-9._-]")


# Rules:
#
# - The creator owns the name: :meth:`Segment.close` on the owner unlinks it; an
#   attached segment only unmaps.  A name that already exists is refused (``O_EXCL``),
#   so two nodes never share a segment by accident.
# - Space is reserved at creation (``posix_fallocate``): a full ``/dev/shm`` is a clear
#   :class:`~kvpool.errors.NoSpace` at start-up, never a SIGBUS on a later write.
# - Every access is bounds-checked; an out-of-range access raises
#   :class:`~kvpool.errors.PoolError` and touches nothing.
# - Files are mode 0600: only processes of the same user can attach.
class Segment(Closing):
    """A fixed-size byte region in shared memory, addressed by ``(offset, length)``.

    Build one with :meth:`create` (owner) or :meth:`attach` (another local process).
    """

    def __init__(
        self,
        name: str,
        path: Path,
        mapping: mmap.mmap,
        *,
        owner: bool,
        lock_fd: int = -1,
        warmed: bool = False,
    ) -> None:
        """``warmed``: every page was populated already (``populate=True``)."""
        self.name = name
        self.path = path
        self.size = len(mapping)
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)
        self._lock_fd = lock_fd  # the owner's open file, holding its flock while it lives
        self._warmer: Warmer | None = None  # populating in the background, or done
        size = self.size
        self._warmth = Warmth("warm", size, size) if warmed else Warmth("off", 0, size)
        # an owner that is collected or exits without close() still unlinks its name (not
        # on SIGKILL: then the next node's remove_stale_segments does)
        self._at_exit = weakref.finalize(self, _unlink_owned, path, os.getpid()) if owner else None

    @classmethod
    def create(
        cls,
        size: int,
        name: str | None = None,
        *,
        directory: Path = SHM_DIR,
        populate: bool = True,
    ) -> Segment:
        """Create and own a new segment of ``size`` bytes (zero-filled).

        ``populate`` maps every page now (see :func:`populate`): ~0.3 s per GiB here.
        """
        if size <= 0:
            raise ConfigError(f"segment size must be positive, got {size}")
        name = name or f"kvpool-{os.getpid()}-{secrets.token_hex(6)}"
        _check_name(name)
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise ConfigError(f"shared-memory segment {name!r} already exists at {path}") from None
        except OSError as exc:
            raise ConfigError(f"cannot create shared-memory segment at {path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours alone: just created
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise NoSpace(
                    f"cannot reserve {size} bytes in {directory} for segment {name!r}: {exc}"
                ) from None
            mapping = mmap.mmap(fd, size)
            try:
                if populate:
                    _populate(mapping, owner=True)
            except BaseException:
                mapping.close()
                raise
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        # the mapping keeps the memory; the fd keeps the flock that says we are alive
        return cls(name, path, mapping, owner=True, lock_fd=fd, warmed=populate)

    @classmethod
    def attach(cls, name: str, *, directory: Path = SHM_DIR, populate: bool = True) -> Segment:
        """Map an existing segment created by another process on this host.

        ``populate`` maps every page now (~0.2 s per GiB here), so no copy later pays a
        page fault per 4 KiB; it never changes the segment's content.
        """
        _check_name(name)
        path = Path(directory) / name
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PoolError(f"no shared-memory segment named {name!r} on this host") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise PoolError(f"shared-memory segment {name!r} is empty")
            mapping = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        if populate:
            _populate(mapping, owner=False)
        return cls(name, path, mapping, owner=False, warmed=populate)

    @property
    def warmth(self) -> Warmth:
        """How far this mapping's pages are faulted in."""
        return self._warmer.warmth if self._warmer is not None else self._warmth

    def warm_in_background(self) -> None:
        """Populate the pages in a thread of their own (a segment made with
        ``populate=False``); :meth:`close` stops it.  A no-op when warm or warming."""
        if self._mmap is None:
            raise PoolError(f"segment {self.name!r} is closed")
        if self._warmer is None and self._warmth.state != "warm":
            self._warmer = Warmer(self._mmap, self.name)
            self._warmer.start()

    @property
    def closed(self) -> bool:
        return self._view is None

    def _whole(self) -> memoryview:
        if self._view is None:
            raise PoolError(f"segment {self.name!r} is closed")
        return self._view

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of ``[offset, offset + length)``, aliasing the segment.

        For in-place I/O (``sock.recv_into(segment.view(...))``).  Release it (or let it
        go) before :meth:`close`, or the mapping stays alive until it is collected.
        """
        whole = self._whole()
        check_range(offset, length, self.size, f"segment {self.name!r}")
        return whole[offset : offset + length]

    def write(self, offset: int, data: Any) -> int:
        """Copy a buffer (bytes-like, NumPy array, CPU tensor) in at ``offset``."""
        src = byte_view(data)
        copy_bytes(self.view(offset, len(src)), src)
        return len(src)

    def read_into(self, offset: int, buffer: Any) -> int:
        """Fill a writable buffer from ``offset``; returns the bytes copied (its size)."""
        dst = writable_byte_view(buffer)
        copy_bytes(dst, self.view(offset, len(dst)))
        return len(dst)

    def read(self, offset: int, length: int) -> bytes:
        """A copy of ``[offset, offset + length)``."""
        return bytes(self.view(offset, length))

    def close(self) -> None:
        """Unmap, and unlink the name if this process created it.  Idempotent."""
        if self._view is None:
            return
        if self._warmer is not None:
            self._warmer.stop()  # before the unmap: it works on the mapping's addresses
        self._view.release()
        self._view = None
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            # A caller still holding a view() keeps the pages mapped; they are unmapped
            # when that view is collected.  The name is unlinked regardless.
            with contextlib.suppress(BufferError):
                mapping.close()
        if self._at_exit is not None:
            self._at_exit.detach()
        if self.owner:
            self.path.unlink(missing_ok=True)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # after the unlink: no one sees a lockless live name
            self._lock_fd = -1

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("owner" if self.owner else "attached")
        return f"Segment(name={self.name!r}, size={self.size}, {state})"
