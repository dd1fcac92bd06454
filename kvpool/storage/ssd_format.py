"""The on-disk format of one SSD-tier object: its file name and its self-checked header.

Any key is stored: the file is named by a hash of the key and keeps the key in its header::

    <root>/<name[:2]>/<name>        name = hex BLAKE2b-128 of the key's UTF-8 bytes

    "KVS3" | key length u32 | value length u64 | xxh3_64(value) u64
           | crc32(the 24 bytes before, then the key) u32 | key (UTF-8) | value
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import zlib
from pathlib import Path

__all__ = [
    "FIXED_HEADER_SIZE",
    "BadHeader",
    "Header",
    "file_name",
    "header_size",
    "is_file_name",
    "object_path",
    "pack_header",
    "parse_header",
    "read_header",
]

# Any key a client may put is stored (``a/b``, ``model@tp:0``, unicode, ``..``, 10,000
# characters): the file is named by a hash of the key, never by the key, and the key itself
# is kept in the file's header, so a restarted process gives back the original keys from
# its files alone.
# (The two-character fan-out of the layout keeps directories small.)
#
# The header checks itself (its CRC covers the fields and the key), so a flipped bit in a
# length, a checksum or the key is caught before anything is trusted.  Files of any other
# format (``KVS2`` files were named by their key and kept no key; ``KVS1`` kept only a CRC32
# of the value) fail the check and are dropped once by the tier's scan: a miss, never wrong
# data.
_FIELDS = struct.Struct("!4sIQQ")  # magic, key length, value length, xxh3_64 of the value
_CRC = struct.Struct("!I")  # crc32 of the fields and the key: the header checks itself
FIXED_HEADER_SIZE = _FIELDS.size + _CRC.size
_MAGIC = b"KVS3"
_NAME = re.compile(r"^[0-9a-f]{32}$")
# a scan reads this much of each file at once: the whole header of any usual key
_FIRST_READ = 4096


class BadHeader(Exception):
    """A header that cannot be trusted (becomes a miss, or a file dropped by a scan)."""


def _key_bytes(key: str) -> bytes:
    # surrogatepass: a Python str may hold lone surrogates; every str has one byte form
    return key.encode("utf-8", "surrogatepass")


def file_name(key: str) -> str:
    """The file name of ``key``: 32 hex digits, whatever characters the key holds."""
    return hashlib.blake2b(_key_bytes(key), digest_size=16).hexdigest()


def is_file_name(name: str) -> bool:
    return _NAME.match(name) is not None


def object_path(root: Path, key: str) -> Path:
    """Where ``key``'s file lies under the tier's ``root``."""
    name = file_name(key)
    return root / name[:2] / name


def header_size(key: str) -> int:
    """Bytes of ``key``'s header on disk (the file is this plus the value)."""
    return FIXED_HEADER_SIZE + len(_key_bytes(key))


class Header:
    """A parsed, checked header."""

    __slots__ = ("checksum", "key", "length", "size")

    def __init__(self, key: str, length: int, checksum: int, size: int) -> None:
        self.key = key
        self.length = length  # the value's bytes
        self.checksum = checksum  # xxh3_64 of the value
        self.size = size  # the header's own bytes


def pack_header(key: str, length: int, value_checksum: int) -> bytes:
    raw_key = _key_bytes(key)
    fields = _FIELDS.pack(_MAGIC, len(raw_key), length, value_checksum)
    return fields + _CRC.pack(zlib.crc32(raw_key, zlib.crc32(fields))) + raw_key


def _fields(raw: bytes) -> tuple[int, int, int]:
    """(key length, value length, value checksum) of a header's fixed part, unchecked."""
    if len(raw) < FIXED_HEADER_SIZE:
        raise BadHeader("file shorter than its header")
    magic, key_length, length, value_checksum = _FIELDS.unpack(raw[: _FIELDS.size])
    if magic != _MAGIC:
        raise BadHeader(f"bad magic {magic!r}")
    return int(key_length), int(length), int(value_checksum)


def parse_header(raw: bytes, file_size: int) -> Header:
    """The header at the start of ``raw`` (at least the whole header), checked against
    itself and the file's size."""
    key_length, length, value_checksum = _fields(raw)
    size = FIXED_HEADER_SIZE + key_length
    if len(raw) < size or file_size < size:
        raise BadHeader("file shorter than its header")
    (crc,) = _CRC.unpack(raw[_FIELDS.size : FIXED_HEADER_SIZE])
    raw_key = raw[FIXED_HEADER_SIZE:size]
    if crc != zlib.crc32(raw_key, zlib.crc32(raw[: _FIELDS.size])):
        raise BadHeader("header checksum mismatch")
    if file_size != size + length:
        raise BadHeader(f"{file_size - size} bytes on disk, {length} written")
    return Header(raw_key.decode("utf-8", "surrogatepass"), length, value_checksum, size)


def read_header(path: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of a file's header (or of its start, when the header is bad) and its
    stat, with raw calls (no buffered file object: a scan does this once per object)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        raw = os.read(fd, _FIRST_READ)
        st = os.fstat(fd)
        try:
            key_length = _fields(raw)[0]
        except BadHeader:
            return raw, st
        need = min(FIXED_HEADER_SIZE + key_length, st.st_size)
        while len(raw) < need:  # a long key
            more = os.read(fd, need - len(raw))
            if not more:
                break
            raw += more
        return raw, st
    finally:
        os.close(fd)
