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
- Multi-part moves (:meth:`PoolEngine.batch_put_from_parts`,
  :meth:`PoolEngine.batch_get_into_parts`): an object is its parts end to end (one page:
  one block of every layer, L pieces in L tensors), stored as one object, so a part-wise
  put and a whole-buffer get see the same bytes.  A read whose object is not exactly the
  parts' total size is a miss.  On a miss the parts hold unspecified bytes (an engine that
  reads in place may have written them before its checksum failed): the caller must treat
  them as unwritten.  :class:`StagedParts` is the default for an engine that moves only
  whole buffers: one copy through a reused staging page each way.
- An unreachable pool raises :class:`~kvpool.errors.TransferError` or
  :class:`~kvpool.errors.PeerTimeout`; a full pool answers
  :class:`~kvpool.errors.NoSpace` per key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvpool.errors import KVPoolError
from kvpool.storage.buffers import byte_view, copy_bytes, writable_byte_view

__all__ = [
    "MISS",
    "POOL_TTL",
    "PoolEngine",
    "StagedParts",
    "StagingPages",
    "check_batch",
    "get_into_parts",
    "put_from_parts",
    "row_view",
]

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

    def batch_put_from_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        """Store each key's parts (buffers, in order) as one object: as
        :meth:`batch_put_from` of the parts joined."""
        ...

    def batch_get_into_parts(
        self, keys: Sequence[str], parts: Sequence[Sequence[Any]]
    ) -> list[int]:
        """Read each key's object into its parts, in order, end to end: the object's size
        (the parts' total), or :data:`MISS` (missing, corrupt, unreachable, or another
        size; the parts' bytes are then unspecified)."""
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


class StagingPages:
    """One staging area, grown on demand and reused by every call: the default multi-part
    moves copy through it instead of allocating a page per key per call.  One user at a
    time (an engine is called by one thread at a time)."""

    def __init__(self) -> None:
        self._area: Any = None

    def slots(self, sizes: Sequence[int]) -> list[memoryview]:
        """One writable slot per size, back to back in the area."""
        import numpy as np

        starts = [0]
        for n in sizes:  # each slot starts on a page, as the KV rows copied to or from it
            starts.append(starts[-1] + -(-n // 4096) * 4096)
        if self._area is None or len(self._area) < starts[-1]:
            self._area = np.empty(max(starts[-1], 1), dtype=np.uint8).data.cast("B")
        return [self._area[at : at + n] for at, n in zip(starts, sizes, strict=False)]


def row_view(part: Any) -> memoryview | None:
    """A writable byte view of a 1-D contiguous CPU tensor of bytes (what
    :meth:`~kvpool.connectors.pages.PagedCaches.block_parts` hands over), made in a
    fraction of :func:`~kvpool.storage.buffers.byte_view`'s general checks: pages of many
    layers are hundreds of parts per call.  None for anything else."""
    try:
        one_d = part.dim() == 1 and part.element_size() == 1 and part.is_contiguous()
        if part.is_cpu and one_d:
            return memoryview(part.numpy()).cast("B")
    except (AttributeError, RuntimeError, TypeError):  # not a tensor, or needs grad
        pass
    return None


def _views(parts: Sequence[Any], writable: bool) -> list[memoryview]:
    view = writable_byte_view if writable else byte_view
    out = []
    for part in parts:
        fast = row_view(part)
        out.append(view(part) if fast is None else fast)
    return out


def put_from_parts(
    engine: Any,
    keys: Sequence[str],
    parts: Sequence[Sequence[Any]],
    staging: StagingPages,
    *,
    parents: Sequence[str | None] | None = None,
) -> list[KVPoolError | None]:
    """The default :meth:`PoolEngine.batch_put_from_parts`: each key's parts gathered into
    one staging slot, then one :meth:`PoolEngine.batch_put_from`."""
    check_batch(keys, parts, parents)
    views = [_views(p, writable=False) for p in parts]
    slots = staging.slots([sum(len(v) for v in vs) for vs in views])
    for slot, vs in zip(slots, views, strict=True):
        at = 0
        for v in vs:
            copy_bytes(slot[at : at + len(v)], v)
            at += len(v)
    result: list[KVPoolError | None] = engine.batch_put_from(keys, slots, parents=parents)
    return result


def get_into_parts(
    engine: Any, keys: Sequence[str], parts: Sequence[Sequence[Any]], staging: StagingPages
) -> list[int]:
    """The default :meth:`PoolEngine.batch_get_into_parts`: one
    :meth:`PoolEngine.batch_get_into` into staging slots of the parts' total size (plus one
    byte, so that a larger object is not taken for one of the right size), then each good
    object scattered into its parts.  A miss writes nothing into the parts."""
    check_batch(keys, parts)
    views = [_views(p, writable=True) for p in parts]
    sizes = [sum(len(v) for v in vs) for vs in views]
    slots = staging.slots([n + 1 for n in sizes])
    try:
        got = [int(n) for n in engine.batch_get_into(keys, slots)]
    except ValueError:
        # kvpool's client fails a whole batch on an object larger than its buffer: read
        # one by one, and such an object is a miss of its own
        got = [_get_one(engine, k, s) for k, s in zip(keys, slots, strict=True)]
    out = []
    for vs, slot, n, size in zip(views, slots, got, sizes, strict=True):
        if n != size:
            out.append(MISS)
            continue
        at = 0
        for v in vs:
            copy_bytes(v, slot[at : at + len(v)])
            at += len(v)
        out.append(size)
    return out


def _get_one(engine: Any, key: str, slot: memoryview) -> int:
    try:
        return int(engine.batch_get_into([key], [slot])[0])
    except ValueError:
        return MISS


class StagedParts:
    """:meth:`PoolEngine.batch_put_from_parts` and :meth:`PoolEngine.batch_get_into_parts`
    for an engine that moves whole buffers only: through one reused staging area (one
    copy each way beyond the engine's own)."""

    _parts_staging: StagingPages | None = None

    def _staging_pages(self) -> StagingPages:
        if self._parts_staging is None:
            self._parts_staging = StagingPages()
        return self._parts_staging

    def batch_put_from_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        if not keys:
            return []
        return put_from_parts(self, keys, parts, self._staging_pages(), parents=parents)

    def batch_get_into_parts(
        self, keys: Sequence[str], parts: Sequence[Sequence[Any]]
    ) -> list[int]:
        if not keys:
            return []
        return get_into_parts(self, keys, parts, self._staging_pages())
