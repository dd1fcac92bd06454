"""What a client asks of a data path: a list of small frozen operations, run by one call,
``DataPath.run(ops) -> results``, for a single transfer and a batch alike (one result per
operation, in order); the rules every data path keeps are beside :class:`DataPath`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from kvpool.errors import KVPoolError
from kvpool.storage.buffers import byte_view, writable_byte_view

__all__ = [
    "DataOp",
    "DataPath",
    "OpResult",
    "ReadOp",
    "SsdReadOp",
    "WriteOp",
    "read",
    "read_checked",
    "read_into",
    "read_many_checked",
    "read_many_into",
    "sole_result",
    "ssd_read_into",
    "write",
    "write_many",
]


# WriteOp: `buffer` to `(segment_id, offset)`; with `key` (and its `checksum`) the owner
# notes the object for its catalog as the bytes land, where it can (a tagged write through
# its data server).  ReadOp: `(segment_id, offset)` into `buffer`; `checked`: the bytes'
# checksum comes back, computed as they land where the path can.  SsdReadOp: the object
# `key` of the owner's SSD tier into `buffer`.  `shm_name` is the segment's shared-memory
# name when the master's placement carries one; paths that do not use shared memory
# ignore it.
class WriteOp(msgspec.Struct, frozen=True):
    """Write ``buffer`` at ``offset`` of the segment (``key``: noted, see above)."""

    segment_id: str
    offset: int
    buffer: Any
    shm_name: str = ""
    key: str = ""
    checksum: int = 0


class ReadOp(msgspec.Struct, frozen=True):
    """Fill ``buffer`` from ``offset`` of the segment (``checked``: its checksum back;
    ``running``: a :func:`~kvpool.storage.checksum.hasher` shared by the reads of one
    object in parts, updated with this read's bytes once they landed)."""

    segment_id: str
    offset: int
    buffer: Any
    shm_name: str = ""
    checked: bool = False
    running: Any = None


class SsdReadOp(msgspec.Struct, frozen=True):
    """Fill ``buffer`` (exactly the object's size) from the owner's SSD tier
    (``segment_id``: the placement's, which carries a tenant's grant)."""

    key: str
    buffer: Any
    segment_id: str = ""


DataOp = WriteOp | ReadOp | SsdReadOp
#: one op's outcome: None (done), a checksum (checked read, noted write), or its error
OpResult = KVPoolError | int | None


def sole_result(results: Sequence[OpResult]) -> OpResult:
    """The only result of a one-op list, raised if it is an error: a single transfer
    fails the way its caller expects (as the exception), a batch item does not."""
    (result,) = results
    if isinstance(result, KVPoolError):
        raise result
    return result


# Rules every data path keeps:
# - One result per op, in order: None (done), an int (a checked read: the checksum of the
#   bytes that landed; a noted write: the checksum the owner noted), or the KVPoolError
#   that op failed with.
# - A failure that ends the whole list (the owner cannot be reached, the connection broke
#   or timed out mid-list) is raised instead (TransferError, PeerTimeout): none of the
#   list's results can be trusted then.
# - The ops of one list may move in any order and overlap; one that must follow another
#   goes in a later list.  Reads of one segment that share a ``running`` checksum update
#   it in list order (each path keeps a segment's reads in order), so its digest is the
#   one of their bytes end to end.
class DataPath(Protocol):
    """What a client needs from a connection to one storage owner: every data path, and
    a node's segment connection."""

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        """Move the ops' bytes: one result per op, a failure of the whole list raised
        (the rules above).  Each path keeps its fast way: over TCP a list's writes (or
        reads) go in pipelined ranged requests, a checked read is hashed as its bytes
        land and a noted write carries its tag; shared memory is copied into directly."""
        ...

    def close(self) -> None: ...


# One transfer of one shape, over any path's ``run`` (tests, benchmarks, tools): written
# once here rather than as methods of each path, so a path has one call to implement.

Item = tuple[str, int, Any]  # (segment_id, offset, buffer)


def write(path: DataPath, segment_id: str, offset: int, buffer: Any, **note: Any) -> int:
    """``buffer`` to ``(segment_id, offset)``; the bytes written.  ``note``: ``key`` and
    ``checksum``, as :class:`WriteOp`'s."""
    sole_result(path.run([WriteOp(segment_id, offset, buffer, **note)]))
    return len(byte_view(buffer))


def read_into(path: DataPath, segment_id: str, offset: int, buffer: Any) -> int:
    """Fill ``buffer`` from ``(segment_id, offset)``; the bytes read."""
    sole_result(path.run([ReadOp(segment_id, offset, buffer)]))
    return len(writable_byte_view(buffer))


def read(path: DataPath, segment_id: str, offset: int, length: int) -> bytes:
    """A copy of ``length`` bytes at ``(segment_id, offset)``."""
    buf = bytearray(length)
    read_into(path, segment_id, offset, buf)
    return bytes(buf)


def read_checked(path: DataPath, segment_id: str, offset: int, buffer: Any) -> int:
    """:func:`read_into`, returning the checksum of the bytes that landed."""
    digest = sole_result(path.run([ReadOp(segment_id, offset, buffer, checked=True)]))
    assert isinstance(digest, int)
    return digest


def ssd_read_into(path: DataPath, key: str, buffer: Any) -> int:
    """Fill ``buffer`` (exactly the object's size) from the owner's SSD tier."""
    sole_result(path.run([SsdReadOp(key, buffer)]))
    return len(writable_byte_view(buffer))


def write_many(
    path: DataPath, items: Sequence[Item], notes: Sequence[tuple[str, int]] | None = None
) -> list[OpResult]:
    """One list of writes; ``notes``: each item's ``(key, checksum)`` tag."""
    if notes is None:
        return path.run([WriteOp(*item) for item in items])
    tagged = zip(items, notes, strict=True)
    return path.run([WriteOp(*item, key=k, checksum=c) for item, (k, c) in tagged])


def read_many_into(path: DataPath, items: Sequence[Item]) -> list[OpResult]:
    """One list of reads."""
    return path.run([ReadOp(*item) for item in items])


def read_many_checked(path: DataPath, items: Sequence[Item]) -> list[OpResult]:
    """One list of checked reads: each result is the checksum of what landed."""
    return path.run([ReadOp(*item, checked=True) for item in items])
