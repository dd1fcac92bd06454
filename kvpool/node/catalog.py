"""What changed in each remote storage owner's segments since its last heartbeat.

A node keeps a catalog of what it holds, to re-announce it to a master that restarted;
the master sends the changes in its next heartbeat reply.  Storage in the master's own
process has no outbox: the master is its catalog.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

__all__ = ["CatalogChanges", "CatalogEntry", "Outbox"]

#: key, segment_id, offset, size, checksum (as in ``HeartbeatReply.added``)
CatalogEntry = tuple[str, str, int, int, int]


@dataclass(slots=True)
class CatalogChanges:
    """Objects a node gained (with where they are) and lost since the last heartbeat."""

    added: list[CatalogEntry] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Pending:
    """An owner's changes not delivered yet, one final word per key: a node applies a
    reply's adds before its removals, so a key removed and put again (or put and removed)
    between two heartbeats must be in only one of the two."""

    added: dict[str, CatalogEntry] = field(default_factory=dict)
    removed: dict[str, None] = field(default_factory=dict)


# Freshness: a put into a node's segment is acknowledged only once the node has its
# catalog entry, so a master that crashes right after the acknowledgement still gets the
# object re-announced.  The node long-polls (the master holds its heartbeat until there
# is a change, or the heartbeat interval passed) and heartbeats again at once after a
# reply that carried changes: that next heartbeat *confirms* everything the previous
# reply delivered.  Each owner's adds are numbered (``seq``); ``take`` marks what it
# delivers, ``confirm`` (a heartbeat arrived) marks it confirmed, and a put waits until
# ``confirmed(owner) >= seq(owner)`` as of its own add.  Simplest of the designs that are
# correct: the node's own segment cannot tell which key a write was for, and a separate
# master-to-node call per put would be a second channel to keep in order with this one.
#
# A write through the node's data server can tell it, though: a TCP put's ``SegmentWrite``
# carries the key and checksum, the node notes them as the bytes land, and its ``PutEnd``
# says ``noted``; such a put is answered without waiting (the add still goes out, and
# moves the node's note into its catalog).  Shared-memory writes bypass the node's server
# and keep waiting.
class Outbox:
    """Pending :class:`CatalogChanges`, per storage owner that asked to be kept told."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}
        self._marks: dict[str, list[int]] = {}  # owner -> [adds so far, delivered, confirmed]

    def watch(self, owner: str) -> None:
        """Start keeping ``owner``'s changes (idempotent)."""
        self._pending.setdefault(owner, _Pending())
        self._marks.setdefault(owner, [0, 0, 0])

    def __contains__(self, owner: object) -> bool:
        return owner in self._pending

    def add(self, owner: str, entry: CatalogEntry) -> None:
        """``owner`` now holds ``entry`` (ignored for an owner not watched)."""
        changes = self._pending.get(owner)
        if changes is not None:
            key = entry[0]
            changes.removed.pop(key, None)  # put again: the add is the last word
            changes.added[key] = entry
            self._marks[owner][0] += 1

    def seq(self, owner: str) -> int:
        """How many adds ``owner`` has had (0 for an owner not watched)."""
        marks = self._marks.get(owner)
        return marks[0] if marks is not None else 0

    def confirm(self, owner: str) -> None:
        """``owner`` heartbeat again: it applied everything the last reply delivered."""
        marks = self._marks.get(owner)
        if marks is not None:
            marks[2] = marks[1]

    def confirmed(self, owner: str) -> int:
        """Adds ``owner`` is known to hold in its catalog; an owner not watched (gone, or
        hosted by the master) has nothing to wait for."""
        marks = self._marks.get(owner)
        return marks[2] if marks is not None else 1 << 62

    def has_changes(self, owner: str) -> bool:
        changes = self._pending.get(owner)
        return changes is not None and bool(changes.added or changes.removed)

    def remove(self, owner: str, key: str) -> None:
        """``owner`` no longer holds ``key`` (ignored for an owner not watched)."""
        changes = self._pending.get(owner)
        if changes is not None:
            changes.added.pop(key, None)  # an add not delivered yet is void
            changes.removed[key] = None

    def take(self, owner: str) -> CatalogChanges:
        """``owner``'s changes so far, and start afresh (empty for an owner not watched)."""
        changes = self._pending.get(owner)
        if changes is None:
            return CatalogChanges()
        self._pending[owner] = _Pending()
        marks = self._marks[owner]
        marks[1] = marks[0]
        return CatalogChanges(list(changes.added.values()), list(changes.removed))

    def forget_gone(self, alive: Container[str]) -> None:
        """Drop the outboxes of owners no longer in ``alive``."""
        for owner in [o for o in self._pending if o not in alive]:
            del self._pending[owner]
            del self._marks[owner]
