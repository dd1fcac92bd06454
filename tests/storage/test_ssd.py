from __future__ import annotations

import os
import struct
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kvpool.errors import ChecksumMismatch, ConfigError, NoSpace, ObjectNotFound
from kvpool.storage.ssd import SsdStore, header_size, object_path
from kvpool.storage.ssd_format import FIXED_HEADER_SIZE
from kvpool.testing.fresh import run_python
from tests.threads import run_threads

KEY = "0123456789abcdef0123456789abcdef"


def object_file(root: Path, key: str) -> Path:
    return object_path(root, key)


def old_object_file(root: Path, key: str) -> Path:
    """Where the KVS1 and KVS2 formats kept a key: named by the key itself."""
    return root / key[:2] / key


HEADER_SIZE = header_size(KEY)  # every key of these tests but the odd ones is this long


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


# magic, key length, value length, value checksum, header CRC, the key
@pytest.mark.parametrize("at", [0, 5, 13, 21, 25, FIXED_HEADER_SIZE + 3])
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
    assert again.used_bytes == header_size("intact") + 100


def test_scan_drops_files_of_the_old_format(tmp_path: Path) -> None:
    # "KVS1" | length u64 | crc32 u32: no pool checksum, so it cannot be re-announced
    value = b"old format" * 10
    path = old_object_file(tmp_path, KEY)
    path.parent.mkdir(parents=True)
    path.write_bytes(struct.pack("!4sQI", b"KVS1", len(value), zlib.crc32(value)) + value)
    store = SsdStore.open(tmp_path, 1 << 20)
    assert store.scan().entries == [] and not path.exists()
    with pytest.raises(ObjectNotFound):
        store.get(KEY)


def test_scan_drops_kvs2_files_once_and_gives_their_space_back(tmp_path: Path) -> None:
    # "KVS2" | length u64 | xxh3 u64 | crc32 u32, named by the key: no key in the header
    value = b"kvs2" * 25
    fields = struct.pack("!4sQQ", b"KVS2", len(value), xxhash.xxh3_64_intdigest(value))
    raw = fields + struct.pack("!I", zlib.crc32(fields)) + value
    paths = [old_object_file(tmp_path, key) for key in (KEY, "plain-key")]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    store = SsdStore.open(tmp_path, 1 << 20)
    assert store.keys() == [] and store.used_bytes == 2 * len(raw)  # counted until dropped
    scan = store.scan()
    assert scan.entries == [] and scan.dropped == 2 and scan.dropped_bytes == 2 * len(raw)
    assert not any(p.exists() for p in paths) and store.used_bytes == 0
    store.put("plain-key", value)  # the key works again, in the new format
    assert SsdStore.open(tmp_path, 1 << 20).scan().entries == [
        ("plain-key", len(value), xxhash.xxh3_64_intdigest(value))
    ]


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
    limit = 10 * (header_size("k00") + 1000)  # keys of one length: headers of one size
    store = SsdStore.open(tmp_path, limit)
    for i in range(10):
        store.put(f"k{i:02d}", b"v" * 1000)
    with pytest.raises(NoSpace, match="full"):
        store.put("k10", b"v" * 1000)
    assert store.stats.rejected_full == 1
    assert store.used_bytes == limit
    assert sum(f.stat().st_size for f in tmp_path.rglob("*") if f.is_file()) == limit
    assert store.remove("k00") and not store.remove("k00")
    store.put("k10", b"v" * 1000)  # the space came back


def test_concurrent_puts_respect_the_cap(tmp_path: Path) -> None:
    limit = 5 * (header_size("c00") + 4096)
    store = SsdStore.open(tmp_path, limit)
    errors: list[Exception] = []

    def put(i: int) -> None:
        try:
            store.put(f"c{i:02d}", b"q" * 4096)
        except NoSpace as exc:
            errors.append(exc)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(12)]
    run_threads(threads, 30)
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


def test_no_key_escapes_the_directory(tmp_path: Path) -> None:
    """Keys that were refused once ("../evil", "a/b", "", ".hidden") are stored now, and
    still nothing is written outside the tier's directory."""
    root = tmp_path / "ssd"
    store = SsdStore.open(root, 1 << 16)
    for key in ("../evil", "a/b", "", ".hidden", "../../../../tmp/x"):
        store.put(key, b"x")
        assert object_path(root, key).parent.parent == root and store.get(key) == b"x"
    assert {p for p in tmp_path.rglob("*") if p.is_file()} <= set(root.rglob("*"))


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
assert store.used_bytes == {header_size("small")} + 1000
assert not any(Path({str(tmp_path)!r}, ".tmp").iterdir())
print("ok")
"""
    out = run_python(code, warnings="error", timeout_s=60)
    assert out.returncode == 0, out.stderr
    assert "NoSpace: SSD write of big failed" in out.stdout
    assert out.stdout.strip().endswith("ok")


# ------------------------------------------------------------- any key (issue 11, item 1)
# Keys a client may put: Mooncake/vllm-ascend keys carry "/" of model names and "@"/":"
# separators; unicode, very long keys, and names a file system treats specially.
ODD_KEYS = [
    "a/b",
    "model@tp:0",
    "Qwen/Qwen3-8B@pcp0@dcp0@tp3@pp0@9f86d081884c7d65",
    "ключ-κλειδί-鍵-🔑",
    "k" * 10_000,
    "..",
    ".",
    "../evil",
    "/etc/passwd",
    "",
    ".hidden",
    ".tmp",
    "a\x00b",
    "x" * 255 + "/" + "y",
]


def test_any_key_is_stored_under_a_safe_name_and_restored_with_its_key(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    store = SsdStore.open(root, 1 << 22)
    values = {key: f"value {i} ".encode() * (i + 1) for i, key in enumerate(ODD_KEYS)}
    values["plain"] = b"p" * 10
    for key, value in values.items():
        store.put(key, value)
    for key, value in values.items():
        assert key in store and store.get(key) == value
        assert store.value_size(key) == len(value)
    # every file lies inside the tier, one fan-out directory down, one file per key
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == len(values)
    assert all(p.parent.parent == root and p.parent.name != ".tmp" for p in files)
    assert store.used_bytes == sum(p.stat().st_size for p in files)

    again = SsdStore.open(root, 1 << 22)  # a restart knows only its files
    assert sorted(again.keys()) == sorted(values)
    scan = again.scan()
    assert scan.dropped == 0
    assert {k: (n, c) for k, n, c in scan.entries} == {
        k: (len(v), xxhash.xxh3_64_intdigest(v)) for k, v in values.items()
    }
    for key, value in values.items():
        assert again.get(key) == value
    for key in ODD_KEYS:
        assert again.remove(key) and key not in again
    assert again.keys() == ["plain"] and again.get("plain") == values["plain"]
    assert again.used_bytes == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
