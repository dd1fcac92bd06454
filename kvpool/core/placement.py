"""Where objects may go: the segments of each tier, and the room in them.

Room counts the memory bytes *leaving*: copies in flight to an SSD tier free it once done.
(The wire's answer to a put or read, ``protocol.messages.Placement``, is another thing.)
"""

from __future__ import annotations

from kvpool.core.registry import Registry, SegmentRecord, Tier
from kvpool.core.space import Extent

__all__ = ["Placer"]

# Module names for the enum members the hot paths test (a global load, not an attribute
# lookup on the enum class, and never an enum hash: dict lookups keyed by Tier hash it in
# Python code).
_MEMORY = Tier.MEMORY


class Placer:
    """Where objects of each tier of ``registry`` can go (see the module docstring)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        # each tier's segments, kept until segments_changed()
        self._mem_segments: list[SegmentRecord] | None = None
        self._ssd_segments: list[SegmentRecord] | None = None
        self._leaving: dict[str, int] = {}  # memory segment -> bytes of its copies in flight
        self.leaving_total = 0  # their sum (read on every inline eviction: an attribute)

    def segments_changed(self) -> None:
        """A segment was added, opened or dropped: make the tiers' lists again."""
        self._mem_segments = self._ssd_segments = None

    def segments(self, tier: Tier) -> list[SegmentRecord]:
        """``registry.tier_segments(tier)``, made again only after segments change."""
        # two attributes rather than a dict keyed by Tier: an Enum's hash is Python code
        if tier is _MEMORY:
            segs = self._mem_segments
            if segs is None:
                segs = self._mem_segments = self._registry.tier_segments(tier)
        else:
            segs = self._ssd_segments
            if segs is None:
                segs = self._ssd_segments = self._registry.tier_segments(tier)
        return segs

    def owner_segments(self, tier: Tier, owner: str) -> list[SegmentRecord]:
        """The segments of ``tier`` that client ``owner`` contributes."""
        return [s for s in self.segments(tier) if s.client_id == owner]

    def usage(self, tier: Tier) -> tuple[int, int]:
        """(capacity, used) bytes over every segment of a tier."""
        segs = self.segments(tier)
        return sum(s.capacity for s in segs), sum(s.space.used for s in segs)

    @staticmethod
    def fit(segments: list[SegmentRecord], size: int) -> tuple[SegmentRecord, Extent] | None:
        """Allocate in the segment with the most free space that has a large enough hole."""
        if len(segments) > 1:  # one segment (the usual case) needs no ordering
            segments = sorted(segments, key=lambda s: s.space.free, reverse=True)
        for seg in segments:
            if seg.space.free >= size:
                extent = seg.space.allocate(size)
                if extent is not None:
                    return seg, extent
        return None

    # ------------------------------------------------------------------ copies in flight
    def leave(self, segment_id: str, length: int) -> None:
        """A copy of ``length`` bytes out of memory segment ``segment_id`` started."""
        self._leaving[segment_id] = self._leaving.get(segment_id, 0) + length
        self.leaving_total += length

    def left(self, segment_id: str, length: int) -> None:
        """That copy is over, done or not: its bytes left."""
        rest = self._leaving.get(segment_id, 0) - length
        if rest > 0:
            self._leaving[segment_id] = rest
        else:
            self._leaving.pop(segment_id, None)
        self.leaving_total -= length

    def leaving_of(self, tier: Tier) -> int:
        """Bytes of ``tier`` its copies in flight will free (an eviction round counts
        them as gone, or it would demote everything while they copy)."""
        return self.leaving_total if tier is _MEMORY else 0

    def room_coming(self, segments: list[SegmentRecord], size: int) -> bool:
        """Copies in flight will make room for ``size`` bytes in one of ``segments``."""
        leaving = self._leaving
        return any(
            seg.segment_id in leaving
            and seg.space.capacity - seg.space.used + leaving[seg.segment_id] >= size
            for seg in segments
        )

    def check(self, leaving: dict[str, int]) -> None:
        """Assert that the bytes kept leaving are ``leaving`` (the index's scan; tests)."""
        assert leaving == self._leaving and sum(leaving.values()) == self.leaving_total
