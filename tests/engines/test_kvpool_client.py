"""kvpool's engine reads a hit in place: from the pool straight into the parts.

A real master and node; the client's real transport (shared memory, or TCP only) is
wrapped to see which buffers each read lands in, so a test can fail if a read goes
through a staging buffer instead of the parts themselves.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from kvpool.client.client import Client
from kvpool.datapath.data_ops import DataOp, OpResult, ReadOp
from kvpool.datapath.path import NodeDataPath
from kvpool.datapath.transport import transport_named
from kvpool.engines import MISS, MasterEngine
from kvpool.protocol import messages as m
from kvpool.storage.segment import Segment
from kvpool.testing.processes import PoolProcess, start_master

LAYERS = 4
PART = 64 << 10  # one layer's block


class SeenPath:
    """A data path that passes every op list on and keeps the read ops it saw."""

    def __init__(self, path: NodeDataPath, seen: list[ReadOp]) -> None:
        self.path, self.seen = path, seen

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        self.seen.extend(op for op in ops if isinstance(op, ReadOp))
        return self.path.run(ops)

    def close(self) -> None:
        self.path.close()


class SeenTransport:
    def __init__(self, name: str) -> None:
        self.name = name
        self.inner = transport_named(name)
        self.seen: list[ReadOp] = []
        self.paths: list[NodeDataPath] = []

    def connect(self, address: str) -> SeenPath:
        path = self.inner.connect(address)
        self.paths.append(path)
        return SeenPath(path, self.seen)


@pytest.fixture(scope="module")
def master() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "16MiB") as proc:
        yield proc


def _engine(master: PoolProcess, route: str) -> tuple[MasterEngine, SeenTransport]:
    transport = SeenTransport(route)
    return MasterEngine(Client(master.address, timeout_s=5, transport=transport)), transport


def _pages(n: int, seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, PART, dtype=np.uint8) for _ in range(LAYERS)] for _ in range(n)]


def _put(engine: MasterEngine, prefix: str, seed: int) -> tuple[list[str], list[list[np.ndarray]]]:
    """Three keys under ``prefix`` put as random pages of LAYERS parts; the keys and pages."""
    keys = [f"{prefix}-{i}" for i in range(3)]
    pages = _pages(len(keys), seed)
    assert engine.batch_put_parts(keys, pages) == [None] * len(keys)
    return keys, pages


def _zeros(n: int) -> list[list[np.ndarray]]:
    """``n`` pages of LAYERS zeroed parts to read into."""
    return [[np.zeros(PART, dtype=np.uint8) for _ in range(LAYERS)] for _ in range(n)]


def _address(a: np.ndarray | memoryview) -> int:
    return int(np.frombuffer(a, dtype=np.uint8).ctypes.data)


def _corrupt(engine: MasterEngine, key: str, at: int) -> None:
    """Flip one byte of the stored object, where the node keeps it."""
    placement = engine.client.call(m.Get("damage", key))
    assert isinstance(placement, m.Placement) and placement.placed
    engine.client.call(m.Release("damage", [key]))
    with Segment.attach(placement.shm_name) as segment:
        view = segment.view(placement.offset + at, 1)
        view[0] ^= 0xFF
        del view


@pytest.mark.parametrize("route", ["shm", "tcp"])
def test_a_parts_read_lands_in_the_parts_with_no_staging(master: PoolProcess, route: str) -> None:
    engine, transport = _engine(master, route)
    try:
        keys, pages = _put(engine, f"in-place-{route}", seed=1)
        engine._staging = _NoStaging()  # type: ignore[assignment]  # a get may not stage
        into = _zeros(len(keys))
        assert engine.batch_get_parts(keys, into) == [PART * LAYERS] * len(keys)
        for got, want in zip(into, pages, strict=True):
            for g, w in zip(got, want, strict=True):
                assert np.array_equal(g, w)
        # every read landed in a part, one read per part: nothing went through a buffer
        parts = {_address(p) for page in into for p in page}
        assert sorted(_address(op.buffer) for op in transport.seen) == sorted(parts)
        (path,) = transport.paths
        segment_id = transport.seen[0].segment_id
        assert path.route(segment_id) == route
    finally:
        engine.close()


@pytest.mark.parametrize("route", ["shm", "tcp"])
def test_a_corrupted_object_read_in_place_is_a_miss(master: PoolProcess, route: str) -> None:
    engine, _ = _engine(master, route)
    try:
        keys, pages = _put(engine, f"damaged-{route}", seed=2)
        _corrupt(engine, keys[1], at=2 * PART + 7)  # in the third layer's part
        into = _zeros(len(keys))
        assert engine.batch_get_parts(keys, into) == [PART * LAYERS, MISS, PART * LAYERS]
        # the damaged copy was dropped, so a recomputed one stores again and reads back
        assert engine.batch_exists(keys[1:2]) == [False]
        assert engine.batch_put_parts(keys[1:2], pages[1:2]) == [None]
        (again,) = _zeros(1)
        assert engine.batch_get_parts(keys[1:2], [again]) == [PART * LAYERS]
        assert all(np.array_equal(g, w) for g, w in zip(again, pages[1], strict=True))
    finally:
        engine.close()


def test_parts_of_another_size_are_a_miss_and_read_nothing(master: PoolProcess) -> None:
    engine, transport = _engine(master, "shm")
    try:
        assert engine.batch_put_parts(["sized"], [_pages(1, seed=3)[0]]) == [None]
        short = [np.zeros(PART, dtype=np.uint8) for _ in range(LAYERS - 1)]
        assert engine.batch_get_parts(["sized"], [short]) == [MISS]
        assert transport.seen == []
        assert all(not p.any() for p in short)
    finally:
        engine.close()


class _NoStaging:
    def slots(self, sizes: Sequence[int]) -> list[memoryview]:
        raise AssertionError("a get staged its object")
