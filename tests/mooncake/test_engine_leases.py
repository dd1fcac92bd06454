"""Mooncake's probes renew leases (Mooncake #2187): what kvpool's lookups do to a full pool.

The store connector looks up every block key of a request; on Mooncake each key found is
leased for ``default_kv_lease_ttl`` and cannot be evicted meanwhile.  Blocks behind a
hole in a prefix are of no use to that request, so kvpool's prefix lookup must not lease
them: otherwise a flood of such lookups keeps a full pool leased and every put fails.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.testing.mooncake import Namespace
from tests.mooncake.host import NamespacedEngine, mooncake_json
from tests.waiting import wait_until

OBJECT = 4 << 20
ROOM = 4  # objects the pool holds (18 MiB: 4 objects and their headers, not 5)


@pytest.fixture
def engine() -> Iterator[NamespacedEngine]:
    with Namespace() as ns:
        ns.new(
            "kvpool.testing.mooncake:MooncakeMaster",
            "--default_kv_lease_ttl=60000",  # longer than the test: nothing expires in it
            "--eviction_ratio=0.25",
        )
        config = mooncake_json("127.0.0.1:50051", ROOM * OBJECT + OBJECT // 2)
        yield NamespacedEngine(ns, ns.new("tests.mooncake.host:open_engine", config))


def test_a_flood_of_lookups_past_a_hole_leaves_room_for_puts(engine: NamespacedEngine) -> None:
    prefix = [f"block-{i}" for i in range(ROOM + 1)]  # blocks 0..4 of one request
    stored = [prefix[0], *prefix[2:]]  # block 1 was evicted: a hole
    assert engine.batch_put_parts(stored, [[bytes(OBJECT)]] * ROOM) == [None] * ROOM
    for _ in range(50):  # the same request, again and again
        assert engine.prefix_lookup(prefix) == 1
    # block 0 is leased; the blocks behind the hole are not, so the pool can still make
    # room.  Mooncake evicts in a background thread: a put may find the room a moment
    # after the one before it made some (bounded wait; a leased pool never gets there)
    for i in range(3):
        wait_until(
            lambda i=i: engine.batch_put_parts([f"new-{i}"], [[bytes(OBJECT)]]) == [None],
            timeout_s=20,
            interval_s=0.2,
            what=f"room for new-{i}",
        )
    assert engine.batch_exists([prefix[0]]) == [True]  # the prefix in use stayed


def test_probing_every_key_at_once_would_starve_the_pool(engine: NamespacedEngine) -> None:
    # what a lookup that probes all of a request's keys in one batch_is_exist does
    # (Mooncake #2187): every stored block is leased, and puts fail for the whole lease
    prefix = [f"block-{i}" for i in range(ROOM + 1)]
    stored = [prefix[0], *prefix[2:]]
    assert engine.batch_put_parts(stored, [[bytes(OBJECT)]] * ROOM) == [None] * ROOM
    assert engine.batch_exists(prefix) == [True, False, True, True, True]
    [refused] = engine.batch_put_parts(["new"], [[bytes(OBJECT)]])
    assert type(refused).__name__ == "NoSpace"


def test_a_lost_master_is_misses_and_an_unhealthy_pool() -> None:
    from kvpool.errors import TransferError

    with Namespace() as ns:
        master = ns.new("kvpool.testing.mooncake:MooncakeMaster")
        config = mooncake_json("127.0.0.1:50051", ROOM * OBJECT)
        engine = NamespacedEngine(ns, ns.new("tests.mooncake.host:open_engine", config))
        assert engine.batch_put_parts(["kept"], [[b"v" * 1000]]) == [None]
        ns.call(master, "kill")
        assert engine.batch_exists(["kept"]) == [False]  # Mooncake answers "not found"
        assert engine.batch_get_parts(["kept"], [[bytearray(1000)]]) == [-1]
        with pytest.raises(TransferError, match="no Mooncake master answers"):
            engine.health()
