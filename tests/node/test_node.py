"""Storage nodes as real processes: registration, failures, master restarts."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.config import load_node_config
from kvpool.errors import KVPoolError, ObjectNotFound
from kvpool.node.node import NodeService, node_id
from kvpool.storage.ssd import files_by_key, header_size, object_path
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.pool_support import ssd_node_config, tiers_of
from tests.waiting import wait_until


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[PoolProcess, PoolProcess]]:
    # the master hosts no segment, so every object lands on the node
    with (
        start_master("--segment_size", "0", "--client_ttl", "2") as master,
        start_node(node_config(tmp_path, master.address)) as node,
    ):
        c = Client(master.address)
        wait_until(lambda: c.stats()["tiers"]["memory"]["capacity"] > 0)
        c.close()
        yield master, node


def test_node_registers_and_serves_its_segment_over_tcp(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, _ = pool
    with Client(master.address, allow_shm=False) as c:
        value = os.urandom(300_000)
        c.put("k", value)
        assert c.get("k") == value
        clients = c.stats()["clients"]
        assert len(clients) == 1 and clients[0]["client_id"].startswith("node-127.0.0.1")


def test_same_host_client_uses_shared_memory(pool: tuple[PoolProcess, PoolProcess]) -> None:
    master, _ = pool
    with Client(master.address) as c:
        c.put("k", b"x" * 4096)
        assert c.get("k") == b"x" * 4096
        (path,) = c._paths.values()
        (route,) = set(path._routes.values())
        assert route == "shm"


def test_killed_node_keys_are_misses_at_once_and_gone_within_client_ttl(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    with Client(master.address, allow_shm=False, timeout_s=2) as c:
        for i in range(10):
            c.put(f"k{i}", b"v" * 1000)
        node.kill()
        started = time.monotonic()
        with pytest.raises(ObjectNotFound):
            c.get("k0")  # a failed read is a miss, and fast: no hang
        assert time.monotonic() - started < 2.5
        # the failed transfer dropped the node's objects from the index at once
        assert c.batch_exists([f"k{i}" for i in range(10)]) == [False] * 10
        wait_until(lambda: c.stats()["clients"] == [], timeout_s=5)


def test_silent_node_expires_after_client_ttl(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    with Client(master.address) as c:
        c.put("k", b"v")
        os.kill(node.pid, 19)  # SIGSTOP: alive but silent, no transfer fails
        try:
            wait_until(lambda: not c.exists("k"), timeout_s=10)
        finally:
            os.kill(node.pid, 18)  # SIGCONT so it can be stopped cleanly


def test_node_killed_during_puts_leaves_nothing_half_written(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    written: list[str] = []
    failed: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        with Client(master.address, allow_shm=False, timeout_s=2) as c:
            for i in range(2000):
                if stop.is_set():
                    return
                key = f"w{i}"
                try:
                    c.put(key, os.urandom(64 * 1024))
                    written.append(key)
                except KVPoolError:
                    failed.append(key)
                    if len(failed) > 5:
                        return

    t = threading.Thread(target=writer)
    t.start()
    wait_until(lambda: len(written) >= 20)
    node.kill()
    t.join(30)
    stop.set()
    assert not t.is_alive()
    assert failed, "the node died mid-stream, so some put must have failed"
    with Client(master.address) as c:
        snapshot = c.stats()
        assert snapshot["pending"] == 0
        assert snapshot["tiers"]["memory"]["used"] == 0
        assert not any(c.batch_exists(written + failed))


def test_restarted_master_gets_objects_re_announced_by_the_node(tmp_path: Path) -> None:
    # Every acknowledged put comes back, even one acknowledged just before the crash:
    # the master answers a put into a node's segment once the node has its catalog
    # entry, so there is no window of heartbeats to wait out.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ("--port", str(port), "--segment_size", "0", "--client_ttl", "5")
    master = start_master(*flags)
    with start_node(node_config(tmp_path, master.address, "64MiB")):
        values = {f"k{i}": os.urandom(8192) for i in range(300)}
        with Client(master.address) as c:
            wait_until(lambda: c.stats()["tiers"]["memory"]["capacity"] > 0)
            for key, value in values.items():
                c.put(key, value)
            master.kill()  # SIGKILL right after the last acknowledgement
        master = start_master(*flags)
        try:
            with Client(master.address) as c:
                wait_until(lambda: all(c.batch_exists(list(values))), timeout_s=20)
                for key, value in values.items():
                    assert c.get(key) == value, key
        finally:
            master.stop()


def test_a_put_over_tcp_needs_no_heartbeat_and_a_restarted_master_gets_it_back(
    tmp_path: Path,
) -> None:
    """A TCP put's write tells the node its key and checksum, so the master acknowledges
    it at once: here the node's heartbeat loop never runs, so nothing else could have
    told the node.  A master that restarts then gets the object re-announced; a noted
    entry whose bytes no longer match its checksum is not announced."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ("--port", str(port), "--segment_size", "0", "--client_ttl", "60")
    master = start_master(*flags)
    config = load_node_config(node_config(tmp_path, master.address, "8MiB"))
    node = NodeService(config, bind_host="127.0.0.1")
    try:
        node.storage.start()
        node._register()  # registered; its heartbeat loop is not started
        values = {f"t{i}": os.urandom(20_000) for i in range(20)}
        with Client(master.address, allow_shm=False, timeout_s=5) as c:
            for key, value in values.items():
                c.put(key, value)  # would time out waiting for a confirmation
            batch = {f"u{i}": os.urandom(3000) for i in range(8)}
            assert c.batch_put(list(batch), list(batch.values())) == [None] * 8  # as would this
            values.update(batch)
            assert c.get("t0") == values["t0"]
        assert node.catalog == {} and set(node.noted) == set(values)
        offset, size, csum, when = node.noted["t0"]
        node.noted["t0"] = (offset, size, csum ^ 1, when)  # as if overwritten since
        master.kill()
        master = start_master(*flags)

        def beat() -> bool:  # what the heartbeat loop does: a failed beat is retried
            with contextlib.suppress(KVPoolError):
                node.heartbeat_once()  # registers again, then re-announces what it holds
            return node.registrations == 2 and not node._announce_pending

        wait_until(beat, what="the node registered again and re-announced")
        with Client(master.address, allow_shm=False, timeout_s=5) as c:
            for key in values.keys() - {"t0"}:
                assert c.get(key) == values[key], key
            assert not c.exists("t0")
        assert set(node.catalog) == values.keys() - {"t0"} and node.noted == {}
    finally:
        node.stop()
        master.stop()


@contextlib.contextmanager
def ssd_node_client(tmp_path: Path, ssd: Path) -> Iterator[Client]:
    """A client of a master that holds no memory and of one node whose 1 MiB of memory
    offloads to an SSD tier under ``ssd``, once that tier is registered."""
    with start_master("--segment_size", "0", "--enable_offload=true") as master:
        config = ssd_node_config(tmp_path, master.address, ssd)
        with start_node(config), Client(master.address, allow_shm=False) as c:
            wait_until(lambda: c.stats()["tiers"]["ssd"]["capacity"] > 0)
            yield c


def test_node_ssd_tier_keeps_what_memory_evicts(tmp_path: Path) -> None:
    ssd = tmp_path / "node-ssd"
    with ssd_node_client(tmp_path, ssd) as c:
        values = {f"n{i}": os.urandom(64 * 1024) for i in range(40)}  # 2.5 MiB
        for key, value in values.items():
            c.put(key, value)
        snap = c.stats()
        assert snap["tiers"]["ssd"]["objects"] > 0 and snap["stats"]["offloads"] > 0
        for key in values:  # from the node's memory or its SSD tier, at once
            assert c.get(key) == values[key], key
        # removing an SSD object deletes the node's file too
        files = {k: p for k, p in files_by_key(ssd).items() if k.startswith("n")}
        assert files
        key = sorted(files)[0]
        assert c.remove(key)
        # the node's link thread deletes it: off the master's loop, soon after
        wait_until(lambda: not files[key].exists(), what="the node deleted the file")
        assert not c.exists(key)


def test_a_key_being_copied_to_ssd_is_never_a_miss(tmp_path: Path) -> None:
    # Every put past the node's 1 MiB of memory sends victims to its SSD tier, copied by
    # the node while the master serves others.  Reading each of the latest keys after
    # every put catches them mid-copy: the pool still holds their bytes, so every read
    # must return them, never "not found".
    rng = random.Random(26)
    ssd = tmp_path / "node-ssd"
    with ssd_node_client(tmp_path, ssd) as c:
        values: dict[str, bytes] = {}
        misses: list[str] = []
        for i in range(48):  # 3 MiB in all: the SSD tier (16 MiB) keeps everything
            key = f"m{i:02d}"
            values[key] = rng.randbytes(64 * 1024)
            c.put(key, values[key])
            recent = list(values)[-20:]
            for name in rng.sample(recent, len(recent)):
                try:
                    assert c.get(name) == values[name], f"{name}: wrong bytes"
                except ObjectNotFound:
                    misses.append(f"{name} after put {i}")
        snap = c.stats()
        assert snap["stats"]["offloads"] > 0 and snap["tiers"]["ssd"]["objects"] > 0
        assert misses == [], f"{len(misses)} misses for bytes the pool held: {misses[:5]}"


def flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x5A
    path.write_bytes(raw)


def test_restarted_master_gets_the_nodes_ssd_objects_re_announced(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ("--port", str(port), "--segment_size", "0", "--enable_offload=true")
    flags += ("--client_ttl", "5")
    ssd = tmp_path / "node-ssd"
    master = start_master(*flags)
    try:
        with start_node(ssd_node_config(tmp_path, master.address, ssd)) as node:
            values = {f"s{i:02d}": os.urandom(64 * 1024) for i in range(40)}  # 2.5 MiB
            with Client(master.address, allow_shm=False) as c:
                wait_until(lambda: c.stats()["tiers"]["ssd"]["capacity"] > 0)
                for key, value in values.items():
                    c.put(key, value)
                on_ssd = sorted(k for k, t in tiers_of(c, list(values)).items() if t == "ssd")
            assert len(on_ssd) >= 20  # 1 MiB of memory holds at most 16 of them
            master.kill()  # SIGKILL: the index is gone, the node and its files are not

            # while the master is down, one file's header and another's value go bad
            bad_header, bad_value, *intact = on_ssd
            flip(object_path(ssd, bad_header), 5)
            flip(object_path(ssd, bad_value), header_size(bad_value) + 1000)

            master = start_master(*flags)
            node.wait_for_line(r"restored \d+ SSD objects \(\d+ bytes\), dropped 1", 20)
            with Client(master.address, allow_shm=False) as c:
                wait_until(lambda: all(c.batch_exists(intact)), timeout_s=20)
                assert set(tiers_of(c, intact).values()) == {"ssd"}
                for key in intact:
                    assert c.get(key) == values[key]
                # a bad header is never announced; a bad value is a miss, never wrong data
                assert not c.exists(bad_header)
                assert not object_path(ssd, bad_header).exists()
                with pytest.raises(ObjectNotFound):
                    c.get(bad_value)
                assert not object_path(ssd, bad_value).exists()
                # one bad file costs that object only: every other one is (again) readable
                wait_until(lambda: all(c.batch_exists(intact)), timeout_s=20)
                for key in intact:
                    assert c.get(key) == values[key]
    finally:
        master.stop()


def test_restarted_node_re_announces_its_ssd_objects(tmp_path: Path) -> None:
    ssd = tmp_path / "node-ssd"
    # a long client_ttl: the old run is still registered when the new one comes up
    with start_master("--segment_size", "0", "--enable_offload=true") as master:
        config = ssd_node_config(tmp_path, master.address, ssd)
        values = {f"t{i:02d}": os.urandom(64 * 1024) for i in range(40)}
        with start_node(config) as node, Client(master.address, allow_shm=False) as c:
            wait_until(lambda: c.stats()["tiers"]["ssd"]["capacity"] > 0)
            for key, value in values.items():
                c.put(key, value)
            assert sum(t == "ssd" for t in tiers_of(c, list(values)).values()) >= 20
            node.kill()
        # the files are what the tier held when the node died (the master's watermark
        # round may have demoted a few more since the count above)
        on_ssd = sorted(k for k in files_by_key(ssd) if k.startswith("t"))
        in_memory = sorted(set(values) - set(on_ssd))
        with start_node(config) as node, Client(master.address, allow_shm=False) as c:
            size = 64 * 1024 * len(on_ssd)
            node.wait_for_line(rf"restored {len(on_ssd)} SSD objects \({size} bytes\)", 20)
            master.wait_for_line(r"registered again: dropping its previous run", 5)
            assert len(c.stats()["clients"]) == 1  # the same owner, not a second one
            assert set(tiers_of(c, on_ssd).values()) == {"ssd"}
            for key in on_ssd:
                assert c.get(key) == values[key]
            assert not any(c.batch_exists(in_memory))  # the old run's memory is gone


def test_a_node_keeps_its_id_with_its_ssd_directory(tmp_path: Path) -> None:
    assert node_id("h") != node_id("h")  # no SSD tier: a new owner each run
    first = node_id("h", str(tmp_path / "ssd"))
    assert first.startswith("node-h-") and node_id("h", str(tmp_path / "ssd")) == first
    assert node_id("h", str(tmp_path / "other")) != first
    (tmp_path / "ssd" / ".kvpool-node-id").write_text("../../etc\n")  # not an id: replaced
    replaced = node_id("h", str(tmp_path / "ssd"))
    assert replaced != first and replaced.startswith("node-h-")


def test_a_corrupt_object_on_a_nodes_ssd_is_a_miss_and_the_node_keeps_serving(
    tmp_path: Path,
) -> None:
    # The node answers the read with a checksum error: it is alive and its other objects
    # are fine, so the client must not report it as failed (which drops all of them).
    ssd = tmp_path / "node-ssd"
    with ssd_node_client(tmp_path, ssd) as c:
        values = {f"c{i:02d}": os.urandom(64 * 1024) for i in range(40)}  # 2.5 MiB
        for key, value in values.items():
            c.put(key, value)
        tiers = tiers_of(c, list(values))
        on_ssd = sorted(k for k, t in tiers.items() if t == "ssd")
        in_memory = sorted(k for k, t in tiers.items() if t == "memory")
        assert on_ssd and in_memory
        bad = on_ssd[0]
        flip(object_path(ssd, bad), header_size(bad) + 100)
        with pytest.raises(ObjectNotFound):
            c.get(bad)
        for key in in_memory + on_ssd[1:]:
            assert c.get(key) == values[key], key
