"""Block keys: chained content hashes of token-id chunks,
``key(i) = H(key(i-1) | tokens of chunk i)`` and ``key(-1) = H(namespace)``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "KEY_BYTES",
    "BlockKey",
    "KeyNamespace",
    "cache_group_key",
    "chunk_keys",
    "group_key",
    "layer_key",
]

KEY_BYTES = 16
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class BlockKey:
    """The content key of one full chunk of tokens and everything before it."""

    digest: bytes

    def __post_init__(self) -> None:
        if len(self.digest) != KEY_BYTES:
            raise ValueError(f"BlockKey digest must be {KEY_BYTES} bytes, got {len(self.digest)}")

    @property
    def hex(self) -> str:
        """The key as 32 lowercase hex digits: its name in the pool and on the wire."""
        return self.digest.hex()

    @classmethod
    def from_hex(cls, text: str) -> BlockKey:
        return cls(bytes.fromhex(text))

    def __str__(self) -> str:
        return self.hex

    def __repr__(self) -> str:
        return f"BlockKey({self.hex[:12]}…)"


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything besides the tokens that decides whether two KV chunks are interchangeable."""

    model: str
    kv_dtype: str
    chunk_size: int
    layout: str = "default"
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")

    def root(self) -> BlockKey:
        """The key the chain starts from: a hash of every namespace field, length-prefixed."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvpool-ns-v1")
        for field in (self.model, self.kv_dtype, self.layout, self.tenant):
            raw = field.encode("utf-8")
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        h.update(struct.pack("<III", self.chunk_size, self.tp_rank, self.tp_size))
        return BlockKey(h.digest())

    def for_rank(self, tp_rank: int) -> KeyNamespace:
        """The same namespace for another TP rank (a chunk is a hit only if all ranks hold it)."""
        return KeyNamespace(
            self.model,
            self.kv_dtype,
            self.chunk_size,
            self.layout,
            tp_rank,
            self.tp_size,
            self.tenant,
        )


# Rules:
# - Only full chunks are keyed; a trailing partial chunk has no key.
# - The namespace (model, KV dtype, chunk size, KV layout, TP rank/size, tenant) seeds the
#   chain, so the same tokens under another model or layout never share a key.
# - H is BLAKE2b-128 from the standard library over a fixed little-endian encoding, so keys
#   are identical across processes, machines and PYTHONHASHSEED values.  Python's ``hash``
#   is never used: a per-process hash seed is exactly what made peer projects miss across nodes.
#   BLAKE2b rather than a non-cryptographic hash because a key collision would serve another
#   request's KV, and 128 bits of a cryptographic hash make that a non-event even against a
#   tenant crafting prompts.
def chunk_keys(
    tokens: Sequence[int], namespace: KeyNamespace, parent: BlockKey | None = None
) -> list[BlockKey]:
    """Keys of every full chunk of ``tokens``, chained from ``parent`` (or the namespace root).

    ``parent`` lets a caller extend a chain it already computed without rehashing the prefix.
    """
    size = namespace.chunk_size
    prev = parent if parent is not None else namespace.root()
    keys: list[BlockKey] = []
    fmt = struct.Struct(f"<{size}I")
    for start in range(0, len(tokens) - size + 1, size):
        chunk = tokens[start : start + size]
        try:
            raw = fmt.pack(*chunk)
        except struct.error as exc:
            raise ValueError(f"token ids must be integers in [0, {_MAX_TOKEN_ID}]: {exc}") from None
        h = hashlib.blake2b(prev.digest, digest_size=KEY_BYTES, person=b"kvpool-chunk-v1")
        h.update(raw)
        prev = BlockKey(h.digest())
        keys.append(prev)
    return keys


# - One chunk may be stored as several objects, one per KV-head group (the store connector):
#   :func:`group_key` derives group ``g``'s key from the chunk key under its own
#   personalisation, so it never equals a chunk key nor another group's key, and it does not
#   depend on the TP layout of whoever computes it.  (The ``tp_rank``/``tp_size`` fields seed
#   per-rank chains instead: a layout-bound namespace, kept for callers that want one.)
def group_key(key: BlockKey, group: int) -> BlockKey:
    """The key of KV-head group ``group`` of chunk ``key`` (independent of any TP layout)."""
    return _derived(key, group, "group", b"kvpool-group-v1")


# - With layer-wise objects (the store connector's ``use_layerwise``) each layer of a chunk's
#   group is an object of its own, so a load can hand vLLM layer N while layer N+1 is still
#   being read.  :func:`layer_key` derives it under a third personalisation: never equal to a
#   chunk key, a group key or another layer's key.
def layer_key(key: BlockKey, layer: int) -> BlockKey:
    """The key of layer ``layer`` of the object ``key`` (a chunk's or a group's)."""
    return _derived(key, layer, "layer", b"kvpool-layer-v1")


# - A hybrid model (sliding-window, linear-attention or Mamba layers beside full attention)
#   has several of vLLM's KV cache groups, each with its own blocks: one chunk is then an
#   object family per group.  :func:`cache_group_key` derives group ``g``'s chunk key under a
#   fourth personalisation, before any KV-head group or layer split; the namespace's layout
#   names every group's spec, so a model change is another chain altogether.
def cache_group_key(key: BlockKey, cache_group: int) -> BlockKey:
    """The key of chunk ``key`` in KV cache group ``cache_group`` of a hybrid model."""
    return _derived(key, cache_group, "cache group", b"kvpool-kvgrp-v1")


def _derived(key: BlockKey, index: int, what: str, person: bytes) -> BlockKey:
    """``key``'s ``index``-th sub-key under its own BLAKE2b personalisation."""
    if not 0 <= index <= _MAX_TOKEN_ID:
        raise ValueError(f"{what} must be in [0, {_MAX_TOKEN_ID}], got {index}")
    h = hashlib.blake2b(key.digest, digest_size=KEY_BYTES, person=person)
    h.update(struct.pack("<I", index))
    return BlockKey(h.digest())
