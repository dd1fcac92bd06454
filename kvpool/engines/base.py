"""The pool-engine seam: what the store connector needs from a pool, and nothing more.

An engine stores opaque byte objects under string keys for many processes at once.  The
store connector's scheduler half asks how much of a request's prefix is stored, the
worker half writes a request's blocks from KV pages and reads them back into KV pages,
and a request that matched blocks protects them until they are loaded.  Each engine is
one adapter behind :class:`PoolEngine`:

- ``kvpool`` — kvpool's own master and storage nodes, through :class:`kvpool.Client`;
- ``embedded`` — an in-process pool with no master (:class:`kvpool.EmbeddedPool`);
- ``mooncake`` — real Mooncake Store (``mooncake.store.MooncakeDistributedStore``).

One contract suite (``tests/engines/``) runs against every adapter, so an engine is added
by writing its adapter and running that suite.

Rules every adapter keeps:
- Batch calls answer per key, in the order asked; one key's failure never fails the batch.
- A put of a key that is already stored is a harmless success (same key, same content).
- A read that fails in any way (missing, corrupt, unreachable) is a miss, never wrong bytes.
- Probes (:meth:`PoolEngine.batch_exists`, :meth:`PoolEngine.prefix_lookup`) protect
  nothing and never renew a lease: probing must not starve eviction.
- :meth:`PoolEngine.pin` protects keys for an owner until :meth:`PoolEngine.release`
  or the TTL, whichever comes first; :data:`POOL_TTL` asks for the pool's own lease TTL
  (kvpool's ``default_kv_lease_ttl``), so that no pin outlives what the operator set.
- Pins never make a put fail for ever: a pool full of pinned objects answers
  :class:`~kvpool.errors.NoSpace` until the pins end, then stores again.
- An unreachable pool raises :class:`~kvpool.errors.TransferError` or
  :class:`~kvpool.errors.PeerTimeout`; a full pool answers
  :class:`~kvpool.errors.NoSpace` per key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvpool.errors import KVPoolError

__all__ = ["MISS", "POOL_TTL", "PoolEngine", "check_batch"]

#: :meth:`PoolEngine.batch_get_into`'s size for a key it could not read
MISS = -1
#: :meth:`PoolEngine.pin`'s ``ttl_ms`` for "as long as the pool's lease TTL"
#: (``default_kv_lease_ttl``): what a request's lookup pins with
POOL_TTL = 0


@runtime_checkable
class PoolEngine(Protocol):
    """A pool as the store connector uses it (see the module docstring for the rules)."""

    #: which engine answers: ``"kvpool"``, ``"embedded"`` or ``"mooncake"``
    engine: str

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored and readable now; takes no lease."""
        ...

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        """How many leading keys of ``keys`` are stored; takes no lease."""
        ...

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[Any],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        """Store each buffer (bytes-like, NumPy array, CPU tensor) under its key; None per
        key stored (or already there), else the error that refused it."""
        ...

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Fill the front of each buffer with its key's object: the size read, or
        :data:`MISS`."""
        ...

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        """Protect ``keys`` from eviction for ``owner`` (a request) for at most ``ttl_ms``
        (:data:`POOL_TTL`: the pool's lease TTL); returns how many were stored and are now
        pinned.  Pinning a key the owner already pins extends it to the later expiry."""
        ...

    def release(self, owner: str) -> int:
        """Drop everything ``owner`` pinned; returns how many pins ended."""
        ...

    def remove(self, key: str) -> bool:
        """Remove an object (a corrupt copy, so a recomputed one can replace it); False
        when there was none."""
        ...

    def health(self) -> dict[str, Any]:
        """A small snapshot that proves the pool answers (raises when it does not)."""
        ...

    def close(self) -> None: ...


def check_batch(
    keys: Sequence[str], buffers: Sequence[Any], parents: Sequence[str | None] | None = None
) -> None:
    """The one argument check every adapter's batch calls make: one buffer (and parent, when
    given) per key.  A mismatch is a caller's bug, so a ``ValueError``, not a per-key answer."""
    if len(buffers) != len(keys) or (parents is not None and len(parents) != len(keys)):
        raise ValueError("keys, buffers and parents differ in length")
