"""One contract suite, every engine: the fixtures that give each test a pool of each kind.

Each engine has a *harness*: a context manager that opens a small pool (room for exactly
:data:`CAPACITY` objects of :data:`OBJECT_SIZE` bytes, no background eviction rounds),
and knows how to corrupt a stored object behind the engine's back and how to make an
engine that points at no pool at all.  Adding an engine (Mooncake Store) means writing its
adapter and harness, and adding the harness to :data:`HARNESSES`: one line.

Mooncake's harness runs a real ``mooncake_master`` and the engine in a private network
namespace (:class:`kvpool.testing.mooncake.Namespace`); the test talks to the engine
through a pipe.  Where an engine cannot keep a rule (Mooncake has no pins, and its probes
and reads lease), the harness says so (:attr:`Harness.pins`, :attr:`Harness.probes_lease`)
and the suite checks what that engine does instead: nothing is skipped.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from kvpool.client.client import Client
from kvpool.core.objects import IndexConfig
from kvpool.embedded import EmbeddedPool
from kvpool.engines import EmbeddedEngine, MasterEngine, PoolEngine
from kvpool.net import free_port
from kvpool.protocol import messages as m
from kvpool.storage.segment import Segment
from kvpool.testing.mooncake import Namespace
from kvpool.testing.processes import start_master
from tests.e2e.damage import corrupt_in_place

OBJECT_SIZE = 4 << 20  # Mooncake's smallest segment (16 MiB) holds exactly CAPACITY
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
    pins: bool = True  # pin/release protect (False: they are no-ops answering 0)
    probes_lease: bool = False  # probes and reads lease what they find (Mooncake)


@dataclass(frozen=True)
class Kind:
    """How to open one engine's pool, and, for a pool behind a socket, an engine that
    points at no pool at all (an in-process pool cannot be lost)."""

    open: Callable[[], contextlib.AbstractContextManager[Harness]]
    unreachable: Callable[[], PoolEngine] | None = None
    pins: bool = True  # pin/release protect (False: they are no-ops answering 0)
    probes_lease: bool = False  # probes and reads lease what they find (Mooncake)

    @property
    def remote(self) -> bool:
        return self.unreachable is not None


@contextlib.contextmanager
def embedded() -> Iterator[Harness]:
    config = IndexConfig(high_watermark=1.0, lease_ttl_ms=LEASE_TTL_MS)
    pool = EmbeddedPool(CAPACITY * OBJECT_SIZE, config=config)

    def corrupt(key: str) -> None:
        corrupt_in_place(pool, key, "contract-damage")

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


# A lease longer than any one test: what a probe or read leased stays leased while the
# test looks (Mooncake's default, 10 s, which kvpool's advice keeps).
MOONCAKE_LEASE_MS = 10_000


@contextlib.contextmanager
def mooncake() -> Iterator[Harness]:
    from tests.mooncake.host import NamespacedEngine, mooncake_json

    with Namespace() as ns:
        master = ns.new(
            "kvpool.testing.mooncake:MooncakeMaster",
            f"--default_kv_lease_ttl={MOONCAKE_LEASE_MS}",
            "--eviction_high_watermark_ratio=1.0",
            "--eviction_ratio=0.25",
        )
        rpc = ns.call(master, "__getattribute__", "rpc_address")
        # 4.5 objects of room: CAPACITY objects and their 16-byte headers, not one more
        config = mooncake_json(rpc, CAPACITY * OBJECT_SIZE + OBJECT_SIZE // 2)
        engine = NamespacedEngine(ns, ns.new("tests.mooncake.host:open_engine", config))
        try:
            engine.health()
            yield Harness(
                "mooncake",
                engine,
                lambda key: ns.run("tests.mooncake.host:corrupt", engine.ref, key),
                pins=engine.pins,
                probes_lease=engine.probes_lease,
            )
        finally:
            engine.close()


def mooncake_unreachable() -> PoolEngine:
    from tests.mooncake.host import NamespacedEngine, mooncake_json

    ns = Namespace()  # nothing listens in it
    config = mooncake_json(f"127.0.0.1:{free_port()}", 0)
    return NamespacedEngine(
        ns, ns.new("tests.mooncake.host:open_engine", config), owns_namespace=True
    )


#: every engine the suite runs against, by its ``engine`` name
HARNESSES: dict[str, Kind] = {
    "embedded": Kind(embedded),
    "kvpool": Kind(
        kvpool_master, lambda: MasterEngine.connect(f"127.0.0.1:{free_port()}", timeout_s=2)
    ),
    "mooncake": Kind(mooncake, mooncake_unreachable, pins=False, probes_lease=True),
}


def kinds(**want: bool) -> list[str]:
    """The engine names whose :class:`Kind` has every attribute given, for
    ``@pytest.mark.parametrize("harness", kinds(pins=True), indirect=True)``: a rule an
    engine does not keep is tested where it holds, and what that engine does instead is
    tested on its own — never a test that returns early."""
    return [n for n, k in HARNESSES.items() if all(getattr(k, a) == v for a, v in want.items())]


@pytest.fixture(scope="module", params=sorted(HARNESSES))
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    """One pool per engine for the whole module (one master process, not one per test)."""
    kind = HARNESSES[request.param]
    with kind.open() as h:
        assert (h.pins, h.probes_lease) == (kind.pins, kind.probes_lease), request.param
        yield h


@pytest.fixture
def engine(harness: Harness) -> Iterator[PoolEngine]:
    yield harness.engine
    for owner in (OWNER, HOLDER):  # a test's pins never outlive it
        harness.engine.release(owner)
    for key in _created:
        harness.engine.remove(key)
    _created.clear()
