"""Replicas (``replica_num``): copies of one object on different owners, and what the
index does with them on reads, corruption, an owner's death, eviction and restore."""

from __future__ import annotations

import pytest

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import CopyLost, Dropped, IndexConfig
from kvpool.core.registry import Tier
from kvpool.errors import ObjectNotFound, PoolError, StaleWrite


def make(nodes: int = 3, capacity: int = 100, **cfg: object) -> ObjectIndex:
    """``nodes`` owners, node0 and node1 on host 10.0.0.1, the rest one host each."""
    idx = ObjectIndex(IndexConfig(policy="lru", **cfg))  # type: ignore[arg-type]
    for n in range(nodes):
        host = "10.0.0.1" if n < 2 else f"10.0.0.{n}"
        idx.register_client(f"node{n}", 0, f"{host}:{7000 + n}")
        idx.add_segment(f"node{n}", f"node{n}/mem", capacity)
    return idx


def put(idx: ObjectIndex, key: str, copies: int, size: int = 10, now: int = 0) -> list[str]:
    """Store ``key`` in ``copies`` copies; the owners of its copies."""
    res, _ = idx.put_start(key, size, "w", now, replicas=copies)
    assert res is not None
    idx.put_end(key, "w", now, checksum=7)
    return [loc.client_id for loc in idx.copies_of(key)]


def test_copies_go_to_different_owners_on_other_hosts_first() -> None:
    idx = make(nodes=3)
    res, _ = idx.put_start("k", 10, "w", 0, replicas=2)
    assert res is not None and len(res.replicas) == 1
    first, second = res.location, res.replicas[0]
    assert first.client_id != second.client_id
    hosts = {idx.registry.host_of(first.client_id), idx.registry.host_of(second.client_id)}
    assert len(hosts) == 2  # node0 and node1 share a host: never both while node2 has room
    idx.put_end("k", "w", 0, checksum=7)
    assert idx.get("k", "r", 0).copies == 2
    # every copy takes its bytes: the pool counts replicas in its usage
    assert idx.usage(Tier.MEMORY) == (300, 20)
    idx.check()


def test_the_master_default_applies_when_a_put_names_none() -> None:
    idx = make(nodes=3, replica_num=3)
    assert len(set(put(idx, "k", copies=0))) == 3
    assert len(put(idx, "single", copies=1)) == 1
    idx.check()


def test_fewer_owners_than_copies_stores_as_many_as_there_are() -> None:
    idx = make(nodes=2)
    assert len(put(idx, "k", copies=3)) == 2
    assert idx.stats.replicas_short == 1
    idx.check()


def test_too_many_copies_is_refused_and_reserves_nothing() -> None:
    idx = make(nodes=3)
    with pytest.raises(PoolError, match="replica_num"):
        idx.put_start("k", 10, "w", 0, replicas=99)
    assert len(idx) == 0 and idx.usage(Tier.MEMORY)[1] == 0
    idx.check()


def test_an_owner_dying_keeps_the_object_on_its_other_copy() -> None:
    idx = make(nodes=3)
    owners = put(idx, "k", copies=2)
    put(idx, "lonely", copies=1)
    lonely_owner = idx.copies_of("lonely")[0].client_id
    events = idx.remove_client(owners[0])
    assert [loc.client_id for loc in idx.copies_of("k")] == [owners[1]]
    assert idx.get("k", "r", 0).location.client_id == owners[1]
    assert idx.stats.replicas_lost == 1
    assert CopyLost("k", owners[0], "expired_client") in events
    assert "k" not in {e.key for e in events if isinstance(e, Dropped)}
    if lonely_owner == owners[0]:
        assert not idx.exists("lonely")
    idx.check()


def test_a_corrupt_copy_goes_alone_and_the_next_read_gets_the_other() -> None:
    idx = make(nodes=3)
    owners = put(idx, "k", copies=2)
    grant = idx.get("k", "r", 0)
    loc = grant.location
    event = idx.drop_corrupt("k", loc.segment_id, loc.offset, grant.checksum)
    assert event == CopyLost("k", owners[0], "corrupt")
    again = idx.get("k", "r", 0)
    assert again.location.client_id == owners[1] and again.copies == 1
    # the last copy found corrupt: the object goes
    event = idx.drop_corrupt("k", again.location.segment_id, again.location.offset, 7)
    assert isinstance(event, Dropped) and event.reason == "corrupt"
    with pytest.raises(ObjectNotFound):
        idx.get("k", "r", 0)
    idx.check()


def test_a_report_of_a_copy_that_is_not_one_changes_nothing() -> None:
    idx = make(nodes=3)
    put(idx, "k", copies=2)
    assert idx.drop_corrupt("k", "node9/mem", 0, 7) is None
    loc = idx.copies_of("k")[1]
    assert idx.drop_corrupt("k", loc.segment_id, loc.offset, 8) is None  # another checksum
    assert len(idx.copies_of("k")) == 2
    idx.check()


def test_a_copy_the_writer_could_not_write_is_forgotten_at_put_end() -> None:
    idx = make(nodes=3)
    res, _ = idx.put_start("k", 10, "w", 0, replicas=3)
    assert res is not None
    lost = idx.put_end("k", "w", 0, 7, unwritten=[res.replicas[0].segment_id])
    assert lost == [CopyLost("k", res.replicas[0].client_id, "unwritten")]
    assert len(idx.copies_of("k")) == 2
    assert idx.usage(Tier.MEMORY)[1] == 20
    idx.check()


def test_no_copy_written_is_a_stale_write_and_frees_everything() -> None:
    idx = make(nodes=2)
    res, _ = idx.put_start("k", 10, "w", 0, replicas=2)
    assert res is not None
    every = [res.location.segment_id, res.replicas[0].segment_id]
    with pytest.raises(StaleWrite):
        idx.put_end("k", "w", 0, 7, unwritten=every)
    assert len(idx) == 0 and idx.usage(Tier.MEMORY)[1] == 0
    idx.check()


def test_eviction_frees_every_copy_and_tells_each_owner() -> None:
    idx = make(nodes=2, capacity=20)
    put(idx, "a", copies=2)
    put(idx, "b", copies=2)
    res, events = idx.put_start("c", 10, "w", 1, replicas=2)
    assert res is not None and len(res.replicas) == 1
    dropped = [e for e in events if isinstance(e, Dropped)]
    assert [e.key for e in dropped] == ["a"]
    assert {dropped[0].client_id, *dropped[0].also} == {"node0", "node1"}
    idx.put_end("c", "w", 1, 7)
    assert idx.usage(Tier.MEMORY) == (40, 40)
    idx.check()


def test_a_leased_copy_is_not_evicted_to_place_another_replica() -> None:
    idx = make(nodes=2, capacity=10)
    put(idx, "a", copies=2)
    idx.get("a", "reader", 0)  # leased: neither copy may go
    with pytest.raises(PoolError):
        idx.put_start("b", 10, "w", 1, replicas=2)
    assert len(idx.copies_of("a")) == 2
    idx.check()


def test_a_demotion_keeps_one_copy_on_the_ssd_of_the_first_owner() -> None:
    idx = make(nodes=2, capacity=10, enable_offload=True)
    idx.add_segment("node0", "node0/ssd", 100, Tier.SSD)
    assert put(idx, "a", copies=2) == ["node0", "node1"]
    res, events = idx.put_start("b", 10, "w", 1, replicas=2)
    assert res is not None and len(res.replicas) == 1
    assert CopyLost("a", "node1", "demoted") in events
    idx.put_end("b", "w", 1, 7)
    [where] = idx.copies_of("a")
    assert where.client_id == "node0" and where.tier is Tier.SSD
    assert idx.get("a", "r", 2).copies == 1
    idx.check()


def test_restore_takes_back_every_copy_a_node_re_announces() -> None:
    idx = make(nodes=3)
    # after a master restart each owner re-announces its own copy of "k"
    assert idx.restore("k", "node0/mem", 0, 10, 7, 0)
    assert idx.restore("k", "node2/mem", 30, 10, 7, 0)
    assert idx.restore("k", "node2/mem", 30, 10, 7, 0)  # announced again: still fine
    assert not idx.restore("k", "node1/mem", 0, 10, 8, 0)  # another checksum: not a copy
    assert [loc.client_id for loc in idx.copies_of("k")] == ["node0", "node2"]
    assert idx.get("k", "r", 0).copies == 2
    idx.remove_client("node0")
    assert idx.get("k", "r", 0).location.client_id == "node2"
    idx.check()


def test_remove_frees_every_copy() -> None:
    idx = make(nodes=3)
    put(idx, "k", copies=3)
    event = idx.remove("k", 0)
    assert isinstance(event, Dropped) and len(event.also) == 2
    assert idx.usage(Tier.MEMORY)[1] == 0
    idx.check()
