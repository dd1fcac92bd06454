from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvpool.errors import ChecksumMismatch, ConfigError, NoSpace, ObjectNotFound
from kvpool.storage.ssd import HEADER_SIZE, SsdStore

KEY = "0123456789abcdef0123456789abcdef"


def object_file(root: Path, key: str) -> Path:
    return root / key[:2] / key


def test_put_get_and_read_into_a_caller_buffer(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    value = np.arange(1000, dtype=np.int32)
    store.put(KEY, value)
    assert KEY in store and len(store) == 1
    assert store.value_size(KEY) == 4000
    out = np.zeros(1000, dtype=np.int32)
    assert store.read_into(KEY, out) == 4000
    np.testing.assert_array_equal(out, value)
    assert store.get(KEY) == value.tobytes()
    assert store.used_bytes == HEADER_SIZE + 4000
    assert store.stats.writes == 1 and store.stats.reads == 2


def test_empty_value_round_trips(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1024)
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_overwrite_replaces_value_and_accounting(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"a" * 100)
    store.put(KEY, b"b" * 10)
    assert store.get(KEY) == b"b" * 10
    assert store.used_bytes == HEADER_SIZE + 10


def test_missing_object_is_a_counted_miss(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1024)
    with pytest.raises(ObjectNotFound):
        store.get(KEY)
    with pytest.raises(ObjectNotFound):
        store.read_into(KEY, bytearray(10))
    assert store.stats.misses == 2


def test_deleted_file_is_a_miss_and_leaves_the_index(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"x" * 100)
    object_file(tmp_path, KEY).unlink()
    with pytest.raises(ObjectNotFound):
        store.read_into(KEY, bytearray(100))
    assert KEY not in store and store.used_bytes == 0


def test_flipped_byte_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, bytes(range(256)) * 4)
    path = object_file(tmp_path, KEY)
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 500] ^= 0x01
    path.write_bytes(raw)
    with pytest.raises(ChecksumMismatch, match="checksum"):
        store.get(KEY)
    assert store.stats.corruptions == 1
    assert not path.exists() and KEY not in store and store.used_bytes == 0
    with pytest.raises(ObjectNotFound):
        store.get(KEY)


@pytest.mark.parametrize("keep", [0, 5, HEADER_SIZE, HEADER_SIZE + 99])
def test_truncated_file_is_a_counted_miss(tmp_path: Path, keep: int) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"y" * 100)
    path = object_file(tmp_path, KEY)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(ChecksumMismatch):
        store.read_into(KEY, bytearray(100))
    assert store.stats.corruptions == 1


def test_corrupted_header_magic_is_a_miss(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"z" * 10)
    path = object_file(tmp_path, KEY)
    path.write_bytes(b"JUNK" + path.read_bytes()[4:])
    with pytest.raises(ChecksumMismatch, match="magic"):
        store.get(KEY)


# ------------------------------------------------------------------ scan (re-announce)
def test_header_carries_the_pools_checksum_so_a_scan_needs_no_value(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    value = os.urandom(5000)
    store.put(KEY, value)
    again = SsdStore.open(tmp_path, 1 << 20)
    scan = again.scan()
    assert scan.entries == [(KEY, 5000, xxhash.xxh3_64_intdigest(value))]
    assert scan.dropped == 0 and scan.value_bytes == 5000
    assert again.get(KEY) == value


def test_scan_lists_oldest_first(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    for i, key in enumerate(["new", "old", "mid"]):
        store.put(key, bytes([i]) * 10)
    ages = {"old": 1_000, "mid": 2_000, "new": 3_000}
    for key, t in ages.items():
        os.utime(object_file(tmp_path, key), (t, t))
    assert [k for k, _, _ in SsdStore.open(tmp_path, 1 << 20).scan().entries] == [
        "old",
        "mid",
        "new",
    ]


@pytest.mark.parametrize("at", [0, 5, 13, 21])  # magic, length, checksum, header CRC
def test_scan_deletes_a_file_whose_header_is_corrupt(tmp_path: Path, at: int) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"h" * 100)
    store.put("intact", b"i" * 100)
    path = object_file(tmp_path, KEY)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(raw)
    again = SsdStore.open(tmp_path, 1 << 20)
    scan = again.scan()
    assert [k for k, _, _ in scan.entries] == ["intact"]
    assert scan.dropped == 1 and scan.dropped_bytes == HEADER_SIZE + 100
    assert again.stats.bad_headers == 1
    assert not path.exists() and KEY not in again
    assert again.used_bytes == HEADER_SIZE + 100


def test_scan_drops_files_of_the_old_format(tmp_path: Path) -> None:
    # "KVS1" | length u64 | crc32 u32: no pool checksum, so it cannot be re-announced
    value = b"old format" * 10
    path = object_file(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(struct.pack("!4sQI", b"KVS1", len(value), zlib.crc32(value)) + value)
    store = SsdStore.open(tmp_path, 1 << 20)
    assert store.scan().entries == [] and not path.exists()
    with pytest.raises(ObjectNotFound):
        store.get(KEY)


def test_scan_lists_a_corrupt_value_whose_read_is_then_a_miss(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"v" * 1000)
    path = object_file(tmp_path, KEY)
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 999] ^= 0x01
    path.write_bytes(raw)
    assert [k for k, _, _ in store.scan().entries] == [KEY]  # headers only: values unread
    with pytest.raises(ChecksumMismatch):
        store.get(KEY)
    assert not path.exists()


def test_scan_forgets_files_deleted_behind_its_back(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"x" * 10)
    object_file(tmp_path, KEY).unlink()
    scan = store.scan()
    assert scan.entries == [] and scan.dropped == 0
    assert KEY not in store and store.used_bytes == 0


def test_bytes_that_no_longer_match_the_expected_checksum_are_not_written(
    tmp_path: Path,
) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    value = b"w" * 64
    store.put(KEY, value, expect=xxhash.xxh3_64_intdigest(value))
    assert store.get(KEY) == value
    with pytest.raises(ChecksumMismatch):
        store.put(KEY, b"x" * 64, expect=xxhash.xxh3_64_intdigest(value))
    assert store.get(KEY) == value  # the old copy stays, the changed one was refused
    assert store.used_bytes == HEADER_SIZE + 64


def test_size_cap_is_never_exceeded(tmp_path: Path) -> None:
    limit = 10 * (HEADER_SIZE + 1000)
    store = SsdStore.open(tmp_path, limit)
    for i in range(10):
        store.put(f"k{i}", b"v" * 1000)
    with pytest.raises(NoSpace, match="full"):
        store.put("k10", b"v" * 1000)
    assert store.stats.rejected_full == 1
    assert store.used_bytes == limit
    assert sum(f.stat().st_size for f in tmp_path.rglob("k*") if f.is_file()) == limit
    assert store.remove("k0") and not store.remove("k0")
    store.put("k10", b"v" * 1000)  # the space came back


def test_concurrent_puts_respect_the_cap(tmp_path: Path) -> None:
    limit = 5 * (HEADER_SIZE + 4096)
    store = SsdStore.open(tmp_path, limit)
    errors: list[Exception] = []

    def put(i: int) -> None:
        try:
            store.put(f"c{i}", b"q" * 4096)
        except NoSpace as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(store) == 5 and len(errors) == 7
    assert store.used_bytes == limit


def test_reopen_finds_existing_objects_and_drops_temp_files(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path, 1 << 20)
    store.put(KEY, b"persist")
    (tmp_path / ".tmp" / "half-written").write_bytes(b"partial")
    again = SsdStore.open(tmp_path, 1 << 20)
    assert again.keys() == [KEY]
    assert again.get(KEY) == b"persist"
    assert not (tmp_path / ".tmp" / "half-written").exists()


def test_unusable_paths_are_config_errors(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="ssd_offload_path"):
        SsdStore.open(a_file, 1024)
    with pytest.raises(ConfigError, match="ssd_offload_path"):
        SsdStore.open(a_file / "below", 1024)
    with pytest.raises(ConfigError, match="positive"):
        SsdStore.open(tmp_path / "ok", 0)


def test_invalid_keys_cannot_escape_the_directory(tmp_path: Path) -> None:
    store = SsdStore.open(tmp_path / "ssd", 1024)
    for bad in ("../evil", "a/b", "", ".hidden"):
        with pytest.raises(ValueError, match="invalid SSD object key"):
            store.put(bad, b"x")


def test_a_full_disk_is_a_counted_failure_not_a_crash(tmp_path: Path) -> None:
    # RLIMIT_FSIZE makes the kernel fail the write with EFBIG, as a full disk fails
    # with ENOSPC; run it in a child so the limit does not touch the test runner.
    code = f"""
import resource, signal
from pathlib import Path
from kvpool.errors import NoSpace
from kvpool.storage.ssd import SsdStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
store = SsdStore.open({str(tmp_path)!r}, 1 << 30)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
store.put("small", b"s" * 1000)
try:
    store.put("big", b"b" * (1 << 20))
except NoSpace as exc:
    print("NoSpace:", exc)
assert store.stats.write_failures == 1, store.stats
assert "big" not in store and store.get("small") == b"s" * 1000
assert store.used_bytes == {HEADER_SIZE} + 1000
assert not any(Path({str(tmp_path)!r}, ".tmp").iterdir())
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "NoSpace: SSD write of big failed" in out.stdout
    assert out.stdout.strip().endswith("ok")
