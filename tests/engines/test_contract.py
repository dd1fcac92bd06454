"""The rules of :mod:`kvpool.engines.base`, checked with real bytes against every engine.

Two rules real Mooncake cannot keep, and what it does instead, are checked for it
explicitly (see :mod:`kvpool.mooncake.engine`):
- no pins: ``pin`` and ``release`` answer 0 and protect nothing;
- probes and reads take a lease (``default_kv_lease_ttl``): what a lookup found stays
  while the pool evicts around it — the protection a request has on Mooncake.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest

from kvpool.engines import MISS, POOL_TTL, PoolEngine
from kvpool.errors import NoSpace, PeerTimeout, TransferError
from tests.engines.conftest import (
    CAPACITY,
    HARNESSES,
    HOLDER,
    OBJECT_SIZE,
    OWNER,
    Harness,
    fresh,
    kinds,
)
from tests.waiting import wait_until


def value(key: str) -> bytes:
    digest = hashlib.blake2b(key.encode()).digest()
    return (digest * (OBJECT_SIZE // len(digest) + 1))[:OBJECT_SIZE]


def put(engine: PoolEngine, keys: list[str], parents: list[str | None] | None = None) -> list:
    """Each key's value stored as one part."""
    return engine.batch_put_parts(keys, [[value(k)] for k in keys], parents=parents)


def read(engine: PoolEngine, keys: list[str]) -> list[bytes | None]:
    """Each key's object read into one part of OBJECT_SIZE bytes."""
    buffers = [bytearray(OBJECT_SIZE) for _ in keys]
    sizes = engine.batch_get_parts(keys, [[b] for b in buffers])
    assert all(n in (MISS, OBJECT_SIZE) for n in sizes), sizes
    return [bytes(b) if n != MISS else None for b, n in zip(buffers, sizes, strict=True)]


def fill(engine: PoolEngine) -> list[str]:
    """Put as many new objects as the pool holds; each must be stored."""
    keys = fresh(CAPACITY, "fill")
    assert put(engine, keys) == [None] * CAPACITY
    return keys


def hold_the_rest(engine: PoolEngine, stored: int) -> None:
    """Fill the pool's free room (it holds ``stored`` objects) with objects pinned by
    HOLDER, so that only the ``stored`` ones can be evicted."""
    others = fresh(CAPACITY - stored, "held")
    # A pool at its high watermark may run an eviction round between the puts and the pin
    # (kvpool's master ticks on its own): put what went missing again and pin, bounded.
    for _ in range(10):
        assert put(engine, others) == [None] * len(others)  # a stored key is a no-op
        if engine.pin(others, HOLDER, 60_000) == len(others):
            return
    raise AssertionError("could not fill the pool's free room with pinned objects")


def put_one(engine: PoolEngine) -> object:
    return put(engine, fresh(1, "new"))[0]


def test_engine_names_its_adapter_and_answers_health(harness: Harness) -> None:
    assert isinstance(harness.engine, PoolEngine)
    assert harness.engine.engine == harness.name
    assert isinstance(harness.engine.health(), dict)


def test_batch_results_are_per_key_in_the_order_asked(engine: PoolEngine) -> None:
    a, b, c = fresh(3)
    (missing,) = fresh(1, "missing")
    assert put(engine, [a, b, c]) == [None, None, None]
    assert read(engine, [c, missing, a]) == [value(c), None, value(a)]
    assert engine.batch_exists([a, missing, c]) == [True, False, True]
    assert engine.prefix_lookup([a, b, missing, c]) == 2
    assert engine.batch_exists([]) == [] and engine.prefix_lookup([]) == 0


def test_a_chained_put_is_stored_per_key_too(engine: PoolEngine) -> None:
    a, b, c = fresh(3)
    assert put(engine, [a, b, c], parents=[None, a, b]) == [None, None, None]
    assert read(engine, [a, b, c]) == [value(a), value(b), value(c)]


def test_a_duplicate_put_is_a_harmless_success(engine: PoolEngine) -> None:
    a, b = fresh(2)
    assert put(engine, [a]) == [None]
    assert engine.batch_put_parts([a, b], [[bytes(OBJECT_SIZE)], [value(b)]]) == [None, None]
    assert put(engine, [a], parents=[b]) == [None]
    assert read(engine, [a, b]) == [value(a), value(b)]  # the first copy stays


def test_a_miss_is_MISS_and_leaves_the_buffer_alone(engine: PoolEngine) -> None:
    buffer = bytearray(b"\x07" * 16)
    assert engine.batch_get_parts(fresh(1, "missing"), [[buffer]]) == [MISS]
    assert buffer == bytearray(b"\x07" * 16)


def test_a_corrupted_object_is_a_miss_until_replaced(harness: Harness, engine: PoolEngine) -> None:
    good, bad = fresh(2)
    put(engine, [good, bad])
    harness.corrupt(bad)
    assert read(engine, [good, bad]) == [value(good), None]  # never the wrong bytes
    assert read(engine, [bad]) == [None]
    # kvpool's engines drop a copy that failed its checksum when they find it (remove is
    # then False); another engine may keep it until the connector removes it
    engine.remove(bad)
    assert engine.batch_exists([bad]) == [False]
    assert put(engine, [bad]) == [None]  # ... so that a recomputed copy replaces it
    assert read(engine, [bad]) == [value(bad)]


# ------------------------------------------------------------ multi-part moves
# A page is one block of every layer: one object stored from, and read into, L pieces.
SPLIT = (1000, OBJECT_SIZE // 2)  # cut points: three parts of uneven sizes


def split(data: bytes, cuts: tuple[int, ...] = SPLIT) -> list[bytes]:
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def read_parts(engine: PoolEngine, keys: list[str], sizes: list[int]) -> list[list[bytes] | None]:
    parts = [[bytearray(n) for n in sizes] for _ in keys]
    got = engine.batch_get_parts(keys, parts)
    assert all(n == MISS or n == sum(sizes) for n in got), got
    return [[bytes(p) for p in ps] if n != MISS else None for ps, n in zip(parts, got, strict=True)]


def test_parts_round_trip_as_one_object(engine: PoolEngine) -> None:
    a, b = fresh(2)
    assert engine.batch_put_parts([a], [split(value(a))], parents=[None]) == [None]
    assert put(engine, [b]) == [None]  # stored whole
    # any split reads the same bytes back, and a parts-stored object reads whole
    other = [300, OBJECT_SIZE - 300]
    assert read_parts(engine, [a, b], other) == [split(value(a), (300,)), split(value(b), (300,))]
    assert read(engine, [a]) == [value(a)]
    assert engine.batch_put_parts([], []) == [] and engine.batch_get_parts([], []) == []


def test_parts_of_a_missing_corrupt_or_other_sized_object_are_a_miss(
    harness: Harness, engine: PoolEngine
) -> None:
    good, bad, small = fresh(3)
    (missing,) = fresh(1, "missing")
    sizes = [len(p) for p in split(value(good))]
    assert engine.batch_put_parts([good, bad], [split(value(good)), split(value(bad))]) == [
        None,
        None,
    ]
    assert engine.batch_put_parts([small], [[value(small)[:1000]]]) == [None]
    harness.corrupt(bad)
    assert read_parts(engine, [good, missing, bad, small], sizes) == [
        split(value(good)),
        None,
        None,  # never the wrong bytes reported good
        None,  # a smaller object than the parts
    ]
    assert read_parts(engine, [good], [*sizes, 1]) == [None]  # parts larger than the object
    assert read_parts(engine, [good], [1000, 1000]) == [None]  # ... and smaller
    assert read_parts(engine, [good], sizes) == [split(value(good))]  # still there


def protect(engine: PoolEngine, harness: Harness, keys: list[str]) -> None:
    """Make ``keys`` unevictable for the test: a pin, or on an engine without pins the
    lease its probe takes."""
    if harness.pins:
        # as in hold_the_rest: an eviction round of the master's own may take one of a full
        # pool's objects before the pin (seen on a loaded host); put it again, bounded
        for _ in range(10):
            if engine.pin(keys, HOLDER, 60_000) == len(keys):
                return
            assert put(engine, keys) == [None] * len(keys)  # a stored key is a no-op
        raise AssertionError(f"could not pin {len(keys)} objects of a full pool")
    else:
        assert engine.batch_exists(keys) == [True] * len(keys)


@pytest.mark.parametrize("harness", kinds(probes_lease=False), indirect=True)
def test_probes_take_no_lease(harness: Harness, engine: PoolEngine) -> None:
    (probed,) = fresh(1, "probed")
    put(engine, [probed])
    for _ in range(3):
        assert engine.batch_exists([probed]) == [True]
        assert engine.prefix_lookup([probed]) == 1
    hold_the_rest(engine, stored=1)
    assert put_one(engine) is None  # NoSpace if a probe had left a lease behind
    assert engine.batch_exists([probed]) == [False]


@pytest.mark.parametrize("harness", kinds(probes_lease=True), indirect=True)
def test_probes_lease_what_they_find_where_the_engine_says_so(
    harness: Harness, engine: PoolEngine
) -> None:
    # Mooncake: the probes leased it, so a put into the full pool evicts around it
    (probed,) = fresh(1, "probed")
    put(engine, [probed])
    assert engine.batch_exists([probed]) == [True]
    assert engine.prefix_lookup([probed]) == 1
    others = fresh(CAPACITY - 1, "other")
    assert put(engine, others) == [None] * len(others)
    assert put_one(engine) is None
    assert engine.batch_exists([probed]) == [True]


@pytest.mark.parametrize("harness", kinds(probes_lease=False), indirect=True)
def test_reads_leave_no_lease_behind(harness: Harness, engine: PoolEngine) -> None:
    (was_read,) = fresh(1, "read")
    put(engine, [was_read])
    assert read(engine, [was_read]) == [value(was_read)]
    hold_the_rest(engine, stored=1)
    assert put_one(engine) is None
    assert engine.batch_exists([was_read]) == [False]


@pytest.mark.parametrize("harness", kinds(probes_lease=True), indirect=True)
def test_reads_lease_what_they_read_where_the_engine_says_so(
    harness: Harness, engine: PoolEngine
) -> None:
    # Mooncake: a read leases too; the pool evicts an unread object instead
    (was_read,) = fresh(1, "read")
    put(engine, [was_read])
    assert read(engine, [was_read]) == [value(was_read)]
    others = fresh(CAPACITY - 1, "other")
    assert put(engine, others) == [None] * len(others)
    assert put_one(engine) is None
    assert read(engine, [was_read]) == [value(was_read)]


@pytest.mark.parametrize("harness", kinds(pins=True), indirect=True)
def test_pin_and_release_count_what_they_protect(harness: Harness, engine: PoolEngine) -> None:
    (stored,) = fresh(1, "pinned")
    put(engine, [stored])
    assert engine.pin([stored], OWNER, 60_000) == 1
    assert engine.release(OWNER) == 1


@pytest.mark.parametrize("harness", kinds(pins=False), indirect=True)
def test_an_engine_without_pins_says_so(harness: Harness, engine: PoolEngine) -> None:
    # Mooncake: a no-op, stated, never a pretended pin
    (stored,) = fresh(1, "pinned")
    put(engine, [stored])
    assert engine.pin([stored], OWNER, 60_000) == 0
    assert engine.release(OWNER) == 0


@pytest.mark.parametrize("harness", kinds(pins=True), indirect=True)
def test_a_pin_protects_until_released(harness: Harness, engine: PoolEngine) -> None:
    (pinned,) = fresh(1, "pinned")
    put(engine, [pinned])
    assert engine.pin([pinned, *fresh(1, "missing")], OWNER, 60_000) == 1  # stored ones only
    hold_the_rest(engine, stored=1)
    assert isinstance(put_one(engine), NoSpace)
    assert read(engine, [pinned]) == [value(pinned)]
    assert engine.release(OWNER) == 1
    assert put_one(engine) is None
    assert engine.batch_exists([pinned]) == [False]


@pytest.mark.parametrize("harness", kinds(pins=True), indirect=True)
def test_a_pin_ends_with_its_ttl(harness: Harness, engine: PoolEngine) -> None:
    (pinned,) = fresh(1, "pinned")
    put(engine, [pinned])
    assert engine.pin([pinned], OWNER, 1500) == 1
    hold_the_rest(engine, stored=1)
    assert isinstance(put_one(engine), NoSpace)
    wait_until(lambda: put_one(engine) is None, timeout_s=10, what="the pin's TTL to end")
    assert engine.batch_exists([pinned]) == [False]


@pytest.mark.parametrize("harness", kinds(pins=True), indirect=True)
def test_a_pool_full_of_pins_refuses_puts_until_the_pools_lease_ttl_ends_them(
    harness: Harness, engine: PoolEngine
) -> None:
    # POOL_TTL is what a request's lookup pins with: the pool's default_kv_lease_ttl, so
    # pins can make puts wait, never fail for ever.
    held = fill(engine)
    assert engine.pin(held, OWNER, POOL_TTL) == CAPACITY
    assert isinstance(put_one(engine), NoSpace)
    wait_until(lambda: put_one(engine) is None, timeout_s=30, what="the pins' TTL to end")
    # the pins are gone, so eviction took at least one of them (a watermark round at a
    # full pool may take more)
    assert engine.batch_exists(held).count(False) >= 1


def test_a_full_pool_answers_no_space_per_key(harness: Harness, engine: PoolEngine) -> None:
    held = fill(engine)
    protect(engine, harness, held)
    for parents in (None, [None, "x"]):  # both put paths
        keys = fresh(2, "refused")
        results = put(engine, keys, parents=parents)
        assert [type(r) for r in results] == [NoSpace, NoSpace], results
        assert engine.batch_exists(keys) == [False, False]
    assert read(engine, held) == [value(k) for k in held]


@pytest.mark.parametrize("name", [n for n, h in HARNESSES.items() if h.remote])
def test_an_unreachable_pool_raises(name: str) -> None:
    # a pool behind a socket can vanish; the answer is an error, never a hang (the
    # suite's timeout would catch one)
    unreachable = HARNESSES[name].unreachable
    assert unreachable is not None
    engine = unreachable()
    try:
        for call in (
            lambda: engine.batch_exists(["k"]),
            lambda: engine.prefix_lookup(["k"]),
            lambda: engine.batch_get_parts(["k"], [[bytearray(4)]]),
            lambda: engine.batch_put_parts(["k"], [[b"v"]]),
        ):
            with pytest.raises((TransferError, PeerTimeout)):
                call()
    finally:
        engine.close()
