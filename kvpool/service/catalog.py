"""What changed in each remote storage owner's segments since its last heartbeat.

A node keeps a catalog of the objects it holds, so it can re-announce them to a master
that restarted.  The master tells it what changed in the reply to its next heartbeat;
:class:`Outbox` holds those changes until then.  Storage hosted in the master's own
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


class Outbox:
    """Pending :class:`CatalogChanges`, per storage owner that asked to be kept told."""

    def __init__(self) -> None:
        self._pending: dict[str, CatalogChanges] = {}

    def watch(self, owner: str) -> None:
        """Start keeping ``owner``'s changes (idempotent)."""
        self._pending.setdefault(owner, CatalogChanges())

    def __contains__(self, owner: object) -> bool:
        return owner in self._pending

    def add(self, owner: str, entry: CatalogEntry) -> None:
        """``owner`` now holds ``entry`` (ignored for an owner not watched)."""
        changes = self._pending.get(owner)
        if changes is not None:
            changes.added.append(entry)

    def remove(self, owner: str, key: str) -> None:
        """``owner`` no longer holds ``key`` (ignored for an owner not watched)."""
        changes = self._pending.get(owner)
        if changes is not None:
            changes.removed.append(key)

    def take(self, owner: str) -> CatalogChanges:
        """``owner``'s changes so far, and start afresh (empty for an owner not watched)."""
        changes = self._pending.get(owner)
        if changes is None:
            return CatalogChanges()
        self._pending[owner] = CatalogChanges()
        return changes

    def forget_gone(self, alive: Container[str]) -> None:
        """Drop the outboxes of owners no longer in ``alive``."""
        for owner in [o for o in self._pending if o not in alive]:
            del self._pending[owner]
