"""Extent allocation inside one segment: which byte ranges are free, which are taken."""

from __future__ import annotations

import bisect

import msgspec

__all__ = ["Extent", "ExtentAllocator"]


class Extent(msgspec.Struct, frozen=True, gc=False):
    """``length`` bytes at ``offset``.  A frozen Struct rather than a frozen dataclass:
    one is made per allocation, and it is built in C (see kvpool.core.objects)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


# Invariants (checked by ``check()`` and by the property tests):
# - live extents never overlap, and every extent lies inside [0, capacity);
# - free extents never overlap and are coalesced: no two free extents touch;
# - ``used`` equals the sum of the lengths of live extents, and
#   ``used + sum(free lengths) == capacity``.
#
# Allocation is first-fit by offset, with an exact-size shortcut: KV objects of one model
# all have the same size, so a freed extent of exactly the requested length is reused in
# O(1) instead of scanning the free list.
class ExtentAllocator:
    """Free-space map of a segment of ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.used = 0
        # free extents: parallel sorted offsets and offset -> length
        self._free_offsets: list[int] = [0] if capacity else []
        self._free_len: dict[int, int] = {0: capacity} if capacity else {}
        # exact-size shortcut: length -> offsets of free extents of that length
        self._by_len: dict[int, set[int]] = {capacity: {0}} if capacity else {}
        self._live: dict[int, int] = {}

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def can_allocate(self, length: int) -> bool:
        if length <= 0:
            return False
        if self._by_len.get(length):
            return True
        return any(n >= length for n in self._free_len.values())

    def allocate(self, length: int) -> Extent | None:
        """Take ``length`` bytes; None when no single free extent is large enough."""
        if length <= 0:
            raise ValueError(f"length must be positive, got {length}")
        exact = self._by_len.get(length)
        if exact:  # the usual case: every KV object of a model has one size
            offset = next(iter(exact))
            self._drop_free(offset)
        else:
            offset = -1
            for off in self._free_offsets:
                if self._free_len[off] >= length:
                    offset = off
                    break
            if offset < 0:
                return None
            size = self._free_len[offset]
            self._drop_free(offset)
            if size > length:
                self._add_free(offset + length, size - length)
        self._live[offset] = length
        self.used += length
        return Extent(offset, length)

    def take(self, extent: Extent) -> bool:
        """Mark a specific extent live (a node re-announcing what it holds after a master
        restart); False when any byte of it is not free."""
        if extent.length <= 0 or extent.offset < 0 or extent.end > self.capacity:
            return False
        i = bisect.bisect_right(self._free_offsets, extent.offset) - 1
        if i < 0:
            return False
        start = self._free_offsets[i]
        size = self._free_len[start]
        if start + size < extent.end:
            return False
        self._drop_free(start)
        if extent.offset > start:
            self._add_free(start, extent.offset - start)
        if start + size > extent.end:
            self._add_free(extent.end, start + size - extent.end)
        self._live[extent.offset] = extent.length
        self.used += extent.length
        return True

    def release(self, extent: Extent) -> None:
        """Give an extent back, merging it with free neighbours."""
        offset, length = extent.offset, extent.length
        live = self._live
        if live.get(offset) != length:
            raise ValueError(f"{extent} is not a live extent of this segment")
        del live[offset]
        self.used -= length
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets):
            nxt = self._free_offsets[i]
            if nxt == offset + length:
                length += self._free_len[nxt]
                self._drop_free(nxt)
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_len[prev] == offset:
                offset = prev
                length += self._free_len[prev]
                self._drop_free(prev)
        self._add_free(offset, length)

    def live_extents(self) -> list[Extent]:
        return [Extent(o, n) for o, n in sorted(self._live.items())]

    def free_extents(self) -> list[Extent]:
        return [Extent(o, self._free_len[o]) for o in self._free_offsets]

    def check(self) -> None:
        """Assert the invariants in the comment above the class (used by tests)."""
        spans = sorted(
            [(o, n, "live") for o, n in self._live.items()]
            + [(o, self._free_len[o], "free") for o in self._free_offsets]
        )
        pos = 0
        prev_kind = ""
        for offset, length, kind in spans:
            assert offset == pos, f"gap or overlap at {offset} (expected {pos})"
            assert length > 0
            assert not (kind == prev_kind == "free"), f"uncoalesced free extents at {offset}"
            pos = offset + length
            prev_kind = kind
        assert pos == self.capacity, f"extents end at {pos}, capacity {self.capacity}"
        assert self.used == sum(self._live.values())
        assert self._free_offsets == sorted(self._free_len)
        assert all(self._free_len[o] == n for n, offs in self._by_len.items() for o in offs)

    def _add_free(self, offset: int, length: int) -> None:
        bisect.insort(self._free_offsets, offset)
        self._free_len[offset] = length
        bucket = self._by_len.get(length)
        if bucket is None:  # no set made and thrown away when the bucket exists
            self._by_len[length] = {offset}
        else:
            bucket.add(offset)

    def _drop_free(self, offset: int) -> None:
        i = bisect.bisect_left(self._free_offsets, offset)
        del self._free_offsets[i]
        length = self._free_len.pop(offset)
        bucket = self._by_len[length]
        bucket.discard(offset)
        if not bucket:
            del self._by_len[length]
