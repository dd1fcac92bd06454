"""The SSD tier: objects as checksummed files under one directory, within a size limit.

Layout: ``<root>/<key[:2]>/<key>`` (a two-character fan-out keeps directories small),
temporary files in ``<root>/.tmp/``.  Each file is a 24-byte header then the value::

    "KVS2" | value length u64 | xxh3_64(value) u64 | crc32(the 20 bytes before) u32 | value

The value's checksum is the pool's own end-to-end checksum
(:func:`kvpool.storage.checksum.checksum`, xxh3-64: the one the index keeps per object and
readers verify), so a tier left by a previous process can be
re-announced to the master from its headers alone (:meth:`SsdStore.scan`): a 100 GiB tier
costs one small read per file at start-up, never a pass over every value.  The header has
its own CRC, so a flipped bit in it is caught by that scan (the file is dropped, never
announced with a wrong length or checksum).  Files of any other format (``KVS1``, which
kept only a CRC32 of the value) fail the check and are deleted: a miss, never wrong data.

Rules:

- A write is atomic: the file is written under ``.tmp`` and renamed into place with
  ``os.replace``, so a reader sees the old object, the new one, or none -- never half.
  There is no ``fsync`` (this is a cache): after a power loss a renamed file may hold
  garbage, which the checksums turn into a miss on its first read (or its scan).
- A read checks the header (magic, CRC, length against the file size) and the value's
  xxh3; a missing file is :class:`~kvpool.errors.ObjectNotFound`, a truncated or
  corrupted one is :class:`~kvpool.errors.ChecksumMismatch` (a miss, and the file is
  deleted so its space comes back).  Wrong bytes are never returned as a success.
- The total of all file sizes (headers included) never exceeds ``limit_bytes``; a write
  that would is refused with :class:`~kvpool.errors.NoSpace`.  A failing disk (ENOSPC,
  EIO, quota) is also ``NoSpace``, counted, and leaves no file behind.
- An unusable root (not creatable, not a directory, not writable) is a
  :class:`~kvpool.errors.ConfigError` from :meth:`SsdStore.open`, at start-up.
- Thread-safe: accounting is under a lock; file I/O runs outside it.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import struct
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvpool.errors import ChecksumMismatch, ConfigError, NoSpace, ObjectNotFound
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.storage.checksum import checksum

__all__ = ["HEADER_SIZE", "SsdScan", "SsdStats", "SsdStore"]

_FIELDS = struct.Struct("!4sQQ")  # magic, value length, xxh3_64 of the value
_CRC = struct.Struct("!I")  # crc32 of the fields: the header checks itself
HEADER_SIZE = _FIELDS.size + _CRC.size
_MAGIC = b"KVS2"
_KEY = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}$")
_TMP = ".tmp"


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


class _BadHeader(Exception):
    """A header that cannot be trusted (internal: becomes a miss or a dropped file)."""


def _pack_header(length: int, value_checksum: int) -> bytes:
    fields = _FIELDS.pack(_MAGIC, length, value_checksum)
    return fields + _CRC.pack(zlib.crc32(fields))


def _parse_header(raw: bytes, file_size: int) -> tuple[int, int]:
    """(value length, value checksum) of a header, checked against itself and the file."""
    if len(raw) < HEADER_SIZE:
        raise _BadHeader("file shorter than its header")
    fields = raw[: _FIELDS.size]
    magic, length, value_checksum = _FIELDS.unpack(fields)
    if magic != _MAGIC:
        raise _BadHeader(f"bad magic {magic!r}")
    if _CRC.unpack(raw[_FIELDS.size : HEADER_SIZE])[0] != zlib.crc32(fields):
        raise _BadHeader("header checksum mismatch")
    if file_size != HEADER_SIZE + length:
        raise _BadHeader(f"{file_size - HEADER_SIZE} bytes on disk, {length} written")
    return int(length), int(value_checksum)


def _read_header(path: Path) -> tuple[bytes, os.stat_result]:
    """The first bytes of a file and its stat, with raw calls (no buffered file object:
    a scan does this once per object)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, HEADER_SIZE), os.fstat(fd)
    finally:
        os.close(fd)


def _check_key(key: str) -> None:
    if not _KEY.match(key):
        raise ValueError(f"invalid SSD object key {key!r}: use 1-200 of [A-Za-z0-9._-]")


class SsdStore:
    """Size-capped, checksummed object files.  Build with :meth:`open`."""

    def __init__(self, root: Path, limit_bytes: int, sizes: dict[str, int]) -> None:
        self.root = root
        self.limit_bytes = limit_bytes
        self.stats = SsdStats()
        self._sizes = sizes  # key -> file size on disk (header included)
        self._reserved = 0  # bytes promised to writes in flight
        self._used = sum(sizes.values())
        self._lock = threading.Lock()

    @classmethod
    def open(cls, root: str | os.PathLike[str], limit_bytes: int) -> SsdStore:
        """Open (creating if needed) the tier at ``root``; index what is already there.

        Objects left by a previous run are kept and counted against the limit (only
        listed here: :meth:`scan` checks their headers, reads check their values); stale
        temporary files are removed.
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
        for sub in path.iterdir():
            if sub.name == _TMP or not sub.is_dir():
                continue
            for entry in sub.iterdir():
                if _KEY.match(entry.name) and entry.is_file():
                    sizes[entry.name] = entry.stat().st_size
        return cls(path, limit_bytes, sizes)

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
        """Keys present (listed, not checked: :meth:`scan` checks them)."""
        with self._lock:
            return list(self._sizes)

    def value_size(self, key: str) -> int:
        """The value's length in bytes, from the index (no disk access)."""
        with self._lock:
            if key not in self._sizes:
                raise ObjectNotFound(f"{key} is not on SSD")
            return self._sizes[key] - HEADER_SIZE

    def _path(self, key: str) -> Path:
        _check_key(key)
        return self.root / key[:2] / key

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
        need = HEADER_SIZE + len(src)
        with self._lock:
            old = self._sizes.get(key, 0)
            if self._used + self._reserved - old + need > self.limit_bytes:
                self.stats.rejected_full += 1
                raise NoSpace(
                    f"SSD tier full: {need} bytes for {key} do not fit "
                    f"({self._used + self._reserved} of {self.limit_bytes} bytes used)"
                )
            self._reserved += need
        tmp = self.root / _TMP / f"{key}.{secrets.token_hex(4)}"
        try:
            header = _pack_header(len(src), digest)
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
            raw = f.read(HEADER_SIZE)
            st = os.fstat(f.fileno())
            inode = st.st_ino
            try:
                length, value_checksum = _parse_header(raw, st.st_size)
            except _BadHeader as exc:
                self._corrupt(key, path, inode, str(exc))
            if len(dst) < length:
                raise ValueError(f"buffer of {len(dst)} bytes is too small for {key} ({length})")
            target = dst[:length]
            got = 0
            while got < length:
                n = f.readinto(target[got:])
                if not n:
                    self._corrupt(key, path, inode, "file shrank while reading")
                got += n
        if checksum(target) != value_checksum:
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

        Reads :data:`HEADER_SIZE` bytes per file, never a value: this is what a process
        re-announces to a master that does not know the tier (a restarted master, or a
        restarted owner).  A file whose header fails its check is deleted and counted,
        so it is never announced; a value corrupted behind an intact header is caught by
        its checksum on the first read.  Oldest first, so that announcing in this order
        leaves the index's recency order close to the files' ages.
        """
        found: list[tuple[int, str, int, int]] = []
        dropped = dropped_bytes = 0
        for key in self.keys():
            path = self._path(key)
            try:
                raw, st = _read_header(path)
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
                length, value_checksum = _parse_header(raw, st.st_size)
            except _BadHeader:
                dropped += 1
                dropped_bytes += st.st_size
                with self._lock:
                    self.stats.bad_headers += 1
                self._discard(key, path, st.st_ino)
                continue
            found.append((st.st_mtime_ns, key, length, value_checksum))
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
