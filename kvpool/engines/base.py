"""The pool-engine seam: what the store connector needs from a pool, and nothing more.

Opaque byte objects under string keys, for many processes at once: the scheduler half
probes and pins (:class:`PoolLookups`), the worker half moves batches of objects, each
given as its *parts* (one page: one block of every layer).  One contract suite
(``tests/engines/``) runs against every adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvpool.errors import KVPoolError

__all__ = ["MISS", "POOL_TTL", "BatchMoves", "PoolEngine", "PoolLookups", "check_batch"]

#: :meth:`PoolEngine.batch_get_parts`'s size for a key it could not read
MISS = -1
#: :meth:`PoolLookups.pin`'s ``ttl_ms`` for "as long as the pool's lease TTL"
#: (``default_kv_lease_ttl``): what a request's lookup pins with
POOL_TTL = 0


# Rules every adapter keeps:
# - Batch calls answer per key, in the order asked; one key's failure never fails the
#   batch; an empty batch is an empty answer (no round trip).
# - A put of a key that is already stored is a harmless success (same key, same content).
# - A read that fails in any way (missing, corrupt, unreachable) is a miss, never wrong bytes.
# - An object is its parts end to end, stored as one object: parts cut one way and read
#   back cut another (or as one part) see the same bytes.  A read whose object is not
#   exactly the parts' total size is a miss.  On a miss the parts hold unspecified bytes
#   (an engine that reads in place may have written them before its checksum failed): the
#   caller treats them as unwritten.
# - Probes (batch_exists, prefix_lookup) protect nothing and never renew a lease: probing
#   must not starve eviction.
# - pin protects keys for an owner until release or the TTL, whichever comes first;
#   POOL_TTL asks for the pool's own lease TTL, so that no pin outlives what the operator
#   set.  Pins never make a put fail for ever: a pool full of pinned objects answers
#   NoSpace until the pins end, then stores again.
# - An unreachable pool raises TransferError or PeerTimeout; a full pool answers NoSpace
#   per key.
@runtime_checkable
class PoolLookups(Protocol):
    """What the scheduler half asks of a pool: probes and pins."""

    #: which engine answers: ``"kvpool"``, ``"embedded"`` or ``"mooncake"``
    engine: str

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored and readable now; takes no lease."""
        ...

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys of ``keys`` are stored; takes no lease."""
        ...

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        """Protect ``keys`` from eviction for ``owner`` (a request) for at most ``ttl_ms``
        (:data:`POOL_TTL`: the pool's lease TTL); returns how many were stored and are now
        pinned.  Pinning a key the owner already pins extends it to the later expiry."""
        ...

    def release(self, owner: str) -> int:
        """Drop everything ``owner`` pinned; returns how many pins ended."""
        ...

    def health(self) -> dict[str, Any]:
        """A small snapshot that proves the pool answers (raises when it does not)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class PoolEngine(PoolLookups, Protocol):
    """A pool as the store connector uses it: the lookups, and moves of objects in parts."""

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        """Store each key's parts (buffers: bytes-like, NumPy arrays, CPU tensors) as one
        object, joined in order; ``parents`` names each key's parent block (an engine
        that keeps chains evicts a prefix from its tail).  None per key stored (or
        already there), else the error that refused it."""
        ...

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        """Read each key's object into its parts, in order, end to end: the object's size
        (the parts' total), or :data:`MISS` (missing, corrupt, unreachable, or another
        size; the parts' bytes are then unspecified)."""
        ...

    def remove(self, key: str) -> bool:
        """Remove an object (a corrupt copy, so a recomputed one can replace it); False
        when there was none."""
        ...


def check_batch(
    keys: Sequence[str], parts: Sequence[Any], parents: Sequence[str | None] | None = None
) -> None:
    """The one argument check every adapter's moves make: one object's parts (and parent,
    when given) per key.  A mismatch is a caller's bug, so a ``ValueError``, not a per-key
    answer."""
    if len(parts) != len(keys) or (parents is not None and len(parents) != len(keys)):
        raise ValueError("keys, parts and parents differ in length")


class BatchMoves:
    """The moves' first steps, kept once for the adapters that inherit them: the batch is
    checked (:func:`check_batch`) and an empty one is an empty answer, without a round
    trip.  The adapter moves a nonempty batch: :meth:`_put_batch`, :meth:`_get_batch`."""

    def batch_put_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        check_batch(keys, parts, parents)
        return self._put_batch(keys, parts, parents) if keys else []

    def batch_get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        check_batch(keys, parts)
        return self._get_batch(keys, parts) if keys else []

    def _put_batch(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        parents: Sequence[str | None] | None,
    ) -> list[KVPoolError | None]:
        raise NotImplementedError

    def _get_batch(self, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
        raise NotImplementedError
