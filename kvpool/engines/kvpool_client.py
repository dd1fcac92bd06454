"""The adapter over kvpool's client API, shared by the two engines that speak it.

:class:`kvpool.Client` (kvpool's master) and :class:`kvpool.EmbeddedPool` (in-process)
have the same public methods, so one adapter maps :class:`~kvpool.engines.base.PoolEngine`
onto them; :mod:`.kvpool_master` and :mod:`.embedded` only name the engine and build the
client.  Only the clients' public methods are used.

Multi-part moves (a page as one piece per layer) are base's default: gathered into or
scattered from one reused staging page, since the clients move one buffer per object
(their get already reads straight into it, and checks the checksum there before the
scatter: a corrupt object writes nothing into the parts).

A batch put is one ``batch_put``: two metadata round trips whatever its length, each
key's parent carried along (kvpool's eviction policy trims a prefix from its tail).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvpool.engines.base import StagedParts, check_batch
from kvpool.errors import KVPoolError

__all__ = ["ClientAPI", "ClientEngine"]


class ClientAPI(Protocol):
    """The public methods of kvpool's clients that the adapter uses."""

    def batch_put(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]: ...

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]: ...

    def batch_exists(self, keys: Sequence[str]) -> list[bool]: ...

    def prefix_lookup(self, keys: Sequence[str], tokens_per_key: int = 0) -> int: ...

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int: ...

    def release_owner(self, owner: str) -> int: ...

    def remove(self, key: str) -> bool: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class ClientEngine(StagedParts):
    """A :class:`~kvpool.engines.base.PoolEngine` over a kvpool client.

    Multi-part moves go through one reused staging page (:class:`StagedParts`): the
    client reads into and writes from one buffer per object."""

    engine = "kvpool"

    def __init__(self, client: ClientAPI) -> None:
        self.client = client

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.client.batch_exists(keys) if keys else []

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self.client.prefix_lookup(keys) if keys else 0

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[Any],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        check_batch(keys, buffers, parents)
        if not keys:
            return []
        return self.client.batch_put(keys, buffers, parents=parents)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        check_batch(keys, buffers)
        # The client answers -1 for a miss, a corrupt copy and an unreachable node alike.
        return self.client.batch_get_into(keys, buffers) if keys else []

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
