"""A process's own storage: announcing its SSD tier to an index that does not know it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kvpool.core.objects import IndexConfig
from kvpool.core.registry import Tier
from kvpool.embedded import EmbeddedPool
from kvpool.errors import ProtocolError
from kvpool.node.storage import (
    RESTORE_BATCH,
    RESTORE_BATCH_BYTES,
    LocalStorage,
    RestoreEntry,
    restore_batches,
    restore_in_batches,
)
from kvpool.protocol import messages as m
from kvpool.protocol.codec import DEFAULT_MAX_BODY
from kvpool.storage.checksum import checksum
from kvpool.storage.ssd import header_size, object_path


def test_restore_batches_are_bounded_in_entries_and_key_bytes() -> None:
    short = [(f"k{i}", 0, 10, i) for i in range(10_000)]
    assert [len(b) for b in restore_batches(short)] == [4096, 4096, 1808]
    long = [("x" * 100_000 + str(i), 0, 10, i) for i in range(30)]
    batches = list(restore_batches(long))
    assert sum(len(b) for b in batches) == 30 and len(batches) > 1
    for b in batches:
        assert sum(len(k) for k, *_ in b) <= RESTORE_BATCH_BYTES


def test_a_full_batch_of_the_longest_ssd_keys_fits_one_frame() -> None:
    entries = [(f"{i:0200d}", 1 << 40, 1 << 30, (1 << 64) - 1) for i in range(RESTORE_BATCH)]
    (batch,) = restore_batches(entries)
    frame = m.MASTER_REQUEST_CODEC.encode(m.Restore("node-x", "node-x/ssd", batch))  # raises if not
    assert len(frame) < DEFAULT_MAX_BODY // 2


def test_a_short_answer_to_a_restore_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="answers"):
        restore_in_batches([("a", 0, 1, 1), ("b", 0, 1, 1)], lambda batch: [True])


def test_announce_ssd_sends_intact_files_and_deletes_what_is_refused_or_corrupt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = LocalStorage("n", 0, ssd_path=str(tmp_path), ssd_limit=1 << 20)
    assert first.ssd is not None
    values = {f"k{i}": os.urandom(1000 + i) for i in range(5)}
    for key, value in values.items():
        first.ssd.put(key, value)
    first.close()
    bad_header = object_path(tmp_path, "k3")
    raw = bytearray(bad_header.read_bytes())
    raw[header_size("k3") - 1] ^= 0xFF
    bad_header.write_bytes(raw)

    # a restarted process: it knows nothing but its files
    again = LocalStorage("n", 0, ssd_path=str(tmp_path), ssd_limit=1 << 20)
    assert again.ssd is not None
    sent: list[list[RestoreEntry]] = []

    def send(batch: list[RestoreEntry]) -> list[bool]:
        sent.append(batch)
        return [key != "k1" for key, *_ in batch]  # the index refuses k1

    with caplog.at_level(logging.INFO, logger="kvpool.storage"):
        done = again.announce_ssd(send, batch=2)
    assert all(len(b) <= 2 for b in sent)
    announced = {key: (size, csum) for b in sent for key, _, size, csum in b}
    assert set(announced) == {"k0", "k1", "k2", "k4"}  # k3's header failed: never sent
    for key, (size, csum) in announced.items():
        assert size == len(values[key]) and csum == checksum(values[key])
    assert done.restored == 3 and done.dropped == 2
    assert done.restored_bytes == sum(len(values[k]) for k in ("k0", "k2", "k4"))
    assert sorted(again.ssd.keys()) == ["k0", "k2", "k4"]
    assert not object_path(tmp_path, "k1").exists() and not bad_header.exists()
    headers = sum(header_size(k) for k in ("k0", "k2", "k4"))
    assert again.ssd.used_bytes == done.restored_bytes + headers
    assert f"restored 3 SSD objects ({done.restored_bytes} bytes), dropped 2" in caplog.text
    again.close()


def test_embedded_pool_serves_its_previous_ssd_objects_after_a_restart(tmp_path: Path) -> None:
    config = IndexConfig(enable_offload=True)
    values = {f"e{i}": os.urandom(16 * 1024) for i in range(24)}
    pool = EmbeddedPool(64 * 1024, config=config, ssd_path=str(tmp_path), ssd_limit=4 << 20)
    for key, value in values.items():
        pool.put(key, value)
    on_ssd = [
        k for k in values if (loc := pool.service.index.location_of(k)) and loc.tier is Tier.SSD
    ]
    assert len(on_ssd) >= 16  # 24 objects, a segment for 4
    pool.close()

    again = EmbeddedPool(64 * 1024, config=config, ssd_path=str(tmp_path), ssd_limit=4 << 20)
    try:
        assert again.batch_exists(on_ssd) == [True] * len(on_ssd)
        for key in on_ssd:
            assert again.get(key) == values[key]
        # new objects still find room: nothing old is leaked or double-counted
        for i in range(8):
            again.put(f"new{i}", os.urandom(16 * 1024))
        again.service.index.check()
    finally:
        again.close()
