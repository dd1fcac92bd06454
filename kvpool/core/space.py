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
# - free extents never overlap, lie inside [0, capacity) and are coalesced: no two free
#   extents touch;
# - ``used + sum(free lengths) == capacity``.
# Only the free space is kept: what is taken is known from its owner (the index's record
# of each object), and a release is checked against the free map (no byte of it may be
# free).  A map of live extents cost 50 bytes an object, the index's largest after keys.
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
        # one int object per length handed out (bounded), not one per extent: a length
        # decoded from a request is a new 32-byte int each time
        self._lengths: dict[int, int] = {}

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
        lengths = self._lengths
        known = lengths.get(length)
        if known is not None:
            length = known
        elif len(lengths) < 64:
            lengths[length] = length
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
        self.used += extent.length
        return True

    def release(self, extent: Extent) -> None:
        """Give an extent back, merging it with free neighbours."""
        if not self.is_taken(extent):
            raise ValueError(f"{extent} is not a live extent of this segment")
        offset, length = extent.offset, extent.length
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

    def is_taken(self, extent: Extent) -> bool:
        """Whether every byte of ``extent`` is inside the segment and none is free."""
        offset, end = extent.offset, extent.end
        if extent.length <= 0 or offset < 0 or end > self.capacity:
            return False
        offsets = self._free_offsets
        i = bisect.bisect_right(offsets, offset)  # the first free extent after offset
        if i > 0 and offsets[i - 1] + self._free_len[offsets[i - 1]] > offset:
            return False
        return i == len(offsets) or offsets[i] >= end

    def taken_runs(self) -> list[Extent]:
        """The taken space as maximal runs (neighbouring live extents merged)."""
        runs, pos = [], 0
        for o in self._free_offsets:
            if o > pos:
                runs.append(Extent(pos, o - pos))
            pos = o + self._free_len[o]
        if pos < self.capacity:
            runs.append(Extent(pos, self.capacity - pos))
        return runs

    def free_extents(self) -> list[Extent]:
        return [Extent(o, self._free_len[o]) for o in self._free_offsets]

    def check(self) -> None:
        """Assert the invariants in the comment above the class (used by tests)."""
        pos = -1
        for offset in self._free_offsets:
            length = self._free_len[offset]
            assert length > 0 and offset >= 0, f"bad free extent at {offset}"
            assert offset > pos, f"overlapping or uncoalesced free extents at {offset}"
            pos = offset + length
        assert pos <= self.capacity, f"free space ends at {pos}, capacity {self.capacity}"
        assert self.used + sum(self._free_len.values()) == self.capacity
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
