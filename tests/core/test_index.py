from __future__ import annotations

import pytest

from kvpool.core import index as index_module
from kvpool.core.index import LIFE_CYCLE, ObjectIndex
from kvpool.core.objects import Demote, Dropped, IndexConfig, State
from kvpool.core.registry import Tier
from kvpool.errors import (
    NoSpace,
    ObjectBusy,
    ObjectNotFound,
    PoolError,
    StaleWrite,
    UnknownClient,
    WriteConflict,
)


def make(capacity: int = 100, **cfg: object) -> ObjectIndex:
    idx = ObjectIndex(IndexConfig(policy="lru", **cfg))  # type: ignore[arg-type]
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", capacity)
    return idx


def put(
    idx: ObjectIndex, key: str, size: int = 10, now: int = 0, parent: str | None = None
) -> None:
    res, _ = idx.put_start(key, size, "w", now, parent)
    assert res is not None
    idx.put_end(key, "w", now, checksum=7)


# ------------------------------------------------------------------------ life cycle
def test_every_state_of_the_life_cycle_is_entered_and_left() -> None:
    entered = {after for after in LIFE_CYCLE.values() if after is not None}
    left = {state for (state, _), after in LIFE_CYCLE.items() if after is None}
    assert entered == left == set(State)
    born = {after for (state, _), after in LIFE_CYCLE.items() if state is None}
    assert born == {State.PENDING, State.READY}  # a put, or a node's restore


def test_a_transition_the_life_cycle_does_not_list_is_refused() -> None:
    idx = make()
    idx.put_start("k", 10, "w", 0)
    record = idx._objects["k"]
    with pytest.raises(AssertionError, match="PENDING takes no 'evicted'"):
        index_module._move(record, "evicted")
    assert idx.state_of("k") is State.PENDING
    idx.check()


# ------------------------------------------------------------------ two-phase writes
def test_pending_object_is_invisible_until_put_end() -> None:
    idx = make()
    res, events = idx.put_start("k", 10, "w", 0)
    assert res is not None and events == []
    assert res.location.segment_id == "node/mem" and res.location.size == 10
    assert not idx.exists("k")
    assert idx.prefix_lookup(["k"]) == 0
    with pytest.raises(ObjectNotFound):
        idx.get("k", "r", 0)
    idx.put_end("k", "w", 1, checksum=42)
    assert idx.exists("k")
    assert idx.get("k", "r", 1).checksum == 42


@pytest.mark.parametrize("size", [0, -1])
def test_an_empty_or_negative_size_is_a_typed_refusal(size: int) -> None:
    idx = make()
    with pytest.raises(PoolError, match="at least one byte"):
        idx.put_start("k", size, "w", 0)
    assert len(idx) == 0
    idx.check()


def test_a_copy_found_corrupt_leaves_at_once_even_while_leased() -> None:
    idx = make()
    put(idx, "a")
    put(idx, "k")
    grant = idx.get("k", "reader", 0)  # another reader's lease does not keep it
    loc = grant.location
    dropped = idx.drop_corrupt("k", loc.segment_id, loc.offset, grant.checksum)
    assert dropped == Dropped("k", Tier.MEMORY, "corrupt", "node")
    assert not idx.exists("k") and idx.prefix_lookup(["a", "k"]) == 1
    assert idx.active_leases(0) == 0
    idx.check()
    res, _ = idx.put_start("k", 10, "w", 1)  # stored again, not a no-op
    assert res is not None
    idx.put_end("k", "w", 1, checksum=8)
    # a late report about the old copy leaves the new one alone
    assert idx.drop_corrupt("k", loc.segment_id, loc.offset, grant.checksum) is None
    assert idx.drop_corrupt("a", "other/segment", 0, 7) is None
    assert idx.exists("k") and idx.exists("a")
    idx.check()


def test_put_revoke_reclaims_space() -> None:
    idx = make()
    idx.put_start("k", 60, "w", 0)
    idx.put_revoke("k", "w")
    assert idx.usage(Tier.MEMORY) == (100, 0)
    assert idx.state_of("k") is None
    with pytest.raises(StaleWrite):
        idx.put_end("k", "w", 0)


def test_writer_lease_expiry_reclaims_a_stuck_write() -> None:
    idx = make(writer_ttl_ms=1000)
    idx.put_start("k", 60, "w", 0)
    assert idx.tick(999) == []
    events = idx.tick(1000)
    assert events == [Dropped("k", Tier.MEMORY, "writer_expired", "node")]
    assert idx.usage(Tier.MEMORY)[1] == 0
    with pytest.raises(StaleWrite):
        idx.put_end("k", "w", 1001)


def test_duplicate_put_of_a_ready_key_is_a_no_op() -> None:
    idx = make()
    put(idx, "k")
    res, events = idx.put_start("k", 10, "other", 5)
    assert res is None and events == []
    assert idx.usage(Tier.MEMORY)[1] == 10


def test_concurrent_writers_of_one_key_conflict_until_the_first_expires() -> None:
    idx = make(writer_ttl_ms=1000)
    idx.put_start("k", 10, "w1", 0)
    with pytest.raises(WriteConflict):
        idx.put_start("k", 10, "w2", 10)
    res, _ = idx.put_start("k", 10, "w2", 1000)  # w1's reservation expired
    assert res is not None
    with pytest.raises(StaleWrite):
        idx.put_end("k", "w1", 1001)
    idx.put_end("k", "w2", 1001)
    idx.check()


def test_same_writer_retrying_a_put_start_replaces_its_reservation() -> None:
    idx = make()
    idx.put_start("k", 10, "w", 0)
    res, _ = idx.put_start("k", 20, "w", 1)
    assert res is not None and res.location.size == 20
    assert idx.usage(Tier.MEMORY)[1] == 20
    idx.check()


# ------------------------------------------------------------------------- lookups
def test_prefix_lookup_counts_leading_ready_keys() -> None:
    idx = make()
    for k in ("a", "b", "d"):
        put(idx, k)
    assert idx.prefix_lookup(["a", "b", "c", "d"]) == 2
    assert idx.prefix_lookup(["x", "a"]) == 0
    assert idx.prefix_lookup([]) == 0


def test_probes_take_no_lease() -> None:
    idx = make()
    put(idx, "k")
    idx.exists("k")
    idx.prefix_lookup(["k"])
    assert idx.active_leases(0) == 0
    idx.remove("k", 0)  # would raise ObjectBusy if a probe had leased it


# ------------------------------------------------------------------ leases and pins
def test_read_lease_blocks_removal_until_it_expires() -> None:
    idx = make(lease_ttl_ms=1000)
    put(idx, "k")
    grant = idx.get("k", "reader", 0)
    assert grant.lease_expiry_ms == 1000
    with pytest.raises(ObjectBusy):
        idx.remove("k", 500)
    idx.tick(1000)
    assert idx.active_leases(1000) == 0
    assert idx.remove("k", 1000) == Dropped("k", Tier.MEMORY, "removed", "node")


def test_release_and_release_owner_drop_holds() -> None:
    idx = make()
    put(idx, "a")
    put(idx, "b")
    idx.get("a", "req1", 0)
    idx.pin("b", "req1", 0, ttl_ms=60_000)
    idx.get("b", "req2", 0)
    assert idx.release_owner("req1") == 2
    idx.remove("a", 1)
    with pytest.raises(ObjectBusy):
        idx.remove("b", 1)  # req2 still reads it
    idx.release("b", "req2")
    idx.remove("b", 1)


def test_pin_expires() -> None:
    idx = make()
    put(idx, "k")
    idx.pin("k", "decode", 0, ttl_ms=500)
    with pytest.raises(ObjectBusy):
        idx.remove("k", 100)
    idx.tick(500)
    idx.remove("k", 500)


def test_renewing_a_lease_keeps_the_later_expiry() -> None:
    idx = make(lease_ttl_ms=1000)
    put(idx, "k")
    idx.get("k", "r", 0)
    idx.get("k", "r", 800)
    idx.tick(1000)  # the first expiry passes; the renewal still holds
    with pytest.raises(ObjectBusy):
        idx.remove("k", 1000)


# ------------------------------------------------------------------------ eviction
def test_put_into_a_full_pool_evicts_inline_in_lru_order() -> None:
    idx = make(capacity=30)
    for k in ("a", "b", "c"):
        put(idx, k)
    idx.get("a", "r", 1)
    idx.release("a", "r")
    res, events = idx.put_start("d", 10, "w", 2)
    assert res is not None
    assert events == [Dropped("b", Tier.MEMORY, "evicted", "node")]
    assert idx.stats.evictions == 1


def test_put_fails_with_no_space_when_everything_is_leased_then_recovers() -> None:
    idx = make(capacity=20, lease_ttl_ms=1000)
    put(idx, "a")
    put(idx, "b")
    idx.get("a", "r", 0)
    idx.get("b", "r", 0)
    with pytest.raises(NoSpace):
        idx.put_start("c", 10, "w", 10)
    assert idx.stats.put_failures_no_space == 1
    assert idx.exists("a") and idx.exists("b")
    # the leases ran out at 1000: no tick is needed for them to stop protecting
    res, events = idx.put_start("c", 10, "w", 1000)
    assert res is not None and len(events) == 1


def test_object_larger_than_any_segment_is_no_space() -> None:
    idx = make(capacity=10)
    with pytest.raises(NoSpace):
        idx.put_start("big", 11, "w", 0)


def test_put_with_no_segment_is_no_space() -> None:
    idx = ObjectIndex()
    with pytest.raises(NoSpace):
        idx.put_start("k", 1, "w", 0)


def test_watermark_round_evicts_ratio_and_gets_under_the_watermark() -> None:
    idx = make(capacity=100, high_watermark=0.5, eviction_ratio=0.2)
    for i in range(4):
        put(idx, f"k{i}")
    assert idx.tick(1) == []  # 40% < 50%
    put(idx, "k4")
    put(idx, "k5")  # 60%
    events = idx.tick(2)
    assert [e.key for e in events] == ["k0", "k1"]  # ceil(0.2 * 6) = 2, LRU first
    capacity, used = idx.usage(Tier.MEMORY)
    assert used < 0.5 * capacity


def test_watermark_round_never_evicts_leased_objects() -> None:
    idx = make(capacity=100, high_watermark=0.1, eviction_ratio=1.0)
    for i in range(5):
        put(idx, f"k{i}")
    idx.get("k0", "r", 0)
    idx.tick(1)
    assert idx.exists("k0")
    assert idx.count() == 1


def test_invalid_config_is_refused() -> None:
    with pytest.raises(ValueError, match="high_watermark"):
        IndexConfig(high_watermark=1.5)
    with pytest.raises(ValueError, match="eviction_ratio"):
        IndexConfig(eviction_ratio=0)


# ------------------------------------------------------------------------- offload
def make_offload(mem: int = 30, ssd: int = 30) -> ObjectIndex:
    idx = make(capacity=mem, enable_offload=True)
    idx.add_segment("node", "node/ssd", ssd, Tier.SSD)
    return idx


def test_eviction_with_offload_demotes_to_ssd_instead_of_dropping() -> None:
    idx = make_offload()
    for k in ("a", "b", "c"):
        put(idx, k)
    res, events = idx.put_start("d", 10, "w", 1)
    assert res is not None
    assert len(events) == 1 and isinstance(events[0], Demote)
    demote = events[0]
    assert demote.key == "a" and demote.src.tier is Tier.MEMORY and demote.dst.tier is Tier.SSD
    assert demote.checksum == 7
    assert idx.exists("a")
    assert idx.get("a", "r", 2).location == demote.dst
    assert idx.stats.demotions == 1
    idx.check()


def test_full_ssd_evicts_its_own_oldest_and_failed_demotion_drops() -> None:
    idx = make_offload(mem=10, ssd=10)
    put(idx, "a")
    _, ev1 = idx.put_start("b", 10, "w", 1)
    idx.put_end("b", "w", 1)
    assert isinstance(ev1[0], Demote)
    _, ev2 = idx.put_start("c", 10, "w", 2)
    assert ev2[0] == Dropped("a", Tier.SSD, "evicted", "node")
    assert isinstance(ev2[1], Demote) and ev2[1].key == "b"
    idx.demote_failed("b")
    assert not idx.exists("b") and idx.stats.demote_failures == 1
    idx.check()


def test_offload_without_an_ssd_segment_drops() -> None:
    idx = make(capacity=10, enable_offload=True)
    put(idx, "a")
    _, events = idx.put_start("b", 10, "w", 1)
    assert events == [Dropped("a", Tier.MEMORY, "evicted", "node")]


# ------------------------------------------------------------------------- clients
def test_expired_client_takes_its_segments_and_objects_at_once() -> None:
    idx = ObjectIndex(IndexConfig(client_ttl_ms=1000))
    for c in ("n1", "n2"):
        idx.register_client(c, 0)
        idx.add_segment(c, f"{c}/mem", 100)
    put(idx, "k1")
    idx.heartbeat("n2", 900)
    events = idx.tick(1000)
    gone = {e.key for e in events}
    held_by_n1 = idx.location_of("k1") is None
    assert held_by_n1 == ("k1" in gone)
    assert "n1" not in idx.registry.clients and "n2" in idx.registry.clients
    with pytest.raises(UnknownClient):
        idx.heartbeat("n1", 1001)
    idx.check()


def test_remove_client_drops_its_objects_even_if_leased() -> None:
    idx = make()
    put(idx, "k")
    idx.get("k", "r", 0)
    events = idx.remove_client("node", reason="transfer_failed")
    assert events == [Dropped("k", Tier.MEMORY, "transfer_failed", "node")]
    assert not idx.exists("k")
    assert idx.release_owner("r") == 0


def test_restore_re_announces_objects_after_a_master_restart() -> None:
    idx = make()
    assert idx.restore("k", "node/mem", 20, 10, 99, 0)
    assert idx.restore("k", "node/mem", 20, 10, 99, 0)  # the same again: a retry
    assert not idx.restore("k", "node/mem", 40, 10, 99, 0)  # already known elsewhere
    assert not idx.restore("k", "node/mem", 20, 10, 98, 0)  # not the same object
    assert not idx.restore("j", "node/mem", 25, 10, 99, 0)  # overlaps k
    assert idx.get("k", "r", 0).location.offset == 20
    assert idx.state_of("k") is State.READY
    idx.check()


def test_restore_into_an_ssd_segment_takes_any_free_extent() -> None:
    idx = make_offload(mem=30, ssd=30)
    # the owner cannot know a previous master's SSD offsets: they are ignored
    assert idx.restore("a", "node/ssd", 0, 10, 11, 0)
    assert idx.restore("b", "node/ssd", 0, 10, 12, 0)
    assert idx.restore("c", "node/ssd", 999, 10, 13, 0)
    grant = idx.get("b", "r", 1)
    assert grant.location.tier is Tier.SSD and grant.checksum == 12
    assert idx.usage(Tier.SSD) == (30, 30) and idx.count(Tier.SSD) == 3
    idx.check()


def test_restore_into_an_ssd_segment_refuses_what_does_not_fit_or_is_known() -> None:
    idx = make_offload(mem=30, ssd=25)
    put(idx, "m")  # a memory object
    assert idx.restore("a", "node/ssd", 0, 20, 1, 0)
    assert not idx.restore("b", "node/ssd", 0, 10, 2, 0)  # over capacity
    assert idx.restore("a", "node/ssd", 0, 20, 1, 0)  # the same again: a retry
    assert not idx.restore("a", "node/ssd", 0, 5, 1, 0)  # not the same object
    assert not idx.restore("m", "node/ssd", 0, 10, 7, 0)  # already present elsewhere
    assert not idx.restore("z", "node/ssd", 0, 0, 1, 0)  # nothing to account for
    where = idx.location_of("m")
    assert where is not None and where.tier is Tier.MEMORY
    assert idx.usage(Tier.SSD) == (25, 20)
    idx.check()


def test_restored_ssd_objects_are_evicted_and_removed_like_demoted_ones() -> None:
    idx = make_offload(mem=10, ssd=20)
    assert idx.restore("old", "node/ssd", 0, 10, 1, 0)
    assert idx.restore("gone", "node/ssd", 0, 10, 2, 0)
    assert idx.remove("gone", 1) == Dropped("gone", Tier.SSD, "removed", "node")
    put(idx, "a", now=1)
    put(idx, "b", now=2)  # demotes "a" into the free half
    _, events = idx.put_start("c", 10, "w", 3)  # demotes "b": the SSD must make room
    assert Dropped("old", Tier.SSD, "evicted", "node") in events
    assert any(isinstance(e, Demote) and e.key == "b" for e in events)
    idx.check()


# ------------------------------------------------------------------ segments kept per tier
def test_a_segment_added_later_takes_puts_without_evicting() -> None:
    idx = make(capacity=20)
    put(idx, "a")
    put(idx, "b")  # full
    idx.add_segment("node", "node/mem2", 20)
    res, events = idx.put_start("c", 10, "w", 0)
    assert res is not None and events == []  # room in the new segment, nothing evicted
    assert res.location.segment_id == "node/mem2"
    assert idx.exists("a") and idx.exists("b")
    idx.check()


def test_a_removed_client_s_segment_takes_no_more_puts() -> None:
    idx = make(capacity=20)
    idx.register_client("other", 0)
    idx.add_segment("other", "other/mem", 100)
    put(idx, "a")  # into other/mem, the segment with the most free space
    assert idx.location_of("a").segment_id == "other/mem"  # type: ignore[union-attr]
    idx.remove_client("other")
    put(idx, "b")
    put(idx, "c")
    res, events = idx.put_start("d", 10, "w", 0)  # node/mem is full: evicts, not other/mem
    assert res is not None and res.location.segment_id == "node/mem"
    assert [e.key for e in events if isinstance(e, Dropped)] == ["b"]
    idx.check()


# ------------------------------------------------------------------ kept counts
def test_counts_are_kept_through_puts_reads_demotions_and_drops_without_a_tick() -> None:
    idx = ObjectIndex(IndexConfig(policy="lru", lease_ttl_ms=50, enable_offload=True))
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", 30)
    idx.add_segment("node", "node/ssd", 30, Tier.SSD)
    for k in ("a", "b", "c"):
        put(idx, k)
    idx.get("a", "r1", 0)  # a lease until 50, never released
    idx.get("a", "r2", 0)
    idx.pin("b", "r3", 0, 1_000)
    idx.get("c", "r4", 0)  # read after a: a is the least recently used
    idx.release("c", "r4")
    assert idx.count() == 3 and idx.count(Tier.MEMORY) == 3 and idx.active_leases(0) == 3
    idx.check()
    # at 60 a's leases have expired but no tick ran: a is evictable, and moving it to the
    # SSD tier carries its (expired) holds along until they are purged
    res, events = idx.put_start("d", 10, "w", 60)
    assert res is not None and [e.key for e in events] == ["a"]
    assert isinstance(events[0], Demote)
    idx.check()
    assert idx.count(Tier.SSD) == 1 and idx.count(Tier.MEMORY) == 2
    assert idx.count(Tier.MEMORY, State.PENDING) == 1 and idx.count(Tier.SSD, State.PENDING) == 0
    assert idx.active_leases(60) == 1  # b's pin; a's expired leases are released
    idx.check()
    idx.put_end("d", "w", 60)
    assert idx.remove("d", 60).key == "d"
    assert idx.count() == 3
    idx.remove_client("node")
    assert idx.count() == 0 and idx.active_leases(60) == 0
    idx.check()


def test_batch_exists_answers_as_exists_with_and_without_writes_in_flight() -> None:
    idx = make(1000)
    put(idx, "a")
    put(idx, "b")
    keys = ["a", "c", "b", "p"]
    assert idx.batch_exists(keys) == [True, False, True, False]
    idx.put_start("p", 10, "w", 0)  # in flight: not there yet
    assert idx.batch_exists(keys) == [idx.exists(k) for k in keys] == [True, False, True, False]
    idx.put_end("p", "w", 0)
    assert idx.batch_exists(keys) == [True, False, True, True]
