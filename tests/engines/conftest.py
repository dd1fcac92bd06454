"""One contract suite, every engine: the fixtures that give each test a pool of each kind.

Each engine has a *harness*: a context manager that opens a small pool (room for exactly
:data:`CAPACITY` objects of :data:`OBJECT_SIZE` bytes, no background eviction rounds),
and knows how to corrupt a stored object behind the engine's back and how to make an
engine that points at no pool at all.  Adding an engine (Mooncake Store) means writing its
adapter and harness, and adding the harness to :data:`HARNESSES`: one line.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvpool.core.index import IndexConfig
from kvpool.engines import EmbeddedEngine, MasterEngine, PoolEngine
from kvpool.net import free_port
from kvpool.protocol import messages as m
from kvpool.service.client import Client
from kvpool.service.embedded import EmbeddedPool
from kvpool.storage.segment import Segment
from kvpool.testing.processes import start_master

OBJECT_SIZE = 1 << 20
CAPACITY = 4  # objects of OBJECT_SIZE a pool holds
LEASE_TTL_MS = 3000  # each pool's lease TTL: what a POOL_TTL pin lasts
# Tests pin as these owners; both are released after each test.
OWNER = "contract-owner"
HOLDER = "contract-holder"

_names = itertools.count()
_created: list[str] = []  # keys handed out by fresh() during the running test


def fresh(n: int, tag: str = "k") -> list[str]:
    """Keys no earlier test used; removed again when the test ends, so each test starts
    with an empty pool (what a fill evicts depends on what else the pool holds)."""
    keys = [f"{tag}-{next(_names):06d}" for _ in range(n)]
    _created.extend(keys)
    return keys


@dataclass
class Harness:
    name: str
    engine: PoolEngine
    corrupt: Callable[[str], None]  # flip bytes of a stored object where it lives


@dataclass(frozen=True)
class Kind:
    """How to open one engine's pool, and, for a pool behind a socket, an engine that
    points at no pool at all (an in-process pool cannot be lost)."""

    open: Callable[[], contextlib.AbstractContextManager[Harness]]
    unreachable: Callable[[], PoolEngine] | None = None

    @property
    def remote(self) -> bool:
        return self.unreachable is not None


@contextlib.contextmanager
def embedded() -> Iterator[Harness]:
    config = IndexConfig(high_watermark=1.0, lease_ttl_ms=LEASE_TTL_MS)
    pool = EmbeddedPool(CAPACITY * OBJECT_SIZE, config=config)

    def corrupt(key: str) -> None:
        placement = pool.call(m.Get("contract-damage", key))
        assert isinstance(placement, m.Placement) and placement.placed, key
        try:
            segment = pool.storage.segment
            assert segment is not None
            original = bytearray(64)
            segment.read_into(placement.offset, memoryview(original))
            segment.write(placement.offset, bytes(b ^ 0xFF for b in original))
        finally:
            pool.call(m.Release("contract-damage", [key]))

    engine = EmbeddedEngine(pool)
    try:
        yield Harness("embedded", engine, corrupt)
    finally:
        engine.close()


@contextlib.contextmanager
def kvpool_master() -> Iterator[Harness]:
    # No watermark rounds: only a put's own inline eviction makes room.
    flags = (
        "--segment_size",
        f"{CAPACITY * OBJECT_SIZE}",
        "--eviction_high_watermark_ratio",
        "1.0",
        "--default_kv_lease_ttl",
        f"{LEASE_TTL_MS}",
    )
    with start_master(*flags) as proc, Client(proc.address, timeout_s=5) as backdoor:

        def corrupt(key: str) -> None:
            placement = backdoor.call(m.Get("contract-damage", key))
            assert isinstance(placement, m.Placement) and placement.placed, key
            backdoor.call(m.Release("contract-damage", [key]))
            with Segment.attach(placement.shm_name) as segment:
                view = segment.view(placement.offset + 100, 1)
                view[0] ^= 0xFF
                del view

        engine = MasterEngine.connect(proc.address, timeout_s=5)
        try:
            yield Harness("kvpool", engine, corrupt)
        finally:
            engine.close()


#: every engine the suite runs against, by its ``engine`` name
HARNESSES: dict[str, Kind] = {
    "embedded": Kind(embedded),
    "kvpool": Kind(
        kvpool_master, lambda: MasterEngine.connect(f"127.0.0.1:{free_port()}", timeout_s=2)
    ),
}


@pytest.fixture(scope="module", params=sorted(HARNESSES))
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """One pool per engine for the whole module (one master process, not one per test)."""
    with HARNESSES[request.param].open() as h:
        yield h


@pytest.fixture
def engine(harness: Harness) -> Iterator[PoolEngine]:
    yield harness.engine
    for owner in (OWNER, HOLDER):  # a test's pins never outlive it
        harness.engine.release(owner)
    for key in _created:
        harness.engine.remove(key)
    _created.clear()
