"""Which prompt blocks an instance's own cache (or the pool) holds, from KV events (pure).

A block is known by a content key chained over the token ids up to it, never by vLLM's
block hash, which depends on each instance's hash seed; so a request's blocks, each
instance's and the pool's agree.  Bounded to ``max_blocks`` (the oldest go).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["BlockIndex", "IndexStats", "content_keys"]

_ROOT = b"\x00" * 16


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16, person=b"kvpool-route-v1")
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


def content_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The content key of every full block of ``token_ids`` (the last partial one has none)."""
    keys: list[bytes] = []
    parent = _ROOT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _chain(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


@dataclass(slots=True)
class IndexStats:
    stored: int = 0  # blocks learned
    removed: int = 0  # blocks forgotten on the source's word
    unchained: int = 0  # stored blocks whose parent was unknown: not indexable
    dropped: int = 0  # forgotten to stay within max_blocks
    cleared: int = 0  # AllBlocksCleared, or a reset


# Rules:
# - A stored block is indexed only when its parent is (or it has none): its content key is
#   the parent's chained with its tokens.  A parent the index never saw or already dropped
#   leaves the block out; a prompt never matches past it anyway.
# - vLLM may store the same tokens under several hashes (one per KV cache group, a medium
#   each); a content key stays held while any of its hashes is.
# - At most max_blocks hashes are kept: the least recently stored go first (their blocks
#   count as not held; a request routed on that is merely a miss).
class BlockIndex:
    """The blocks one source holds, by content key."""

    def __init__(self, max_blocks: int = 200_000) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be positive, got {max_blocks}")
        self.max_blocks = max_blocks
        self._by_hash: OrderedDict[bytes | int, bytes] = OrderedDict()
        self._held: dict[bytes, int] = {}  # content key -> hashes that hold it
        self.block_size: int | None = None
        self.stats = IndexStats()

    def __len__(self) -> int:
        """Distinct blocks held."""
        return len(self._held)

    @property
    def hashes(self) -> int:
        return len(self._by_hash)

    def apply(self, events: Iterable[BlockStored | BlockRemoved | AllBlocksCleared]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                for block_hash in event.block_hashes:
                    if self._forget(block_hash):
                        self.stats.removed += 1
            else:
                self.clear()

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if size <= 0 or len(event.token_ids) != size * len(event.block_hashes):
            raise ValueError(
                f"BlockStored: {len(event.token_ids)} token ids for"
                f" {len(event.block_hashes)} blocks of {size}"
            )
        self.block_size = size
        if event.parent_block_hash is None:
            parent: bytes | None = _ROOT
        else:
            parent = self._by_hash.get(event.parent_block_hash)
        for i, block_hash in enumerate(event.block_hashes):
            if parent is None:
                self.stats.unchained += 1
                continue
            key = _chain(parent, event.token_ids[i * size : (i + 1) * size])
            old = self._by_hash.pop(block_hash, None)
            if old is not None:
                self._release(old)
            self._by_hash[block_hash] = key
            self._held[key] = self._held.get(key, 0) + 1
            self.stats.stored += 1
            parent = key
        while len(self._by_hash) > self.max_blocks:
            _, key = self._by_hash.popitem(last=False)
            self._release(key)
            self.stats.dropped += 1

    def _forget(self, block_hash: bytes | int) -> bool:
        key = self._by_hash.pop(block_hash, None)
        if key is None:
            return False
        self._release(key)
        return True

    def _release(self, key: bytes) -> None:
        left = self._held.get(key, 0) - 1
        if left > 0:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def clear(self) -> None:
        """Forget everything (AllBlocksCleared, a restarted source, a stream not trusted)."""
        self._by_hash.clear()
        self._held.clear()
        self.stats.cleared += 1

    def holds(self, key: bytes) -> bool:
        return key in self._held

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (a prompt's blocks, in order) are held from the first on."""
        n = 0
        for key in keys:
            if key not in self._held:
                break
            n += 1
        return n

    def forget(self, keys: Iterable[bytes]) -> int:
        """Forget blocks by content key (a prediction that did not hold: the source no
        longer has them); how many were held."""
        gone = {key for key in keys if key in self._held}
        if not gone:
            return 0
        for block_hash in [h for h, key in self._by_hash.items() if key in gone]:
            self._forget(block_hash)
        return len(gone)
