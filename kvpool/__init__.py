"""kvpool: a KV-cache pool for LLM serving with prefill/decode disaggregation.

The public API is what ``__all__`` lists.  ``import kvpool`` is cheap: the clients are
imported on first use, and nothing here imports vLLM.  The words the code and the docs
use are defined, each in one sense, in the glossary above ``__all__``.
"""

from __future__ import annotations

import typing

from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys
from kvpool.errors import (
    AuthError,
    ChecksumMismatch,
    ConfigError,
    KVPoolError,
    NoSpace,
    NotLeader,
    ObjectBusy,
    ObjectNotFound,
    Overloaded,
    PeerTimeout,
    PoolError,
    ProtocolError,
    QuotaExceeded,
    StaleWrite,
    TransferError,
    UnknownClient,
    UnknownSegment,
    WriteConflict,
)

if typing.TYPE_CHECKING:
    from kvpool.client.async_client import AsyncClient
    from kvpool.client.client import Client
    from kvpool.embedded import EmbeddedPool
    from kvpool.security.tls import TLSConfig

__version__ = "0.1.0"

# Glossary (the words the code and the docs use, each in one sense):
#
# block
#     vLLM's unit of KV cache: the keys and values of ``block_size`` tokens, in every
#     layer.  The connectors move blocks; the pool never sees vLLM's block ids.
# chunk
#     A run of ``block_size`` token ids, the unit that is keyed: each full chunk gets a
#     :class:`BlockKey` chained to the chunk before it (:func:`chunk_keys`); a trailing
#     partial chunk has no key.
# object
#     What the pool stores under one key: the bytes of one chunk's KV on one rank (all its
#     layers), written once and immutable; READY once its put ended, invisible before.
# page
#     One block's bytes in one layer of a KV tensor: the connectors' zero-copy view over
#     vLLM's caches.  An object is its block's pages, back to back.
# segment
#     A region of storage a process contributes to the pool (a shared-memory region, or a
#     node's SSD capacity), registered with the master under a segment id; clients read and
#     write it directly, never through the master.
# tier
#     The kind of storage a segment is: ``memory`` or ``ssd``.  Objects evicted from memory
#     may be demoted to the SSD tier.
# extent
#     A contiguous ``(offset, size)`` range inside a segment: where one object lives.
# lease
#     A time-limited hold that keeps an object in place: a read lease while a get copies
#     the bytes (released when the read ends), a writer's lease on a pending put.  Every
#     lease expires (``default_kv_lease_ttl``), so a dead client holds nothing for long.
# pin
#     A hold a *request* takes on the objects its lookup found, under an owner id, so they
#     are not evicted before it loads them; released when they are loaded, the request
#     ends, or the pin's TTL passes.
__all__ = [
    "AsyncClient",
    "AuthError",
    "BlockKey",
    "ChecksumMismatch",
    "Client",
    "ConfigError",
    "EmbeddedPool",
    "KVPoolError",
    "KeyNamespace",
    "NoSpace",
    "NotLeader",
    "ObjectBusy",
    "ObjectNotFound",
    "Overloaded",
    "PeerTimeout",
    "PoolError",
    "ProtocolError",
    "QuotaExceeded",
    "StaleWrite",
    "TLSConfig",
    "TransferError",
    "UnknownClient",
    "UnknownSegment",
    "WriteConflict",
    "__version__",
    "chunk_keys",
]

# Imported on first use: the client brings numpy, msgspec and xxhash, the embedded pool
# the master and prometheus_client, and a connector or a CLI command may need neither.
_LAZY = {
    "AsyncClient": "kvpool.client.async_client",
    "Client": "kvpool.client.client",
    "EmbeddedPool": "kvpool.embedded",
    "TLSConfig": "kvpool.security.tls",
}


def __getattr__(name: str) -> typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
