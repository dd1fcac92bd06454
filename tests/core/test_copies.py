"""Demotions a node copies while the index serves others (``defer_copies``): the object is
DEMOTING, still readable, and holds both extents until the copy is done or abandoned."""

from __future__ import annotations

import pytest

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import Demote, Dropped, IndexConfig, NoRoom, State
from kvpool.core.registry import Tier
from kvpool.errors import NoSpace


def make(mem: int = 30, ssd: int = 30, deferred: bool = True) -> ObjectIndex:
    idx = ObjectIndex(IndexConfig(policy="lru", enable_offload=True))
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", mem)
    idx.add_segment("node", "node/ssd", ssd, Tier.SSD)
    if deferred:
        idx.defer_copies("node")
    return idx


def put(idx: ObjectIndex, key: str, now: int = 0) -> None:
    res, _ = idx.put_start(key, 10, "w", now)
    assert res is not None
    idx.put_end(key, "w", now, checksum=7)


def fill(idx: ObjectIndex) -> list[Demote]:
    """a, b, c fill memory; the put of d needs room: a's copy starts, d must wait."""
    for k in ("a", "b", "c"):
        put(idx, k)
    with pytest.raises(NoRoom) as raised:
        idx.put_start("d", 10, "w", 1)
    assert raised.value.coming and isinstance(raised.value, NoSpace)
    copies = [e for e in raised.value.events if isinstance(e, Demote)]
    assert [c.key for c in copies] == ["a"] and copies[0].in_flight
    return copies


def test_a_copy_in_flight_is_visible_and_keeps_its_memory() -> None:
    idx = make()
    fill(idx)
    assert idx.state_of("a") is State.DEMOTING
    assert idx.exists("a") and idx.prefix_lookup(["a", "b"]) == 2  # its bytes are held
    assert idx.usage(Tier.MEMORY) == (30, 30)  # not reused under the copy
    assert idx.usage(Tier.SSD) == (30, 10)  # its SSD extent is reserved
    assert idx.count(state=State.DEMOTING) == 1
    res, events = idx.put_start("a", 10, "w2", 2)  # stored already: a duplicate put
    assert res is None and events == []
    idx.check()
    # while the copy is in flight, a second put does not start more copies
    with pytest.raises(NoRoom) as again:
        idx.put_start("d", 10, "w", 2)
    assert again.value.coming and again.value.events == []
    assert idx.count(state=State.DEMOTING) == 1


def test_a_finished_copy_is_readable_from_ssd_and_frees_the_memory() -> None:
    idx = make()
    (copy,) = fill(idx)
    assert idx.demote_done(copy)
    assert idx.state_of("a") is State.READY
    assert idx.get("a", "r", 3).location == copy.dst
    res, _ = idx.put_start("d", 10, "w", 3)  # the memory is free now
    assert res is not None and res.location.offset == copy.src.offset
    assert not idx.demote_done(copy)  # reported twice: nothing happens
    idx.check()


def test_an_abandoned_copy_drops_the_object_and_frees_both_extents() -> None:
    idx = make()
    (copy,) = fill(idx)
    assert idx.demote_abandoned(copy) == Dropped("a", Tier.MEMORY, "demote_failed", "node")
    assert idx.state_of("a") is None and idx.usage(Tier.SSD) == (30, 0)
    assert idx.demote_abandoned(copy) is None and not idx.demote_done(copy)  # too late
    res, _ = idx.put_start("d", 10, "w", 3)
    assert res is not None
    idx.check()


def test_a_late_report_does_not_touch_a_new_object_of_the_same_key() -> None:
    idx = make()
    (copy,) = fill(idx)
    idx.demote_abandoned(copy)
    put(idx, "a", 4)  # stored again, in memory
    assert not idx.demote_done(copy) and idx.demote_abandoned(copy) is None
    assert idx.state_of("a") is State.READY and idx.exists("a")
    idx.check()


def test_a_stalled_owner_has_its_victims_dropped_not_copied() -> None:
    idx = make()
    (copy,) = fill(idx)
    idx.demote_abandoned(copy)
    idx.stall_copies("node", True)
    put(idx, "d", 5)
    res, events = idx.put_start("e", 10, "w", 6)
    assert res is not None and events == [Dropped("b", Tier.MEMORY, "evicted", "node")]
    idx.stall_copies("node", False)
    idx.put_end("e", "w", 6)
    with pytest.raises(NoRoom) as raised:  # it answers again: copies again
        idx.put_start("f", 10, "w", 7)
    (copy,) = raised.value.events
    assert isinstance(copy, Demote) and copy.in_flight and copy.key == "c"
    idx.check()


def test_a_watermark_round_counts_copies_in_flight_as_gone() -> None:
    idx = ObjectIndex(IndexConfig(policy="lru", enable_offload=True, high_watermark=0.5))
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", 100)
    idx.add_segment("node", "node/ssd", 1000, Tier.SSD)
    idx.defer_copies("node")
    for i in range(8):
        put(idx, f"k{i}")
    events = idx.tick(1)
    copies = [e for e in events if isinstance(e, Demote)]
    # enough to get under the watermark once they are done, not the whole tier
    assert len(copies) == 4 and all(c.in_flight for c in copies)
    assert idx.tick(2) == []  # no more while they copy
    idx.check()


def test_a_client_that_expires_mid_copy_takes_the_copy_with_it() -> None:
    idx = make()
    (copy,) = fill(idx)
    events = idx.remove_client("node", reason="transfer_failed")
    assert {e.key for e in events} == {"a", "b", "c"}
    assert idx.count(state=State.DEMOTING) == 0
    assert not idx.demote_done(copy)
    idx.check()


def test_an_owner_that_copies_at_once_still_demotes_logically() -> None:
    idx = make(deferred=False)
    for k in ("a", "b", "c"):
        put(idx, k)
    res, events = idx.put_start("d", 10, "w", 1)
    assert res is not None and isinstance(events[0], Demote) and not events[0].in_flight
    assert idx.exists("a")
    idx.check()


def test_a_read_of_a_copy_in_flight_takes_it_back_into_memory() -> None:
    idx = make()
    (copy,) = fill(idx)
    grant = idx.get("a", "r", 2)  # not a miss: the memory copy is still there
    assert grant.location == copy.src and grant.checksum == 7
    assert idx.state_of("a") is State.READY and idx.count(state=State.DEMOTING) == 0
    assert idx.usage(Tier.SSD) == (30, 0)  # the copy's SSD extent is free again
    assert not idx.demote_done(copy) and idx.demote_abandoned(copy) is None  # ignored
    assert idx.get("a", "r", 3).location == copy.src
    idx.check()


def test_a_pin_or_remove_of_a_copy_in_flight_is_not_a_miss() -> None:
    idx = make()
    (copy,) = fill(idx)
    idx.pin("a", "p", 2, 100)
    assert idx.state_of("a") is State.READY and idx.location_of("a") == copy.src
    idx.release("a", "p")
    idx.check()
    idx = make()
    (copy,) = fill(idx)
    assert idx.remove("a", 2) == Dropped("a", Tier.MEMORY, "removed", "node")
    assert idx.usage(Tier.MEMORY) == (30, 20) and idx.usage(Tier.SSD) == (30, 0)
    assert not idx.demote_done(copy)
    idx.check()
