"""kvpool: a KV-cache pool for LLM serving with prefill/decode disaggregation.

The public API is what ``__all__`` lists; everything else is internal.
"""

from __future__ import annotations

from kvpool.core.keys import BlockKey, KeyNamespace, chunk_keys
from kvpool.errors import (
    ChecksumMismatch,
    ConfigError,
    KVPoolError,
    NoSpace,
    ObjectBusy,
    ObjectNotFound,
    PeerTimeout,
    PoolError,
    ProtocolError,
    TransferError,
)

__version__ = "0.1.0"

__all__ = [
    "BlockKey",
    "ChecksumMismatch",
    "ConfigError",
    "KVPoolError",
    "KeyNamespace",
    "NoSpace",
    "ObjectBusy",
    "ObjectNotFound",
    "PeerTimeout",
    "PoolError",
    "ProtocolError",
    "TransferError",
    "__version__",
    "chunk_keys",
]
