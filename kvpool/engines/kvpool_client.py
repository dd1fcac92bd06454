"""The adapter over kvpool's client, shared by the two engines that speak it
(:mod:`.kvpool_master` and :mod:`.embedded` only name the engine and build the client)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvpool.engines.base import BatchMoves
from kvpool.engines.parts import StagingPages, part_views
from kvpool.errors import KVPoolError
from kvpool.storage.buffers import copy_bytes

if TYPE_CHECKING:
    from kvpool.client.client import Client

__all__ = ["ClientEngine"]


class ClientEngine(BatchMoves):
    """A :class:`~kvpool.engines.base.PoolEngine` over a kvpool client.

    :class:`kvpool.EmbeddedPool` (in-process) is a :class:`kvpool.Client` (kvpool's master),
    so one adapter maps :class:`~kvpool.engines.base.PoolEngine` onto the client's public
    methods; :mod:`.kvpool_master` and :mod:`.embedded` only name the engine and build the
    client.  A put joins an object of several parts in one reused staging slot (the client
    sends one buffer per object); a get reads each part in place, straight from the pool into
    its page, and checks the object's checksum over the parts as they landed.  A batch put is
    one ``batch_put``: two metadata round trips whatever its length, each key's parent
    carried along (kvpool's eviction policy trims a prefix from its tail).
    """

    engine = "kvpool"

    def __init__(self, client: Client) -> None:
        self.client = client
        self._staging = StagingPages()

    def warm(self) -> None:
        """A master's pool: connect to and map its memory segments now (Client.warm), so
        the first hit of a fresh worker costs what later ones do.  The embedded pool's
        are in this process already."""
        if self.engine == "kvpool":
            self.client.warm()

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.client.batch_exists(keys) if keys else []

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self.client.prefix_lookup(keys) if keys else 0

    def _put_batch(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        parents: Sequence[str | None] | None,
    ) -> list[KVPoolError | None]:
        views = [part_views(p, writable=False) for p in parts]
        # an object of one part is sent from where it is; the others are joined first
        slots = iter(self._staging.slots([_size(vs) for vs in views if len(vs) != 1]))
        objects = [vs[0] if len(vs) == 1 else _join(vs, next(slots)) for vs in views]
        return self.client.batch_put(keys, objects, parents=parents)

    def _get_batch(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        """Each object read straight into its parts, its checksum checked over them as
        they landed (:meth:`~kvpool.client.client.Client.batch_get_into_parts`): no
        staging.  A miss may have written into the parts (the contract's "unspecified")."""
        views = [part_views(p, writable=True) for p in parts]
        return self.client.batch_get_into_parts(keys, views)

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        return self.client.pin(keys, owner, ttl_ms) if keys else 0

    def release(self, owner: str) -> int:
        return self.client.release_owner(owner)

    def remove(self, key: str) -> bool:
        return self.client.remove(key)

    def health(self) -> dict[str, Any]:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()


def _size(views: Sequence[memoryview]) -> int:
    return sum(len(v) for v in views)


def _join(views: Sequence[memoryview], slot: memoryview) -> memoryview:
    """``views`` copied end to end into ``slot`` (of their total size)."""
    at = 0
    for v in views:
        copy_bytes(slot[at : at + len(v)], v)
        at += len(v)
    return slot
