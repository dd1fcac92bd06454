"""How the Mooncake engine lays an object out over memory Mooncake can move: kvpool's
16-byte header (magic, xxh3-64 of the payload), then the payload, one buffer or several
*parts* end to end (a KV page: one piece per layer).  The checksum of parts is the
checksum of the parts joined, so objects written in parts and read whole agree."""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvpool.engines.parts import row_view
from kvpool.mooncake.buffers import Registered
from kvpool.storage.buffers import byte_view, copy_bytes, writable_byte_view

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "Layout",
    "Plan",
    "pack_header",
    "parts_checksum",
    "unpack_payload",
]

MAGIC = b"KVPM"
HEADER = struct.Struct("<4s4xQ")  # magic, reserved, xxh3-64 of the payload
HEADER_SIZE = HEADER.size  # 16


def parts_checksum(views: Sequence[Any]) -> int:
    """xxh3-64 of ``views`` joined (equal to :func:`kvpool.storage.checksum.checksum` of
    the joined bytes)."""
    digest = xxhash.xxh3_64()
    for view in views:
        digest.update(view)
    return int(digest.intdigest())


def pack_header(payload: Any) -> bytes:
    """The 16 bytes stored in front of ``payload`` (one buffer)."""
    return HEADER.pack(MAGIC, parts_checksum([payload]))


def unpack_payload(stored: memoryview) -> memoryview | None:
    """The payload of a stored object (header and payload in one buffer), or None when it
    is not an intact kvpool object."""
    if len(stored) < HEADER_SIZE:
        return None
    magic, digest = HEADER.unpack_from(stored)
    payload = stored[HEADER_SIZE:]
    return payload if magic == MAGIC and parts_checksum([payload]) == digest else None


@dataclass
class Plan:
    """One object's pieces for one Mooncake call."""

    header_at: int  # the header's offset in the staging area
    payload: int = 0  # the payload's bytes (all parts)
    ptrs: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    # the payload's parts in order, as the bytes Mooncake moves (a staged part: its slot)
    pieces: list[memoryview] = field(default_factory=list)
    # a get's staged parts: (the caller's part, its slot), copied out once intact
    copies: list[tuple[memoryview, memoryview]] = field(default_factory=list)
    in_place: bool = True  # every part moved where it is
    _last_staged: bool = field(default=True, repr=False)  # the header is staged

    def add(self, address: int, size: int, *, staged: bool) -> None:
        last = len(self.ptrs) - 1
        if staged and self._last_staged and self.ptrs[last] + self.sizes[last] == address:
            self.sizes[last] += size
        else:
            self.ptrs.append(address)
            self.sizes.append(size)
        self._last_staged = staged

    def intact(self, area: memoryview) -> bool:
        """Whether a get delivered kvpool's header and the payload it describes."""
        magic, digest = HEADER.unpack_from(area, self.header_at)
        return bool(magic == MAGIC and parts_checksum(self.pieces) == digest)

    def copy_out(self) -> None:
        for dst, slot in self.copies:
            copy_bytes(dst, slot)


class Layout:
    """The pieces of a batch of objects: ``objects`` maps an index to (its parts, whether
    they are written into: a get).

    An object on Mooncake is kvpool's 16-byte header (magic, xxh3-64 of the payload) and
    then its payload.  A payload is one buffer or several *parts* end to end (a KV page: one
    block of every layer, one piece per layer tensor).  For one call, :class:`Layout` gives
    each object the list of (address, size) pieces that ``batch_put_from_multi_buffers`` /
    ``batch_get_into_multi_buffers`` take:

    - the header always lives in the engine's registered staging area;
    - a part inside registered caller memory (:class:`~.buffers.Registered`: a vLLM
      KV cache) is its own piece, moved in place (zero-copy);
    - any other part gets a slot in the staging area: a put copies it there first, a get
      copies it out only after the whole object's checksum matched (:meth:`Plan.copy_out`).
      Staged pieces that touch are merged, so a one-buffer object is one piece (header and
      payload together), as before parts existed.

    The checksum of parts is the checksum of the parts joined (xxh3-64 streams), so objects
    written in parts and read as one buffer (or the other way round) agree.
    """

    def __init__(
        self, registered: Registered, objects: Mapping[int, tuple[Sequence[Any], bool]]
    ) -> None:
        self._objects: dict[int, list[tuple[memoryview, int | None]]] = {}
        self.staging_bytes = 0
        for i, (parts, writable) in objects.items():
            view = writable_byte_view if writable else byte_view
            placed = []
            for part in parts:
                v = row_view(part)
                if v is None:
                    v = view(part)
                    address = registered.address(part, len(v))
                else:  # a KV cache row: looked up, not probed (a page is L of them)
                    address = registered.row_address(part, len(v))
                if len(v):
                    placed.append((v, address))
            self._objects[i] = placed
            self.staging_bytes += HEADER_SIZE + sum(len(v) for v, a in placed if a is None)

    def place(self, area: memoryview, base: int, *, fill: bool) -> dict[int, Plan]:
        """Each object's plan in the staging area ``area`` (at address ``base``); ``fill``
        (a put): write the headers and copy the staged parts in."""
        plans: dict[int, Plan] = {}
        at = 0
        for i, placed in self._objects.items():
            plan = Plan(header_at=at)
            plan.ptrs, plan.sizes = [base + at], [HEADER_SIZE]
            at += HEADER_SIZE
            for view, address in placed:
                n = len(view)
                if address is None:
                    slot = area[at : at + n]
                    if fill:
                        copy_bytes(slot, view)
                    else:
                        plan.copies.append((view, slot))
                    plan.pieces.append(slot)
                    plan.add(base + at, n, staged=True)
                    plan.in_place = False
                    at += n
                else:
                    plan.pieces.append(view)
                    plan.add(address, n, staged=False)
                plan.payload += n
            if fill:
                area[plan.header_at : plan.header_at + HEADER_SIZE] = HEADER.pack(
                    MAGIC, parts_checksum(plan.pieces)
                )
            plans[i] = plan
        return plans
