"""Replicas end to end: a real master, three real nodes, puts in two copies, then one node
SIGKILLed or one copy corrupted.  Every acknowledged put is still read, bytes equal."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.datapath.data_ops import WriteOp
from kvpool.protocol import messages as m
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node

KEYS = 40


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[PoolProcess, list[PoolProcess]]]:
    with start_master("--segment_size", "0", "--client_ttl", "30") as master:
        nodes: list[PoolProcess] = []
        try:
            for n in range(3):
                home = tmp_path / f"node{n}"
                home.mkdir()
                nodes.append(start_node(node_config(home, master.address, "4MiB")))
            with Client(master.address, timeout_s=5, transport="tcp") as probe:
                _wait_for_segments(probe, 3)
            yield master, nodes
        finally:
            for node in nodes:
                node.stop()


def _wait_for_segments(client: Client, count: int) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if len(client.stats().get("segments", [])) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} segments registered: {client.stats()}")


def _value(i: int) -> bytes:
    return (i.to_bytes(4, "little") + os.urandom(16)) * 512  # 10 KiB, unique per key


def test_a_killed_node_loses_no_put_made_in_two_copies(
    pool: tuple[PoolProcess, list[PoolProcess]],
) -> None:
    master, nodes = pool
    values = {f"k{i}": _value(i) for i in range(KEYS)}
    with Client(master.address, timeout_s=5, transport="tcp", replica_num=2) as client:
        for key in list(values)[: KEYS // 2]:
            client.put_from(key, values[key])
        rest = list(values)[KEYS // 2 :]
        assert client.batch_put(rest, [values[k] for k in rest]) == [None] * len(rest)
        granted = client.call(m.BatchGet("probe", list(values)))
        assert isinstance(granted, m.Placements)
        client.call(m.ReleaseOwner("probe"))
        assert {p.copies for p in granted.items} == {2}
        on_killed = [p.key for p in granted.items if p.data_address.endswith(f":{nodes[0].port}")]
        assert on_killed  # reads of these must fall back to their other copy
        nodes[0].kill()
        # single reads and batch reads both fall back to the other copy
        for key in list(values)[::2]:
            assert client.get(key) == values[key], key
        keys = list(values)[1::2]
        buffers = [bytearray(len(values[k])) for k in keys]
        sizes = client.batch_get_into(keys, buffers)
        assert sizes == [len(values[k]) for k in keys]
        assert all(bytes(b) == values[k] for k, b in zip(keys, buffers, strict=True))
        stats = client.stats()
    assert stats["objects"] == KEYS  # every object kept, now in the one copy left


def test_one_copy_is_lost_with_a_node_without_replicas(
    pool: tuple[PoolProcess, list[PoolProcess]],
) -> None:
    """The baseline: in one copy, the killed node's objects are misses (never wrong)."""
    master, nodes = pool
    values = {f"k{i}": _value(i) for i in range(KEYS)}
    with Client(master.address, timeout_s=5, transport="tcp", replica_num=1) as client:
        for key, value in values.items():
            client.put_from(key, value)
        nodes[0].kill()
        found = 0
        for key, value in values.items():
            got = client.batch_get([key])[0]
            assert got is None or got == value
            found += got is not None
    assert found < KEYS  # some lived on the killed node: lost, as they must be


def test_a_corrupt_copy_is_read_from_the_other(
    pool: tuple[PoolProcess, list[PoolProcess]],
) -> None:
    master, _nodes = pool
    value = _value(7)
    with Client(master.address, timeout_s=5, transport="tcp", replica_num=2) as client:
        client.put_from("k", value)
        first = client.call(m.Get("probe", "k"))
        assert isinstance(first, m.Placement) and first.copies == 2
        client.call(m.Release("probe", ["k"]))
        # overwrite the first copy's bytes in place, as a bad disk or DIMM would
        junk = memoryview(bytearray(b"\xff" * len(value)))
        client._path(first).run([WriteOp(first.segment_id, first.offset, junk)])
        assert client.get("k") == value
        assert client.corrupt_reads == 1
        again = client.call(m.Get("probe", "k"))
        assert isinstance(again, m.Placement)
        assert again.copies == 1 and again.segment_id != first.segment_id
