"""The SSD tier: objects as checksummed files under one directory, within a size limit.

Files keep their key and checksum in a self-checked header, so a tier left by a previous
process can be re-announced to the master from its headers alone.  A bad file is a miss,
never wrong data.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvpool.errors import ChecksumMismatch, ConfigError, NoSpace, ObjectNotFound
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.storage.checksum import checksum
from kvpool.storage.ssd_format import (
    BadHeader,
    header_size,
    object_path,
    pack_header,
    parse_header,
    read_header,
)

__all__ = ["SsdScan", "SsdStats", "SsdStore", "files_by_key", "header_size", "object_path"]

_TMP = ".tmp"


def files_by_key(root: str | os.PathLike[str]) -> dict[str, Path]:
    """The intact object files under a tier's ``root``, by the key their header keeps.

    Read-only (one header read per file; nothing is deleted or created), so it may look
    at a tier another process is using: tests, and operators asking what a tier holds.
    """
    found: dict[str, Path] = {}
    base = Path(root)
    for path in base.glob("*/*"):
        if path.parent.name == _TMP:
            continue
        try:
            raw, st = read_header(path)
            key = parse_header(raw, st.st_size).key
        except (OSError, BadHeader):
            continue
        if path == object_path(base, key):
            found[key] = path
    return found


@dataclass
class SsdStats:
    """Counters since :meth:`SsdStore.open` (monotonic, for metrics)."""

    writes: int = 0
    write_bytes: int = 0
    reads: int = 0
    read_bytes: int = 0
    misses: int = 0
    corruptions: int = 0
    rejected_full: int = 0
    write_failures: int = 0
    bad_headers: int = 0  # files a scan found unreadable or corrupt, and deleted


@dataclass(frozen=True)
class SsdScan:
    """What :meth:`SsdStore.scan` found: intact objects (oldest first) and what it dropped."""

    entries: list[tuple[str, int, int]]  # key, value length, xxh3_64 of the value
    dropped: int = 0
    dropped_bytes: int = 0

    @property
    def value_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries)


# Any key is stored: files are named by a hash of the key and keep the key in their
# self-checked header (:mod:`kvpool.storage.ssd_format` has the layout); temporary files
# are in ``<root>/.tmp/``.  The value's checksum in the header is the pool's own end-to-end
# checksum (:func:`kvpool.storage.checksum.checksum`, xxh3-64: the one the index keeps per
# object and readers verify), so a tier left by a previous process can be re-announced to
# the master from its headers alone (:meth:`SsdStore.scan`), original keys included: a
# 100 GiB tier costs two small reads per file at start-up (:meth:`SsdStore.open` learns the
# keys, the scan checks what it announces), never a pass over every value.  A flipped bit
# in a header is caught by its CRC (the file is dropped, never announced with a wrong key,
# length or checksum); files of an older format fail the check and are dropped the same
# way: a miss, never wrong data.
#
# Rules:
#
# - A write is atomic: the file is written under ``.tmp`` and renamed into place with
#   ``os.replace``, so a reader sees the old object, the new one, or none -- never half.
#   There is no ``fsync`` (this is a cache): after a power loss a renamed file may hold
#   garbage, which the checksums turn into a miss on its first read (or its scan).
# - A read checks the header (magic, CRC, the key, length against the file size) and the
#   value's xxh3; a missing file is :class:`~kvpool.errors.ObjectNotFound`, a truncated or
#   corrupted one is :class:`~kvpool.errors.ChecksumMismatch` (a miss, and the file is
#   deleted so its space comes back).  Wrong bytes are never returned as a success.
# - The total of all file sizes (headers included) never exceeds ``limit_bytes``; a write
#   that would is refused with :class:`~kvpool.errors.NoSpace`.  A failing disk (ENOSPC,
#   EIO, quota) is also ``NoSpace``, counted, and leaves no file behind.
# - An unusable root (not creatable, not a directory, not writable) is a
#   :class:`~kvpool.errors.ConfigError` from :meth:`SsdStore.open`, at start-up.
# - An object's error is its own: a bad file is a miss of that key only, and no key is
#   refused for its characters.
# - Thread-safe: accounting is under a lock; file I/O runs outside it.
class SsdStore:
    """Size-capped, checksummed object files.  Build with :meth:`open`."""

    def __init__(
        self,
        root: Path,
        limit_bytes: int,
        sizes: dict[str, int],
        strays: dict[Path, tuple[int, int]] | None = None,
    ) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.stats = SsdStats()
        self._sizes = sizes  # key -> file size on disk (header included)
        # files whose header :meth:`open` could not trust (corrupt, an older format, in
        # the wrong place): path -> (size, inode).  Counted against the limit until the
        # scan deletes them.
        self._strays = strays or {}
        self._reserved = 0  # bytes promised to writes in flight
        self._used = sum(sizes.values()) + sum(size for size, _ in self._strays.values())
        self._lock = threading.Lock()

    @classmethod
    def open(cls, root: str | os.PathLike[str], limit_bytes: int) -> SsdStore:
        """Open (creating if needed) the tier at ``root``; index what is already there.

        Objects left by a previous run are kept and counted against the limit: their
        keys come from their headers (one small read each; the values are checked on
        read).  Files whose header cannot be trusted are counted too, and deleted by
        :meth:`scan`.  Stale temporary files are removed.
        """
        path = Path(root)
        if limit_bytes <= 0:
            raise ConfigError(f"SSD size limit must be positive, got {limit_bytes} bytes")
        try:
            path.mkdir(parents=True, exist_ok=True)
            (path / _TMP).mkdir(exist_ok=True)
            probe = path / _TMP / f"probe-{secrets.token_hex(4)}"
            probe.write_bytes(b"kvpool")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"ssd_offload_path {str(path)!r} is not a writable directory ({exc}); "
                "point it at a directory this user can write, or disable SSD offload"
            ) from None
        for stale in (path / _TMP).iterdir():
            with contextlib.suppress(OSError):
                stale.unlink()
        sizes: dict[str, int] = {}
        strays: dict[Path, tuple[int, int]] = {}
        for sub in path.iterdir():
            if sub.name == _TMP or not sub.is_dir():
                continue
            for entry in sub.iterdir():
                try:
                    raw, st = read_header(entry)
                except OSError:
                    continue  # not a readable file (a directory, gone): not the tier's
                try:
                    key = parse_header(raw, st.st_size).key
                except BadHeader:
                    strays[entry] = (st.st_size, st.st_ino)
                    continue
                if entry != object_path(path, key):
                    strays[entry] = (st.st_size, st.st_ino)  # intact, but not where it goes
                    continue
                sizes[key] = st.st_size
        return cls(path, limit_bytes, sizes, strays)

    # -- accounting -------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes on disk (headers included), plus writes in flight."""
        with self._lock:
            return self._used + self._reserved

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._sizes

    def keys(self) -> list[str]:
        """Keys present (from their headers; :meth:`scan` checks them again)."""
        with self._lock:
            return list(self._sizes)

    def value_size(self, key: str) -> int:
        """The value's length in bytes, from the index (no disk access)."""
        with self._lock:
            if key not in self._sizes:
                raise ObjectNotFound(f"{key} is not on SSD")
            return self._sizes[key] - header_size(key)

    def _path(self, key: str) -> Path:
        return object_path(self.root, key)

    def _forget(self, key: str) -> None:
        with self._lock:
            self._used -= self._sizes.pop(key, 0)

    # -- objects ----------------------------------------------------------------

    def put(self, key: str, data: Any, expect: int | None = None) -> None:
        """Store ``data`` (any buffer) under ``key``, replacing an older value atomically.

        ``expect`` is the xxh3-64 the bytes must still have (a demotion copies an object
        the index knows by its checksum, and a write may have overtaken it): when they do
        not, :class:`~kvpool.errors.ChecksumMismatch` and nothing is written.  The value
        is hashed once, for this check and the file's header alike.
        """
        final = self._path(key)
        src = byte_view(data)
        digest = checksum(src)
        if expect is not None and digest != expect:
            raise ChecksumMismatch(f"{key}: its bytes no longer match their checksum")
        header = pack_header(key, len(src), digest)
        need = len(header) + len(src)
        with self._lock:
            old = self._sizes.get(key, 0)
            if self._used + self._reserved - old + need > self.limit_bytes:
                self.stats.rejected_full += 1
                raise NoSpace(
                    f"SSD tier full: {need} bytes for {key} do not fit "
                    f"({self._used + self._reserved} of {self.limit_bytes} bytes used)"
                )
            self._reserved += need
        tmp = self.root / _TMP / f"{final.name}.{secrets.token_hex(4)}"
        try:
            final.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(src)
            os.replace(tmp, final)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._lock:
                self._reserved -= need
                self.stats.write_failures += 1
            raise NoSpace(f"SSD write of {key} failed: {exc}") from None
        with self._lock:
            self._reserved -= need
            self._used += need - self._sizes.get(key, 0)
            self._sizes[key] = need
            stray = self._strays.pop(final, None)
            if stray is not None:  # a bad file had this name: the rename replaced it
                self._used -= stray[0]
            self.stats.writes += 1
            self.stats.write_bytes += len(src)

    def read_into(self, key: str, buffer: Any) -> int:
        """Read ``key``'s value into the front of ``buffer``; returns its length.

        On :class:`ChecksumMismatch` the buffer may hold garbage: treat it as a miss.
        """
        dst = writable_byte_view(buffer)
        path = self._path(key)
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, and missing is a miss
        except FileNotFoundError:
            self._forget(key)
            with self._lock:
                self.stats.misses += 1
            raise ObjectNotFound(f"{key} is not on SSD") from None
        with f:
            raw = f.read(header_size(key))
            st = os.fstat(f.fileno())
            inode = st.st_ino
            try:
                header = parse_header(raw, st.st_size)
                if header.key != key:
                    raise BadHeader("the file holds another key")
            except BadHeader as exc:
                self._corrupt(key, path, inode, str(exc))
            length = header.length
            if len(dst) < length:
                raise ValueError(f"buffer of {len(dst)} bytes is too small for {key} ({length})")
            target = dst[:length]
            got = 0
            while got < length:
                n = f.readinto(target[got:])
                if not n:
                    self._corrupt(key, path, inode, "file shrank while reading")
                got += n
        if checksum(target) != header.checksum:
            self._corrupt(key, path, inode, "checksum mismatch")
        with self._lock:
            self.stats.reads += 1
            self.stats.read_bytes += length
        return length

    def get(self, key: str) -> bytes:
        """The value of ``key`` as ``bytes``."""
        try:
            size = self.value_size(key)
        except ObjectNotFound:
            with self._lock:
                self.stats.misses += 1
            raise
        buf = bytearray(size)
        n = self.read_into(key, buf)
        return bytes(buf[:n])

    def remove(self, key: str) -> bool:
        """Delete ``key``; ``False`` if it was not there."""
        path = self._path(key)
        self._forget(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        return True

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    # -- re-announcing ----------------------------------------------------------

    def scan(self) -> SsdScan:
        """Check the header of every object and list the intact ones, oldest first.

        Reads one header per file, never a value: this is what a process re-announces
        to a master that does not know the tier (a restarted master, or a restarted
        owner), with the keys the headers keep.  A file whose header fails its check is
        deleted and counted, so it is never announced (so are the files :meth:`open`
        could not trust); a value corrupted behind an intact header is caught by its
        checksum on the first read.  Oldest first, so that announcing in this order
        leaves the index's recency order close to the files' ages.
        """
        found: list[tuple[int, str, int, int]] = []
        dropped = dropped_bytes = 0
        for key in self.keys():
            path = self._path(key)
            try:
                raw, st = read_header(path)
            except FileNotFoundError:
                self._forget(key)
                continue
            except OSError:  # unreadable (EIO, permissions): no use to anyone
                raw = b""
                try:
                    st = path.stat()
                except OSError:
                    continue
            try:
                header = parse_header(raw, st.st_size)
                if header.key != key:
                    raise BadHeader("the file holds another key")
            except BadHeader:
                dropped += 1
                dropped_bytes += st.st_size
                with self._lock:
                    self.stats.bad_headers += 1
                self._discard(key, path, st.st_ino)
                continue
            found.append((st.st_mtime_ns, key, header.length, header.checksum))
        with self._lock:
            strays, self._strays = self._strays, {}
        for path, (size, inode) in strays.items():
            dropped += 1
            dropped_bytes += size
            with self._lock:
                self.stats.bad_headers += 1
                self._used -= size
            with contextlib.suppress(OSError):
                if path.stat().st_ino == inode:  # not replaced by a put since open()
                    path.unlink()
        found.sort()
        return SsdScan([(k, n, c) for _, k, n, c in found], dropped, dropped_bytes)

    def _discard(self, key: str, path: Path, inode: int) -> None:
        """Delete a bad file, but only if the name still points at the file that was
        checked: a concurrent put may already have replaced it with a good one."""
        with contextlib.suppress(OSError):
            if path.stat().st_ino == inode:
                self._forget(key)
                path.unlink()

    def _corrupt(self, key: str, path: Path, inode: int, why: str) -> NoReturn:
        """Count, delete the bad file (its space comes back), and raise the miss."""
        with self._lock:
            self.stats.corruptions += 1
        self._discard(key, path, inode)
        raise ChecksumMismatch(f"SSD object {key} is corrupt ({why}); treated as a miss")
