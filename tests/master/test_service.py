"""The master's handler in-process: owners that leave and come back, and their SSD files.

The "node" here is a real data server with a real SSD tier on disk, so the test sees
which files the master has the node delete.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.core.objects import IndexConfig
from kvpool.datapath.segment_server import SegmentServer
from kvpool.master.service import MasterService
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error, Ok
from kvpool.storage.ssd import SsdStore
from tests.waiting import wait_until

NODE = "node-h-1234abcd"


@pytest.fixture
def node_ssd(tmp_path: Path) -> Iterator[tuple[SsdStore, str]]:
    store = SsdStore.open(tmp_path, 1 << 20)
    with SegmentServer(ssd=store) as server:  # started on entry
        yield store, f"127.0.0.1:{server.port}"


def join(svc: MasterService, address: str) -> None:
    """Register the node with a memory and an SSD segment."""
    reply = svc.handle(m.Register(NODE, address, "token"))
    assert isinstance(reply, m.RegisterReply) and reply.new
    for segment_id, tier in ((f"{NODE}/mem", "memory"), (f"{NODE}/ssd", "ssd")):
        assert isinstance(svc.handle(m.AddSegment(NODE, segment_id, 1000, tier)), Ok)


def announce(svc: MasterService, store: SsdStore) -> list[bool]:
    entries = [(k, 0, n, c) for k, n, c in store.scan().entries]
    reply = svc.handle(m.Restore(NODE, f"{NODE}/ssd", entries))
    assert isinstance(reply, m.Bools)
    return reply.values


def test_a_known_owner_registering_again_replaces_its_previous_run(
    node_ssd: tuple[SsdStore, str],
) -> None:
    store, address = node_ssd
    store.put("s1", b"x" * 10)
    svc = MasterService(IndexConfig(enable_offload=True))
    join(svc, address)
    assert announce(svc, store) == [True]
    memory = m.Restore(NODE, f"{NODE}/mem", [("m1", 0, 10, 6)])
    assert svc.handle(memory) == m.Bools([True])

    # the same id again: a new run of that node (its memory is gone, its SSD is not)
    join(svc, address)  # the segments can be added again: no "already registered"
    assert not svc.index.exists("m1") and not svc.index.exists("s1")
    assert "s1" in store  # the master did not have the node delete its file
    assert announce(svc, store) == [True]
    assert svc.index.exists("s1")
    svc.close()


def test_dropping_a_whole_owner_keeps_its_ssd_files_and_dropping_an_object_does_not(
    node_ssd: tuple[SsdStore, str],
) -> None:
    store, address = node_ssd
    for key in ("s1", "s2"):
        store.put(key, key.encode() * 5)
    svc = MasterService(IndexConfig(enable_offload=True))
    join(svc, address)
    assert announce(svc, store) == [True, True]
    assert isinstance(svc.handle(m.Remove("s1")), Ok)
    # one object removed: its file goes (the node's link thread deletes it)
    wait_until(lambda: "s1" not in store, what="the node deleted s1")
    svc.handle(m.ReportFailure(f"{NODE}/ssd", "TransferError: test"))
    assert isinstance(svc.handle(m.Heartbeat(NODE)), Error)  # dropped: unknown now
    assert "s2" in store  # the owner left: its files wait for it to come back
    join(svc, address)
    assert announce(svc, store) == [True]
    svc.close()


def test_a_batch_get_answers_and_counts_as_its_gets_would() -> None:
    """BatchGet counts its metrics once per batch: the same totals, placements and
    leases as one Get per key."""
    svc = MasterService(IndexConfig())
    svc.handle(m.Register("n", "127.0.0.1:1", "token"))
    svc.handle(m.AddSegment("n", "n/mem", 1 << 20, "memory", "shm-n"))
    for key in ("a", "b"):
        assert svc.handle(m.PutStart("c", key, 100)).placed  # type: ignore[union-attr]
        assert svc.handle(m.PutEnd("c", key, 7)) == Ok()
    reply = svc.handle(m.BatchGet("o", ["a", "gone", "b", "a"]))
    assert isinstance(reply, m.Placements)
    assert [p.placed for p in reply.items] == [True, False, True, True]
    assert reply.items[0] == svc.handle(m.Get("o2", "a"))
    assert reply.items[1] == m.Placement(False, "gone")
    text = svc.metrics.exposition().decode()
    assert 'kvpool_lookups_total{kind="get"} 5.0' in text
    assert 'kvpool_hits_total{kind="get",tier="memory"} 4.0' in text
    assert svc.handle(m.ReleaseOwner("o")) == m.Count(2)  # a lease per key, not per ask
    svc.close()


def test_get_metrics_count_every_request_and_show_only_label_sets_used() -> None:
    """The handler caches its metric children; what /metrics says must not change."""
    svc = MasterService(IndexConfig())
    svc.handle(m.Register("n", "127.0.0.1:1", "token"))
    svc.handle(m.AddSegment("n", "n/mem", 1 << 20, "memory", "shm-n"))
    text = svc.metrics.exposition().decode()
    assert "kvpool_lookups_total{" not in text and "kvpool_hits_total{" not in text
    assert 'op="Get"' not in text  # no series for an op never handled
    assert svc.handle(m.PutStart("c", "k", 100)).placed  # type: ignore[union-attr]
    assert svc.handle(m.PutEnd("c", "k", 7)) == Ok()
    for _ in range(3):
        reply = svc.handle(m.Get("o", "k"))
        assert reply == m.Placement(
            True, "k", "n/mem", "memory", 0, 100, 7, "127.0.0.1:1", "shm-n", "token"
        )
        assert svc.handle(m.Release("o", ["k"])) == Ok()
    assert svc.handle(m.Get("o", "missing")) == m.Placement(False, "missing")

    class Unknown:
        pass

    for _ in range(2):  # a request no handler knows: an internal error reply, every time
        bad = svc.handle(Unknown())  # type: ignore[arg-type]
        assert isinstance(bad, Error) and bad.code == "INTERNAL"
    text = svc.metrics.exposition().decode()
    assert 'kvpool_lookups_total{kind="get"} 4.0' in text
    assert 'kvpool_hits_total{kind="get",tier="memory"} 3.0' in text
    assert 'tier="ssd"' not in text.split("kvpool_hits_total", 1)[1].split("# HELP", 1)[0]
    assert 'kvpool_request_seconds_count{op="Get"} 4.0' in text
    assert 'kvpool_request_seconds_count{op="Release"} 3.0' in text
    assert 'kvpool_request_seconds_count{op="Unknown"} 2.0' in text
    assert 'kvpool_request_errors_total{code="INTERNAL",op="Unknown"} 2.0' in text
    svc.close()


def test_a_node_re_announcing_gets_no_new_put_in_its_segment_until_it_is_done() -> None:
    # A node dropped (a client's report) and registering again had its segment taking new
    # puts before it re-announced what it held: a put could take the extent of an object
    # not yet announced, the index then refused that object, and the node dropped it.
    svc = MasterService(IndexConfig())
    assert isinstance(svc.handle(m.Register(NODE, "10.0.0.1:1", "token")), m.RegisterReply)
    svc.handle(m.Register("c", "", ""))
    segment = f"{NODE}/mem"
    assert svc.handle(m.AddSegment(NODE, segment, 1000, "memory", restoring=True)) == Ok()
    refused = svc.handle(m.PutStart("c", "new", 100))
    assert isinstance(refused, Error), refused  # the only segment is not placeable yet
    first = m.Restore(NODE, segment, [("old", 0, 100, 7)])
    assert svc.handle(first) == m.Bools([True])
    assert svc.handle(m.Restore(NODE, segment, [("old2", 100, 100, 8)], done=True)) == m.Bools(
        [True]
    )
    put = svc.handle(m.PutStart("c", "new", 100))
    assert isinstance(put, m.Placement) and put.placed and put.segment_id == segment
    assert put.offset >= 200  # not over either announced object
    got = svc.handle(m.Get("c", "old"))
    assert isinstance(got, m.Placement) and got.placed and got.offset == 0
