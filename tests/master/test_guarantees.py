"""What a put, a get and a lookup guarantee, and what a node's death does to them.

Each test here backs sentences of docs/pool.md's "Guarantees" section, against real
processes: a master, and a storage node on this host that is SIGKILLed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.errors import KVPoolError, ObjectNotFound
from kvpool.protocol import messages as m
from kvpool.storage.segment import SHM_DIR, Segment
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.waiting import wait_until

CLIENT_TTL_S = 2


def node_shm_file(c: Client, key: str) -> Path:
    """The /dev/shm file of the segment ``key`` lives in (read from its placement)."""
    placement = c.call(m.Get("probe", key))
    c.call(m.Release("probe", [key]))
    assert isinstance(placement, m.Placement) and placement.shm_name
    return SHM_DIR / placement.shm_name


def a_key_on_the_node(c: Client, node_id: str, prefix: str) -> str:
    """Put objects until one lands in the node's segment (the master has one too)."""
    for i in range(64):
        key = f"{prefix}{i}"
        c.put(key, os.urandom(16 * 1024))
        location = c.call(m.Get("probe", key))
        c.call(m.Release("probe", [key]))
        assert isinstance(location, m.Placement)
        if location.segment_id.startswith(node_id):
            return key
    raise AssertionError("no put landed in the node's segment")


def node_client_id(c: Client) -> str:
    (node,) = [x for x in c.stats()["clients"] if x["client_id"].startswith("node-")]
    return str(node["client_id"])


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[PoolProcess, PoolProcess]]:
    # both the master and the node hold a segment: puts that do not go to the dead
    # node have somewhere to go
    master = start_master("--segment_size", "8MiB", "--client_ttl", str(CLIENT_TTL_S))
    try:
        node = start_node(node_config(tmp_path, master.address, "8MiB"))
    except BaseException:
        master.stop()
        raise
    try:
        with Client(master.address) as c:
            wait_until(lambda: len(c.stats()["clients"]) == 2, what="the node registered")
        yield master, node
    finally:  # a killed node is reaped too
        node.stop()
        master.stop()


def test_same_host_puts_after_a_node_is_killed_are_never_acknowledged_into_it(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    with Client(master.address, timeout_s=2) as c:  # the same-host (shm) path
        node_id = node_client_id(c)
        on_node = a_key_on_the_node(c, node_id, "before")
        shm_file = node_shm_file(c, on_node)
        assert shm_file.exists()
        node.kill()
        acknowledged: dict[str, bytes] = {}
        refused = 0
        for i in range(200):
            key, value = f"after{i}", os.urandom(16 * 1024)
            try:
                c.put(key, value)
            except KVPoolError as exc:
                assert exc.code != "INTERNAL"
                refused += 1
                continue
            acknowledged[key] = value
        # the puts aimed at the dead node's segment were refused (typed), the
        # others landed in the master's own segment
        assert refused >= 1 and acknowledged
        # the dead segment was unmapped and its file removed, within client_ttl
        wait_until(lambda: not shm_file.exists(), timeout_s=CLIENT_TTL_S + 3)
        # once the master has dropped the node, every acknowledged put is still there
        wait_until(lambda: node_id not in str(c.stats()["clients"]), timeout_s=10)
        with Client(master.address, timeout_s=2) as reader:
            lost = [k for k, v in acknowledged.items() if reader.get(k) != v]
        assert lost == []


def test_a_same_host_batch_put_after_a_node_is_killed_is_never_acknowledged_into_it(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    with Client(master.address, timeout_s=2) as c:
        shm_file = node_shm_file(c, a_key_on_the_node(c, node_client_id(c), "before"))
        node.kill()
        keys = [f"batch{i}" for i in range(32)]  # some of them placed on the dead node
        values = [os.urandom(16 * 1024) for _ in keys]
        results = c.batch_put(keys, values)
        refused = [r for r in results if r is not None]
        assert refused and all(r.code == "TRANSFER" for r in refused)
        assert not shm_file.exists()
        with Client(master.address, timeout_s=2) as reader:
            for key, value, result in zip(keys, values, results, strict=True):
                if result is None:
                    assert reader.get(key) == value


def test_a_killed_nodes_shm_file_is_removed_within_client_ttl_by_the_master(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    with Client(master.address, timeout_s=2) as c:
        shm_file = node_shm_file(c, a_key_on_the_node(c, node_client_id(c), "k"))
    node.kill()  # no client touches its segment again: the master must clean up
    wait_until(lambda: not shm_file.exists(), timeout_s=CLIENT_TTL_S + 3)


def test_same_host_reads_of_a_killed_nodes_objects_are_misses_and_drop_it(
    pool: tuple[PoolProcess, PoolProcess],
) -> None:
    master, node = pool
    with Client(master.address, timeout_s=2) as c:
        key = a_key_on_the_node(c, node_client_id(c), "k")
        node.kill()
        with pytest.raises(ObjectNotFound):
            c.get(key)  # the bytes are still mapped here, but their owner is gone
        assert not c.exists(key)  # the failed read dropped the node at once


# ------------------------------------------------------------------ a corrupt copy leaves
def corrupt(c: Client, key: str) -> None:
    """Flip one byte of ``key``'s stored copy, in its segment."""
    placement = c.call(m.Get("test", key))
    c.call(m.Release("test", [key]))
    assert isinstance(placement, m.Placement) and placement.shm_name
    with Segment.attach(placement.shm_name) as seg:
        view = seg.view(placement.offset + placement.size // 2, 1)
        view[0] ^= 0xFF
        del view


def test_a_corrupt_copy_leaves_the_index_and_the_next_put_stores_good_bytes() -> None:
    with start_master("--segment_size", "4MiB") as master, Client(master.address) as c:
        c.put("a", b"a" * 5000)
        c.put("bad", b"b" * 5000)
        corrupt(c, "bad")
        with pytest.raises(ObjectNotFound):
            c.get("bad")
        assert not c.exists("bad")  # lookups stop counting it
        assert c.prefix_lookup(["a", "bad"]) == 1
        c.put("bad", b"n" * 5000)  # stored, not a no-op against the corrupt copy
        assert c.get("bad") == b"n" * 5000


def test_a_corrupt_copy_found_by_a_batch_read_leaves_the_index() -> None:
    with start_master("--segment_size", "4MiB") as master, Client(master.address) as c:
        c.batch_put(["a", "bad"], [b"a" * 5000, b"b" * 5000])
        corrupt(c, "bad")
        buffers = [bytearray(5000), bytearray(5000)]
        assert c.batch_get_into(["a", "bad"], buffers) == [5000, -1]
        assert c.batch_exists(["a", "bad"]) == [True, False]
        assert c.batch_put(["bad"], [b"n" * 5000]) == [None]
        assert c.get("bad") == b"n" * 5000


def test_a_pipelined_tcp_batch_read_is_a_miss_for_a_corrupt_copy_only() -> None:
    # over TCP the batch is one pipelined transfer: each value is still checked alone
    with (
        start_master("--segment_size", "4MiB") as master,
        Client(master.address, allow_shm=False) as c,
    ):
        keys = ["a", "bad", "c"]
        assert c.batch_put(keys, [b"a" * 5000, b"b" * 5000, b"c" * 7000]) == [None] * 3
        corrupt(c, "bad")
        buffers = [bytearray(5000), bytearray(5000), bytearray(8000), bytearray(10)]
        assert c.batch_get_into([*keys, "missing"], buffers) == [5000, -1, 7000, -1]
        assert bytes(buffers[0]) == b"a" * 5000 and bytes(buffers[2][:7000]) == b"c" * 7000
        assert c.batch_exists(keys) == [True, False, True]
        with pytest.raises(ValueError, match="c: buffer of 10 bytes is too small for 7000"):
            c.batch_get_into(["a", "c"], [bytearray(5000), bytearray(10)])
        assert c.get("a") == b"a" * 5000  # the refused batch's leases were released


# ------------------------------------------------------------ bad input is never INTERNAL
def internal_errors(master: PoolProcess) -> list[str]:
    from kvpool.net import http_get

    metrics = http_get(f"http://{master.address}/metrics").body.decode()
    counted = [line for line in metrics.splitlines() if 'code="INTERNAL"' in line]
    logged = [line for line in master.lines if "Traceback" in line or "internal error" in line]
    return counted + logged


def test_an_empty_value_is_refused_by_the_client_with_a_typed_error() -> None:
    with start_master("--segment_size", "4MiB") as master, Client(master.address) as c:
        with pytest.raises(KVPoolError) as refused:
            c.put("empty", b"")
        assert refused.value.code == "POOL" and "empty" in str(refused.value)
        results = c.batch_put(["empty", "full"], [b"", b"x"])
        assert isinstance(results[0], KVPoolError) and results[0].code == "POOL"
        assert "empty" in str(results[0]) and results[1] is None
        assert not c.exists("empty") and c.get("full") == b"x"
        # and a client that sends one anyway gets the same typed refusal from the master
        reply = c.link.call(m.PutStart(c.client_id, "empty", 0))
        assert getattr(reply, "code", "") == "POOL"
        assert internal_errors(master) == []


def test_no_ordinary_bad_input_is_an_internal_error() -> None:
    with start_master("--segment_size", "4MiB") as master, Client(master.address) as c:
        cid = c.client_id
        c.put("k", b"v" * 100)
        huge = "h" * 100_000
        c.put(huge, b"v")  # a long key is a key like any other
        assert c.get(huge) == b"v"
        with pytest.raises(ObjectNotFound):
            c.get("unknown")
        assert c.remove("unknown") is False
        assert c.pin(["unknown", "also-unknown"], "req", 1000) == 0
        assert c.batch_put(["d", "d"], [b"1" * 10, b"1" * 10]) == [None, None]
        assert c.get("d") == b"1" * 10
        c.call(m.Get("reader", "k"))  # a read lease: the object cannot be removed now
        with pytest.raises(KVPoolError) as busy:
            c.remove("k")
        assert busy.value.code == "BUSY"
        c.call(m.ReleaseOwner("reader"))
        wire: list[m.MasterRequest] = [
            m.PutStart(cid, "neg", -5),
            m.PutEnd(cid, "never-started", 1),
            m.PutRevoke(cid, "never-started"),
            m.BatchPutStart(cid, ["a", "b"], [10]),
            m.BatchPutStart(cid, ["a"], [-1]),
            m.BatchPutEnd(cid, ["a", "b"], [1]),
            m.Release("nobody", ["unknown"]),
            m.ReleaseOwner("nobody"),
            m.Heartbeat("never-registered"),
            m.Restore("never-registered", "no-segment", [("x", 0, 10, 1)]),
            m.ReportFailure("no-segment", "test"),
            m.ReportCorrupt("unknown", "no-segment", 0, 1),
            m.PrefixLookup(["k"], -1),
            m.Pin("req", ["k"], -10),
        ]
        for request in wire:
            reply = c.link.call(request)
            assert getattr(reply, "code", "") != "INTERNAL", (request, reply)
        assert internal_errors(master) == []


# ----------------------------------------------------------------- one meaning per counter
def test_status_offloads_count_completed_demotions_as_the_metric_does() -> None:
    from kvpool.core.objects import IndexConfig
    from kvpool.master.service import MasterService

    svc = MasterService(IndexConfig(enable_offload=True))
    node = "node-unreachable"
    # a node whose data port refuses: every demotion to its SSD fails
    svc.handle(m.Register(node, "127.0.0.1:1", "token"))
    svc.handle(m.AddSegment(node, f"{node}/mem", 1000, "memory"))
    svc.handle(m.AddSegment(node, f"{node}/ssd", 10_000, "ssd"))
    try:
        placed = svc.handle(m.PutStart("w", "a", 600))
        assert isinstance(placed, m.Placement) and placed.placed
        svc.handle(m.PutEnd("w", "a", 1))
        # the next put's room needs "a" copied to the node's SSD; a bare service (no
        # server to hold the reply) answers NoSpace while the copy runs off the loop
        svc.handle(m.PutStart("w", "b", 600))

        def failures() -> float:
            svc.tick()
            return float(svc.snapshot()["stats"]["demote_failures"])

        wait_until(failures, timeout_s=10, what="a demotion failed")
        metrics = svc.metrics.exposition().decode()
        completed = [ln for ln in metrics.splitlines() if ln.startswith("kvpool_offloads_total")]
        assert completed == ["kvpool_offloads_total 0.0"]
        assert svc.snapshot()["stats"]["offloads"] == 0
    finally:
        svc.close()


# --------------------------------------------------------------------- the docs' promises
def test_every_sentence_of_the_guarantees_names_tests_that_exist() -> None:
    import re

    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "pool.md").read_text()
    section = text.split("## Guarantees", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`((?:tests/[\w/]+\.py|test_guarantees)::(\w+))`", section)
    assert len(named) >= 20
    for ref, name in named:
        path = ref.split("::")[0]
        if path == "test_guarantees":
            path = "tests/master/test_guarantees.py"
        assert f"def {name}(" in (root / path).read_text(), ref
    for sentence in re.split(r"\n- ", section.split("\n### ", 1)[1])[1:]:
        assert "::test_" in sentence, f"no test named for: {sentence[:80]}"


def test_a_copy_missing_from_a_nodes_ssd_leaves_the_index(tmp_path: Path) -> None:
    from kvpool.storage.ssd import object_path

    ssd = tmp_path / "node-ssd"
    with start_master("--segment_size", "0", "--enable_offload=true") as master:
        config = node_config(tmp_path, master.address, "1MiB")
        settings = json.loads(config.read_text())
        ssd_settings = {"enable_ssd_offload": True, "ssd_offload_path": str(ssd)}
        config.write_text(json.dumps(dict(settings, **ssd_settings, ssd_offload_limit="16MiB")))
        with start_node(config), Client(master.address, allow_shm=False) as c:
            wait_until(lambda: c.stats()["tiers"]["ssd"]["capacity"] > 0)
            keys = [f"s{i:02d}" for i in range(24)]  # 1.5 MiB: some are demoted
            for key in keys:
                c.put(key, key.encode() * 32 * 1024)
            on_ssd = [k for k in keys if object_path(ssd, k).exists()]
            assert on_ssd
            object_path(ssd, on_ssd[0]).unlink()  # gone behind the pool's back
            with pytest.raises(ObjectNotFound):
                c.get(on_ssd[0])
            assert not c.exists(on_ssd[0])  # the index no longer lists it
            c.put(on_ssd[0], b"new")
            assert c.get(on_ssd[0]) == b"new"
