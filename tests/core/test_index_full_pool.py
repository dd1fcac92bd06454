"""A put into a full pool with one memory segment evicts inline, without the general
eviction layers, and keeps the victim's extent when it is exactly the size asked and the
segment had no free extent.  These tests hold that fast path to what the general path
does: the same offsets, events and errors (the general path is what runs when a tier has
more than one segment, so an empty second segment is the reference)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import Demote, Dropped, IndexConfig
from kvpool.core.registry import Tier
from kvpool.errors import NoSpace, ObjectBusy, ObjectNotFound


def make(capacity: int = 40, policy: str = "lru", reference: bool = False) -> ObjectIndex:
    idx = ObjectIndex(IndexConfig(policy=policy))
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", capacity)
    if reference:  # a second memory segment, with no room: the general path, same answers
        idx.add_segment("node", "node/empty", 0)
    return idx


def put(idx: ObjectIndex, key: str, size: int = 10, now: int = 0) -> tuple[int, list[str]]:
    res, events = idx.put_start(key, size, "w", now)
    assert res is not None
    idx.put_end(key, "w", now)
    return res.location.offset, [e.key for e in events if isinstance(e, Dropped)]


def test_a_same_size_put_into_a_full_segment_takes_the_victim_s_extent() -> None:
    idx = make()
    for i in range(4):
        put(idx, f"k{i}")
    assert put(idx, "new") == (0, ["k0"])  # k0 was oldest, at offset 0
    assert put(idx, "new2") == (10, ["k1"])
    idx.check()


def test_a_smaller_put_splits_the_victim_s_extent() -> None:
    idx = make()
    for i in range(4):
        put(idx, f"k{i}")
    assert put(idx, "small", size=4) == (0, ["k0"])
    assert put(idx, "small2", size=6) == (4, [])  # the rest of k0's extent: no eviction
    idx.check()
    assert idx.registry.segment("node/mem").space.used == 40


def test_a_larger_put_evicts_until_a_hole_is_large_enough() -> None:
    idx = make()
    for i in range(4):
        put(idx, f"k{i}")
    assert put(idx, "big", size=20) == (0, ["k0", "k1"])
    idx.check()


def test_a_fragmented_segment_takes_the_first_fit_not_the_victim_s_extent() -> None:
    idx = make(capacity=45)  # 4 blocks of 10 and a hole of 5 at the end
    for i in range(4):
        put(idx, f"k{i}")
    idx.remove("k2", 0)  # a hole of 10 at 20, and the 5 at 40
    put(idx, "k4")  # fills the hole at 20
    # Not full (5 bytes free): the victim k0's extent is released, then allocated first-fit.
    assert put(idx, "k5") == (0, ["k0"])
    # k1 out leaves holes of 10 at 10 and 5 at 40; k3 out merges 30-45: 15 bytes at 30.
    assert put(idx, "k6", size=15) == (30, ["k1", "k3"])
    idx.check()


def test_a_victim_next_to_free_holes_merges_with_them_before_the_first_fit() -> None:
    idx = make(capacity=30)
    put(idx, "a", size=5)  # 0-5
    put(idx, "b")  # 5-15
    put(idx, "c", size=5)  # 15-20
    put(idx, "d")  # 20-30
    idx.remove("a", 0)
    idx.remove("c", 0)  # holes of 5 at 0 and 15: 10 bytes free, but no hole of 10
    # b is the size asked, but the segment is not full: released, it merges into 0-20,
    # and the first fit is 0, not b's old offset 5.
    assert put(idx, "x") == (0, ["b"])
    idx.check()


def test_leased_and_pinned_objects_are_never_the_victim() -> None:
    idx = make()
    for i in range(4):
        put(idx, f"k{i}")
    idx.get("k0", "reader", 0)  # read: now the youngest, and leased
    idx.pin("k1", "decode", 0, 1_000)  # the oldest, pinned
    assert put(idx, "new") == (20, ["k2"])
    assert put(idx, "new2") == (30, ["k3"])
    idx.release_owner("reader")
    assert put(idx, "new3") == (0, ["k0"])  # k1 still pinned
    idx.check()


def test_an_expired_lease_does_not_protect_and_its_hold_is_cleared() -> None:
    idx = make()
    put(idx, "k0")
    idx.get("k0", "reader", 0)  # lease_ttl_ms later it no longer holds
    for i in range(1, 4):
        put(idx, f"k{i}")
    assert put(idx, "new", now=60_000) == (0, ["k0"])
    idx.check()  # the kept hold counts dropped with it
    assert idx.active_leases(60_000) == 0


def test_nothing_evictable_is_no_space_and_changes_nothing() -> None:
    idx = make()
    for i in range(4):
        put(idx, f"k{i}")
        idx.get(f"k{i}", "reader", 0)
    try:
        idx.put_start("new", 10, "w", 0)
    except NoSpace:
        pass
    else:  # pragma: no cover - the assertion below says what went wrong
        raise AssertionError("a put into a pool of leased objects succeeded")
    assert len(idx) == 4
    idx.check()


def test_with_offload_a_victim_is_demoted_to_ssd_not_dropped() -> None:
    idx = ObjectIndex(IndexConfig(policy="lru", enable_offload=True))
    idx.register_client("node", 0)
    idx.add_segment("node", "node/mem", 20)
    idx.add_segment("node", "node/ssd", 100, Tier.SSD)
    put(idx, "a")
    put(idx, "b")
    res, events = idx.put_start("c", 10, "w", 0)
    assert res is not None and res.location.offset == 0
    assert [type(e) for e in events] == [Demote] and events[0].key == "a"
    idx.put_end("c", "w", 0)
    assert idx.location_of("a") is not None and idx.location_of("a").tier is Tier.SSD  # type: ignore[union-attr]
    idx.check()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["put", "put", "put", "get", "release", "remove", "revoke"]),
        st.integers(0, 9),  # key
        st.sampled_from([10, 10, 10, 4, 16, 25]),  # size of a put
    ),
    max_size=60,
)


def _apply(idx: ObjectIndex, op: str, k: int, size: int, now: int) -> object:
    key = f"k{k}"
    try:
        if op == "put":
            res, events = idx.put_start(key, size, "w", now, f"k{k - 1}" if k else None)
            if res is not None and k % 3:  # some writes stay pending
                idx.put_end(key, "w", now)
            return (res, events)
        if op == "get":
            return idx.get(key, f"r{k % 2}", now)
        if op == "release":
            return idx.release_owner(f"r{k % 2}")
        if op == "remove":
            return idx.remove(key, now)
        idx.put_revoke(key, "w")
        return None
    except NoSpace as exc:
        return ("NoSpace", getattr(exc, "events", None))
    except (ObjectBusy, ObjectNotFound) as exc:
        return type(exc).__name__
    except Exception as exc:  # StaleWrite, WriteConflict: compared by type
        return type(exc).__name__


@settings(max_examples=150, deadline=None)
@given(ops=OPS, policy=st.sampled_from(["lru", "prefix_aware"]))
def test_the_fast_path_answers_as_the_general_path_does(
    ops: list[tuple[str, int, int]], policy: str
) -> None:
    fast, ref = make(50, policy), make(50, policy, reference=True)
    for step, (op, k, size) in enumerate(ops):
        now = step * 1_000
        assert _apply(fast, op, k, size, now) == _apply(ref, op, k, size, now), (step, op, k)
        fast.check()
    live = [idx.registry.segment("node/mem").space.taken_runs() for idx in (fast, ref)]
    assert live[0] == live[1]
