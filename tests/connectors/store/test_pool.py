from __future__ import annotations

import re

import pytest

from kvpool.connectors.store.pool import EmbeddedPools, PoolHandle
from kvpool.engines import MISS, PoolEngine
from kvpool.errors import ObjectNotFound, PeerTimeout, TransferError
from tests.connectors.store.fake_pool import FakePool


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_outage_fails_fast_then_reconnects() -> None:
    pools: list[FakePool] = []

    def opener() -> FakePool:
        pools.append(FakePool())
        return pools[-1]

    clock = Clock()
    handle = PoolHandle(opener, reconnect_interval_s=5, describe="test", clock=clock)
    assert handle.call(lambda p: p.prefix_lookup(["a"])) == 0
    pools[0].down = True
    with pytest.raises(PeerTimeout):
        handle.call(lambda p: p.prefix_lookup(["a"]))
    assert pools[0].closed and "PeerTimeout" in handle.last_error
    clock.now = 4.9
    with pytest.raises(TransferError, match="unavailable"):
        handle.call(lambda p: p.prefix_lookup(["a"]))
    assert len(pools) == 1  # no reconnect attempt inside the interval
    clock.now = 5.0
    assert handle.call(lambda p: p.prefix_lookup(["a"])) == 0
    assert len(pools) == 2


def test_a_miss_is_an_answer_not_an_outage() -> None:
    pool = FakePool()
    handle = PoolHandle(lambda: pool, reconnect_interval_s=5, describe="test")
    assert handle.call(lambda p: p.batch_get_parts(["nope"], [[bytearray(4)]])) == [MISS]

    def raise_miss(p: PoolEngine) -> None:
        raise ObjectNotFound("nope")

    with pytest.raises(ObjectNotFound):
        handle.call(raise_miss)
    assert not pool.closed
    assert handle.call(lambda p: p.batch_exists(["nope"])) == [False]


def test_failed_open_is_retried_after_the_interval() -> None:
    clock = Clock()
    attempts = []

    def opener() -> FakePool:
        attempts.append(clock.now)
        if len(attempts) == 1:
            raise ConnectionRefusedError("no master")
        return FakePool()

    handle = PoolHandle(opener, reconnect_interval_s=2, describe="test", clock=clock)
    with pytest.raises(TransferError, match="cannot open pool"):
        handle.call(lambda p: p.prefix_lookup([]))
    clock.now = 2.5
    assert handle.call(lambda p: p.prefix_lookup([])) == 0
    assert attempts == [0.0, 2.5]


def test_embedded_pools_are_shared_per_process() -> None:
    made: list[FakePool] = []

    def factory() -> FakePool:
        made.append(FakePool())
        return made[-1]

    try:
        a = EmbeddedPools.get("t1", factory)
        b = EmbeddedPools.get("t1", factory)
        assert a.batch_put_parts(["k"], [[b"abc"]]) == [None]
        assert b.batch_get_parts(["k"], [[bytearray(3)]]) == [3] and len(made) == 1
        b.close()  # one user closing does not close the shared pool
        assert not made[0].closed
        with pytest.raises(ValueError, match="already exists"):
            EmbeddedPools.install(FakePool(), "t1")
    finally:
        EmbeddedPools.release("t1")
    assert made[0].closed and EmbeddedPools.peek("t1") is None


def test_repeated_outages_back_off() -> None:
    clock = Clock()
    pool = FakePool()
    pool.down = True
    handle = PoolHandle(lambda: pool, reconnect_interval_s=5, describe="test", clock=clock)

    def outage_then_wait() -> float:
        with pytest.raises(PeerTimeout):
            handle.call(lambda p: p.prefix_lookup([]))
        with pytest.raises(TransferError, match="unavailable") as info:
            handle.call(lambda p: p.prefix_lookup([]))
        found = re.search(r"retrying in ([0-9.]+)s", str(info.value))
        assert found is not None
        return float(found.group(1))

    waits = []
    for _ in range(6):
        waits.append(outage_then_wait())
        clock.now += waits[-1]
    assert waits == [5, 10, 20, 40, 60, 60]
    pool.down = False
    assert handle.call(lambda p: p.prefix_lookup([])) == 0  # a success resets the wait
    pool.down = True
    assert outage_then_wait() == 5


def test_open_opens_once_and_a_failure_is_not_held_against_the_pool() -> None:
    opened: list[int] = []
    fail = [True]

    def opener() -> FakePool:
        if fail[0]:
            raise ConnectionRefusedError("nobody there")
        opened.append(1)
        return FakePool()

    handle = PoolHandle(opener, reconnect_interval_s=60, describe="test")
    assert not handle.open() and "nobody there" in handle.last_error
    fail[0] = False
    # not marked down: the next call opens at once, not after the 60 s interval
    assert handle.call(lambda p: p.batch_exists(["k"])) == [False]
    assert handle.open() and opened == [1]
