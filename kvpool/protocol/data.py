"""Data-plane messages: segment reads and writes between a client and a storage node.

One connection is strictly request → reply, one at a time; ``Ok`` and ``Error`` here are
generic enough that the master's messages reuse them.
"""

from __future__ import annotations

import msgspec

from kvpool.errors import KVPoolError, error_code, error_from_code
from kvpool.protocol.codec import Codec

__all__ = [
    "DATA_REPLY_CODEC",
    "DATA_REQUEST_CODEC",
    "DataReply",
    "DataRequest",
    "Error",
    "Ok",
    "SegmentDemote",
    "SegmentInfo",
    "SegmentInfoReply",
    "SegmentRead",
    "SegmentReadMany",
    "SegmentWrite",
    "SegmentWriteMany",
    "SsdRead",
    "SsdRemove",
    "error_reply",
]


# Conversation on one connection (strictly request → reply, one at a time)::
#
#     SegmentWrite(segment_id, offset, length) + payload of `length` bytes  →  Ok(length=0)
#     SegmentRead(segment_id, offset, length)                               →  Ok(length) + payload
#     SegmentWriteMany(ranges) + the ranges' bytes back to back             →  Ok(length=0)
#     SegmentReadMany(ranges)                                               →  Ok(total) + payload
#     SegmentInfo(segment_id)                                               →  SegmentInfoReply
#     SsdRead(key, length)                                                  →  Ok(length) + payload
#     any request the node cannot honour                                    →  Error(code, message)
#
# A write's payload is always sent in full, even when the node will refuse it (it learns
# that only after the header), so the stream stays in sync and the refusal is a plain
# :class:`Error` reply.
class SegmentWrite(msgspec.Struct, frozen=True, tag=True):
    """Write the frame's payload (``length`` bytes) at ``offset`` of the segment.

    ``key`` and ``checksum``, when given, name the object these bytes are: the node
    notes them for its catalog as the write lands, so the master can acknowledge the
    put without waiting for the node to confirm a catalog entry (``PutEnd.noted``).
    A tenant's connection cannot name keys (its tag is ignored)."""

    segment_id: str
    offset: int
    length: int
    key: str = ""
    checksum: int = 0


class SegmentRead(msgspec.Struct, frozen=True, tag=True):
    """Read ``length`` bytes at ``offset``; the reply's payload carries them."""

    segment_id: str
    offset: int
    length: int


#: one range of a batch: segment id, offset in it, length
Range = tuple[str, int, int]


class SegmentWriteMany(msgspec.Struct, frozen=True, tag=True):
    """Write several ranges in one exchange; the payload is their bytes back to back, in
    order.  A batch costs the node one request instead of one per value.  All or nothing:
    if any range cannot be written (unknown segment, out of range), the payload is
    drained, nothing is written and the reply is one ``Error``; a client that needs to
    know which range was refused asks again per range."""

    ranges: list[Range]
    #: (key, checksum) per range, or none: as :class:`SegmentWrite`'s tag
    notes: list[tuple[str, int]] = msgspec.field(default_factory=list)


class SegmentReadMany(msgspec.Struct, frozen=True, tag=True):
    """Read several ranges in one exchange; the reply ``Ok(total)`` carries them back to
    back, in order.  All or nothing, as :class:`SegmentWriteMany`: a range the node
    cannot serve makes the reply one ``Error`` with no payload."""

    ranges: list[Range]


class SsdRead(msgspec.Struct, frozen=True, tag=True):
    """Read an object of ``length`` bytes from the node's SSD tier; the reply's payload
    carries it.  A missing or corrupt file is an ``Error`` (a miss)."""

    key: str
    length: int


class SegmentDemote(msgspec.Struct, frozen=True, tag=True):
    """Copy ``length`` bytes at ``offset`` of the segment into the node's SSD tier under
    ``key`` (the master demoting an object it evicts from memory).  The node refuses when
    the bytes no longer match ``checksum`` (xxh3-64), so a copy that was overtaken by a new
    write is never kept."""

    segment_id: str
    offset: int
    length: int
    key: str
    checksum: int


class SsdRemove(msgspec.Struct, frozen=True, tag=True):
    """Delete SSD objects the master dropped from the index."""

    keys: list[str]


class SegmentInfo(msgspec.Struct, frozen=True, tag=True):
    """Ask how to reach a segment without the network (same-host shared memory)."""

    segment_id: str


class SegmentInfoReply(msgspec.Struct, frozen=True, tag=True):
    """Where a segment lives: its shared-memory name and the host it is on.

    ``host_token`` identifies the host (see :func:`kvpool.datapath.shm.host_token`); a
    client whose own token matches can attach ``shm_name`` and copy directly.
    """

    segment_id: str
    size: int
    shm_name: str
    host_token: str


class Ok(msgspec.Struct, frozen=True, tag=True):
    """Success; ``length`` payload bytes follow (0 for a write)."""

    length: int = 0


# Errors carry :func:`kvpool.errors.error_code` codes and turn back
# into the same exception class with :meth:`Error.to_exception`.
class Error(msgspec.Struct, frozen=True, tag=True):
    """Failure, as an error-hierarchy code and a human-readable message."""

    code: str
    message: str

    def to_exception(self) -> KVPoolError:
        """The exception the peer raised, rebuilt from its code."""
        return error_from_code(self.code, self.message)


def error_reply(exc: BaseException) -> Error:
    """The wire form of ``exc`` (anything outside kvpool's tree becomes ``INTERNAL``)."""
    return Error(error_code(exc), str(exc) or type(exc).__name__)


DataRequest = (
    SegmentWrite
    | SegmentRead
    | SegmentInfo
    | SsdRead
    | SegmentDemote
    | SsdRemove
    | SegmentWriteMany
    | SegmentReadMany
)
DataReply = Ok | Error | SegmentInfoReply

DATA_REQUEST_CODEC: Codec[DataRequest] = Codec(DataRequest)
DATA_REPLY_CODEC: Codec[DataReply] = Codec(DataReply)
