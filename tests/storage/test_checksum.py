"""The one end-to-end checksum: xxh3-64, the same for every buffer type and in SSD headers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import xxhash

from kvpool.storage.checksum import checksum
from kvpool.storage.ssd import SsdStore


def test_checksum_is_xxh3_64_of_the_bytes_whatever_the_buffer() -> None:
    value = bytes(range(256)) * 17
    want = xxhash.xxh3_64_intdigest(value)
    assert checksum(value) == want
    assert checksum(bytearray(value)) == want
    assert checksum(memoryview(value)) == want
    assert checksum(np.frombuffer(value, dtype=np.uint8)) == want
    assert checksum(b"") == xxhash.xxh3_64_intdigest(b"")


def test_ssd_headers_carry_the_same_checksum(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    value = b"kv" * 1000
    store.put("k", value, expect=checksum(value))
    assert store.scan().entries == [("k", len(value), checksum(value))]
