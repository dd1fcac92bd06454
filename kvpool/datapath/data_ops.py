"""What a client asks of a data path: a list of small frozen operations.

A data path (:class:`~kvpool.datapath.transport.DataPath`) has one call,
``run(ops) -> results``, for a single transfer and a batch alike.  The operations:

- :class:`WriteOp` -- ``buffer`` to ``(segment_id, offset)``; with ``key`` (and its
  ``checksum``) the owner notes the object for its catalog as the bytes land, where it
  can (a tagged write through its data server).
- :class:`ReadOp` -- ``(segment_id, offset)`` into ``buffer``; ``checked``: the bytes'
  checksum comes back, computed as they land where the path can.
- :class:`SsdReadOp` -- the object ``key`` of the owner's SSD tier into ``buffer``.

Rules (every data path keeps them):

- One result per op, in order: ``None`` (done), an ``int`` (a checked read: the checksum
  of the bytes that landed; a noted write: the checksum the owner noted), or the
  :class:`~kvpool.errors.KVPoolError` that op failed with.
- A failure that ends the whole list (the owner cannot be reached, the connection broke
  or timed out mid-list) is raised instead (:class:`~kvpool.errors.TransferError`,
  :class:`~kvpool.errors.PeerTimeout`): none of the list's results can be trusted then.
- The ops of one list may move in any order and overlap; one that must follow another
  goes in a later list.
- ``shm_name`` is the segment's shared-memory name when the master's placement carries
  one; paths that do not use shared memory ignore it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from kvpool.errors import KVPoolError

__all__ = ["DataOp", "OpResult", "ReadOp", "SsdReadOp", "WriteOp", "sole_result"]


class WriteOp(msgspec.Struct, frozen=True):
    """Write ``buffer`` at ``offset`` of the segment (``key``: noted, see above)."""

    segment_id: str
    offset: int
    buffer: Any
    shm_name: str = ""
    key: str = ""
    checksum: int = 0


class ReadOp(msgspec.Struct, frozen=True):
    """Fill ``buffer`` from ``offset`` of the segment (``checked``: its checksum back)."""

    segment_id: str
    offset: int
    buffer: Any
    shm_name: str = ""
    checked: bool = False


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
