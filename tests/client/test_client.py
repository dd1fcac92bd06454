"""The full client's metadata stream: releases and other answers nobody waits for are
posted, and their replies never stand in for the next call's."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from kvpool.client.client import CLOSE_SETTLE_S, OVERLAP_CHECKSUM_MAX, Client
from kvpool.embedded import EmbeddedPool
from kvpool.errors import KVPoolError, ObjectBusy, ObjectNotFound
from kvpool.protocol import messages as m
from kvpool.testing.processes import PoolProcess, start_master
from tests.threads import run_threads


def leases(client: Client) -> int:
    return int(client.stats()["active_leases"])


def test_get_exists_get_each_get_their_own_reply(client: Client) -> None:
    one, two = os.urandom(50_000), os.urandom(70_000)
    client.put("one", one)
    client.put("two", two)
    assert client.get("one") == one  # its Release is now owed a reply
    assert client.exists("two") is True
    assert client.exists("nothing") is False
    assert client.get("two") == two
    assert client.get("one") == one
    with pytest.raises(ObjectNotFound):
        client.get("nothing")  # a miss takes no lease and posts nothing
    assert client.batch_exists(["one", "nothing", "two"]) == [True, False, True]
    dst = np.zeros(70_000, dtype=np.uint8)
    assert client.get_into("two", dst) == 70_000
    assert client.prefix_lookup(["one", "two", "nothing"]) == 2
    assert dst.tobytes() == two


def test_an_error_reply_to_a_posted_request_is_not_the_next_calls(client: Client) -> None:
    client.put("k", b"value")
    client._post(m.Remove("not-there"))  # the master answers ObjectNotFound, owed
    assert client.exists("k") is True  # not the owed error, not an exception
    client._post(m.Remove("not-there"))
    assert client.get("k") == b"value"
    client._post(m.Remove("not-there"))
    assert client.remove("k") is True


def test_a_reads_lease_is_gone_once_the_next_call_returns(
    master: PoolProcess, client: Client
) -> None:
    client.put("a", b"a" * 1000)
    client.put("b", b"b" * 1000)
    assert client.get("a") == b"a" * 1000
    assert leases(client) == 0  # the stats call came after the release on the stream
    buffers = [bytearray(1000), bytearray(1000), bytearray(10)]
    assert client.batch_get_into(["a", "b", "missing"], buffers) == [1000, 1000, -1]
    assert client.exists("a")
    # another connection sees it too: the master answered this client's later call,
    # so it had handled the release before it
    with Client(master.address, timeout_s=5) as other:
        assert leases(other) == 0
        assert other.remove("a") is True  # ObjectBusy if the lease were still held
        assert other.remove("b") is True


def test_a_lease_held_during_the_read_blocks_removal_until_released(client: Client) -> None:
    """The read lease still does its job: the posted release is what ends it."""
    client.put("k", b"x" * 100)
    owner = "reader-1"
    placement = client.call(m.Get(owner, "k"))
    assert isinstance(placement, m.Placement) and placement.placed
    with pytest.raises(ObjectBusy):
        client.remove("k")
    client._post(m.Release(owner, ["k"]))
    assert client.remove("k") is True


def test_released_leases_let_a_full_pool_evict() -> None:
    """Read everything in a full pool, then put more: the puts must evict what was read."""
    with (
        # no watermark rounds: only the puts' own inline evictions make room
        start_master("--segment_size", "4MiB", "--eviction_high_watermark_ratio", "1.0") as proc,
        Client(proc.address, timeout_s=5) as c,
    ):
        block = os.urandom(1 << 20)
        for i in range(4):
            c.put(f"old{i}", block)
        for i in range(4):
            assert c.get(f"old{i}") == block
        for i in range(4):  # NoSpace if any read lease outlived its read
            c.put(f"new{i}", block)
        assert c.get("new3") == block


def test_master_killed_between_a_get_and_the_next_call_is_an_error_not_a_hang() -> None:
    with start_master("--segment_size", "8MiB") as proc:
        c = Client(proc.address, timeout_s=5)
        c.put("k", b"v" * 4096)
        assert c.get("k") == b"v" * 4096  # a release is owed a reply now
        proc.kill()
        start = time.monotonic()
        with pytest.raises(KVPoolError):
            c.exists("k")
        with pytest.raises(KVPoolError):  # reconnecting fails too: nobody listens
            c.exists("k")
        c.close()
        assert time.monotonic() - start < 5


def test_close_with_a_hung_master_is_bounded() -> None:
    with start_master("--segment_size", "8MiB") as proc:
        c = Client(proc.address, timeout_s=30)
        c.put("k", b"v" * 4096)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            c._post(m.Release("someone", ["k"]))  # its reply never comes while stopped
            start = time.monotonic()
            c.close()
            assert time.monotonic() - start < CLOSE_SETTLE_S + 4
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        with Client(proc.address, timeout_s=5) as again:
            assert again.get("k") == b"v" * 4096


def test_threads_sharing_a_client_get_their_own_bytes(client: Client) -> None:
    values = {f"t{i}": os.urandom(4096 + i) for i in range(8)}
    for key, value in values.items():
        client.put(key, value)
    errors: list[str] = []

    def reader(keys: list[str]) -> None:
        for _ in range(50):  # bounded
            for key in keys:
                if client.get(key) != values[key]:
                    errors.append(f"{key}: wrong bytes")
                if not client.exists(key):
                    errors.append(f"{key}: not found")

    keys = list(values)
    threads = [threading.Thread(target=reader, args=(keys[i::4],)) for i in range(4)]
    assert not run_threads(threads, 60)
    assert errors == []
    assert leases(client) == 0


def test_a_failed_put_revokes_its_reservation_without_waiting(
    master: PoolProcess, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put whose write fails revokes its reservation (posted): once the writer's next
    call returns, another writer may put the key (WriteConflict otherwise)."""
    client.put("warm", b"x")  # opens the data path to the master's segment
    (path,) = client._paths.values()

    def failing_write(*args: object, **kwargs: object) -> int:
        raise ValueError("the caller's buffer went away")

    monkeypatch.setattr(path, "run", failing_write)
    with pytest.raises(ValueError):
        client.put("r", b"first")
    monkeypatch.undo()
    assert client.exists("r") is False
    with Client(master.address, timeout_s=5) as other:
        other.put("r", b"second")
        assert other.get("r") == b"second"


@pytest.mark.parametrize("size", [1, 100_000, OVERLAP_CHECKSUM_MAX, OVERLAP_CHECKSUM_MAX + 1])
def test_puts_hashed_during_or_after_put_start_read_back_whole(client: Client, size: int) -> None:
    value = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8)
    client.put_from(f"v{size}", value)
    into = np.zeros(size, dtype=np.uint8)
    assert client.get_into(f"v{size}", into) == size
    assert np.array_equal(into, value)
    client.put_from(f"v{size}", value)  # already stored: a no-op, nothing owed or lost
    assert client.exists(f"v{size}")
    assert client.remove(f"v{size}")


def test_a_subclass_with_its_own_call_gets_releases_through_it() -> None:
    """The embedded pool has no master connection: its releases and revokes must still
    reach its in-process handler, and its puts hash after PutStart."""
    with EmbeddedPool(8 << 20) as pool:
        value = os.urandom(100_000)
        pool.put("k", value)
        assert pool.get("k") == value
        assert leases(pool) == 0
        assert pool.batch_get_into(["k"], [bytearray(100_000)]) == [100_000]
        assert leases(pool) == 0
        assert pool.remove("k") is True  # ObjectBusy if a lease were left
