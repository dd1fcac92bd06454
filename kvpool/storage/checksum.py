"""The pool's end-to-end checksum of an object's bytes: xxh3-64.

One function, so that every place agrees: the client computes it on a put, readers verify
it after every get, a demotion before copying to SSD, and the SSD tier on every read.
"""

from __future__ import annotations

from typing import Any

import xxhash

__all__ = ["Hasher", "checksum", "hasher"]

#: a running :func:`checksum`: ``update`` with the bytes in order, then ``intdigest()``
Hasher = xxhash.xxh3_64


# Why xxh3-64: it hashes at memory speed (tens of GB/s, far faster than the copies around
# it, where CRC32 or a cryptographic hash would show in put and get latency), it releases
# nothing and needs no state, and 64 bits fit the index's per-object integer and the wire's
# msgpack ints.  It guards against corruption and torn or overtaken writes, not against an
# adversary: bytes made to collide on purpose are out of its scope.
def checksum(data: Any) -> int:
    """xxh3-64 of ``data``'s bytes (any C-contiguous buffer: bytes, bytearray, memoryview)."""
    return xxhash.xxh3_64_intdigest(data)


def hasher() -> Hasher:
    """A running checksum, for bytes that arrive in pieces (a TCP read hashes each piece
    as it lands while the next is still on the wire); equal to :func:`checksum` of
    the whole."""
    return xxhash.xxh3_64()
