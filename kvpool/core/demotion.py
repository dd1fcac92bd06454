"""Demotion copies: objects moved from memory to their owner's SSD tier (``enable_offload``).

The master's own storage copies at once (the caller carries out the :class:`Demote` before
any later reservation); a node copies later (:meth:`Demotions.defer`): the object is DEMOTING,
holding both extents, its memory bytes counted as *leaving*, until the copy is done or
abandoned or a reader takes it back.  A stalled owner's victims are dropped, not demoted.
"""

from __future__ import annotations

from kvpool.core.objects import Demote, Location, ObjectRecord, State
from kvpool.core.placement import Placer
from kvpool.core.registry import SegmentRecord
from kvpool.core.space import Extent

__all__ = ["Demotions"]

_DEMOTING = State.DEMOTING

Copy = tuple[SegmentRecord, Extent]


class Demotions:
    """The demotions of an index's objects, and the copies in flight (see the module
    docstring).  Kept so: ``in_flight`` is the number of DEMOTING objects, each with a
    ``target``, and the placer's leaving bytes are their memory extents (:meth:`check`)."""

    def __init__(self, placer: Placer) -> None:
        self._placer = placer
        self.in_flight = 0  # DEMOTING objects
        self._deferred: set[str] = set()  # owners whose demotions are copied later
        self._stalled: set[str] = set()  # ... and whose copies stopped being answered

    # ------------------------------------------------------------------------- owners
    def defer(self, owner: str) -> None:
        """``owner`` (a node) copies its demotions while the index serves others.

        Its demoted objects are DEMOTING, invisible, and hold both their memory extent and
        their SSD extent until the copy is reported done or abandoned, so the memory is
        never reused under a copy and the SSD copy is never read before it exists.  Their
        memory bytes are *leaving*: an eviction round counts them as gone, and a put that
        only they would make room for stops evicting and fails with
        ``NoRoom(coming=True)``, for the caller to retry when they are done, instead of
        demoting the whole tier for one object."""
        self._deferred.add(owner)

    def stall(self, owner: str, stalled: bool) -> None:
        """``owner`` stopped answering copies (its victims are dropped, not demoted), or
        answered again."""
        if stalled:
            self._stalled.add(owner)
        else:
            self._stalled.discard(owner)

    def deferred(self, owner: str) -> bool:
        return owner in self._deferred

    def stalled(self, owner: str) -> bool:
        return owner in self._stalled

    # ---------------------------------------------------------------------- the copies
    @staticmethod
    def now(obj: ObjectRecord, dst: Copy) -> Demote:
        """A demotion copied at once: ``obj`` lives at ``dst``, its memory extent free."""
        src = obj.location()
        obj.segment.space.release(obj.extent)
        obj.move(*dst)
        return Demote(obj.key, src, obj.location(), obj.checksum)

    def start(self, obj: ObjectRecord, dst: Copy) -> Demote:
        """A deferred demotion: both extents held, its memory bytes leaving."""
        obj.target = dst
        self._placer.leave(obj.segment.segment_id, obj.extent.length)
        self.in_flight += 1
        seg, extent = dst
        dst_loc = Location(seg.segment_id, seg.client_id, seg.tier, extent.offset, extent.length)
        return Demote(obj.key, obj.location(), dst_loc, obj.checksum, True)

    @staticmethod
    def reported(objects: dict[str, ObjectRecord], event: Demote) -> ObjectRecord | None:
        """The DEMOTING object ``event`` (a copy's report) is about; None when it is no
        longer that copy's (taken back, abandoned, dropped)."""
        obj = objects.get(event.key)
        if obj is None or obj.state is not _DEMOTING or obj.target is None:
            return None
        seg, extent = obj.target
        if seg.segment_id != event.dst.segment_id or extent.offset != event.dst.offset:
            return None
        return obj

    def done(self, obj: ObjectRecord) -> None:
        """The copy is done: ``obj`` lives at its SSD extent, its memory extent free."""
        seg, extent = self._end(obj)
        obj.segment.space.release(obj.extent)
        obj.move(seg, extent)

    def take_back(self, obj: ObjectRecord) -> None:
        """``obj`` is wanted again: it stays in memory, its SSD extent free.  Its memory
        was never reused under the copy, so its bytes are still there; the copy's report
        then finds the object no longer copying (:meth:`reported`) and changes nothing."""
        seg, extent = self._end(obj)
        seg.space.release(extent)

    def leave(self, obj: ObjectRecord, release: bool) -> None:
        """``obj`` leaves the index while copying (its SSD extent freed if ``release``)."""
        seg, extent = self._end(obj)
        if release:
            seg.space.release(extent)

    def _end(self, obj: ObjectRecord) -> Copy:
        """The copy of ``obj`` is over, done or not: its bytes left; its target."""
        target = obj.target
        assert target is not None, f"{obj.key} is not being copied"
        self._placer.left(obj.segment.segment_id, obj.extent.length)
        self.in_flight -= 1
        obj.target = None
        return target

    def check(self, objects: dict[str, ObjectRecord]) -> None:
        """Assert the class's rule against ``objects`` (tests)."""
        leaving: dict[str, int] = {}
        copying = 0
        for obj in objects.values():
            if obj.state is not _DEMOTING:
                assert obj.target is None, f"{obj.key}: a target but no copy"
                continue
            copying += 1
            assert obj.target is not None and not obj.holds, f"{obj.key}: bad copy"
            sid = obj.segment.segment_id
            leaving[sid] = leaving.get(sid, 0) + obj.extent.length
        assert self.in_flight == copying, "DEMOTING count kept wrong"
        self._placer.check(leaving)
