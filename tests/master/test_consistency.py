"""Reads racing evictions, removals and the SSD tier never return another object's bytes."""

from __future__ import annotations

import hashlib
import threading
import urllib.request
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.errors import KVPoolError, ObjectNotFound
from kvpool.protocol import messages as m
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import files_by_key
from kvpool.testing.processes import start_master
from tests.pool_support import ssd_flags
from tests.threads import run_threads


def value_of(key: str, size: int = 64 * 1024) -> bytes:
    seed = hashlib.blake2b(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_reads_racing_evictions_and_removals_return_only_their_own_bytes() -> None:
    keys = [f"k{i}" for i in range(120)]  # 7.5 MiB of values into a 2 MiB segment
    wrong: list[str] = []
    served = [0]
    with start_master("--segment_size", "2MiB", "--default_kv_lease_ttl", "50") as master:

        def writer(offset: int) -> None:
            with Client(master.address) as c:
                for i in range(400):
                    key = keys[(i * 7 + offset) % len(keys)]
                    try:
                        if i % 5 == 0:
                            c.remove(key)
                        else:
                            c.put(key, value_of(key))
                    except KVPoolError:
                        pass  # NoSpace / Busy under churn are fine; wrong bytes are not

        def reader(offset: int) -> None:
            with Client(master.address) as c:
                for i in range(400):
                    key = keys[(i * 13 + offset) % len(keys)]
                    try:
                        got = c.get(key)
                    except ObjectNotFound:
                        continue
                    served[0] += 1
                    if got != value_of(key):
                        wrong.append(key)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(2)]
        threads += [threading.Thread(target=reader, args=(n,)) for n in range(2)]
        assert not run_threads(threads, 120)
    assert wrong == []
    assert served[0] > 50  # the race really happened with reads that hit


def test_corrupt_memory_copy_is_a_miss_and_leaves_the_pool(tmp_path: Path) -> None:
    with start_master("--segment_size", "4MiB") as master, Client(master.address) as c:
        c.put("good", value_of("good"))
        c.put("bad", value_of("bad"))
        placement = c.call(m.Get("test", "bad"))
        assert isinstance(placement, m.Placement) and placement.shm_name
        c.call(m.Release("test", ["bad"]))
        with Segment.attach(placement.shm_name) as seg:
            view = seg.view(placement.offset + 100, 1)
            view[0] ^= 0xFF
            del view
        with pytest.raises(ObjectNotFound):
            c.get("bad")
        assert c.corrupt_reads == 1
        with pytest.raises(ObjectNotFound):
            c.get("bad")  # still a miss, never the wrong bytes
        assert not c.remove("bad")  # the read that found it corrupt had it dropped
        c.put("bad", value_of("bad"))
        assert c.get("bad") == value_of("bad")
        assert c.get("good") == value_of("good")


def test_ssd_tier_keeps_evicted_objects_and_corruption_is_a_miss(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    with (
        start_master(*ssd_flags(ssd)) as master,
        Client(master.address) as c,
    ):
        keys = [f"s{i}" for i in range(40)]  # 2.5 MiB: most must go to SSD
        for key in keys:
            c.put(key, value_of(key))
        snap = c.stats()
        assert snap["tiers"]["ssd"]["objects"] > 0
        assert snap["stats"]["offloads"] > 0
        for key in keys:
            assert c.get(key) == value_of(key)  # every one readable, memory or SSD
        # corrupt one SSD file and truncate another: both are misses, never wrong bytes
        files = sorted((k, p) for k, p in files_by_key(ssd).items() if k.startswith("s"))
        assert len(files) >= 3
        data = bytearray(files[0][1].read_bytes())
        data[-1] ^= 0xFF
        files[0][1].write_bytes(bytes(data))
        files[1][1].write_bytes(files[1][1].read_bytes()[:100])
        files[2][1].unlink()  # and one is gone behind the pool's back
        for key, _ in files[:3]:
            try:
                got = c.get(key)
            except ObjectNotFound:
                continue
            raise AssertionError(f"{key}: corrupt SSD object served ({len(got)} bytes)")
        # the reads that found them corrupt had them dropped: stored again, good bytes
        bad = [key for key, _ in files[:3]]
        assert c.batch_exists(bad) == [False, False, False]
        for key in bad:
            c.put(key, value_of(key))
            assert c.get(key) == value_of(key)
        with urllib.request.urlopen(f"http://{master.address}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert "kvpool_offloads_total" in text
        corrupt = [ln for ln in text.splitlines() if ln.startswith("kvpool_ssd_corrupt_reads ")]
        assert corrupt and float(corrupt[0].split()[1]) == 2
