"""A fresh client's first read after :meth:`Client.warm` sets nothing up that a later read
does not (counted, not timed): the store connector's worker warms its clients at start,
so a new instance's first pool hit costs what its later ones do."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool.client.client import Client
from kvpool.datapath import shm
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.testing.processes import PoolProcess

KEYS = [f"warm-{i}" for i in range(8)]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Counts of the set-up a first read of a segment does: asking its owner about it,
    mapping its shared memory (and whether the pages were populated in the caller)."""
    seen: dict[str, Any] = {"info": 0, "attach": 0, "populated_in_caller": []}
    info, attach = SegmentConnection.info, shm.Segment.attach

    def counting_info(self: SegmentConnection, segment_id: str) -> Any:
        seen["info"] += 1
        return info(self, segment_id)

    def counting_attach(name: str, **kwargs: Any) -> Any:
        seen["attach"] += 1
        seen["populated_in_caller"].append(kwargs.get("populate", True))
        return attach(name, **kwargs)

    monkeypatch.setattr(SegmentConnection, "info", counting_info)
    monkeypatch.setattr(shm.Segment, "attach", staticmethod(counting_attach))
    yield seen


def fill(master: PoolProcess, counted: dict[str, Any]) -> None:
    with Client(master.address, timeout_s=10) as writer:
        errors = writer.batch_put(KEYS, [np.full(64 << 10, i, np.uint8) for i in range(8)])
        assert errors == [None] * len(KEYS)
    counted.update(info=0, attach=0, populated_in_caller=[])  # the writer's own set-up


def first_read(client: Client) -> None:
    into = [np.zeros(64 << 10, np.uint8) for _ in KEYS]
    assert client.batch_get_into(KEYS, into) == [64 << 10] * len(KEYS)
    assert [int(a[0]) for a in into] == list(range(8))


def test_a_warmed_clients_first_read_sets_nothing_up(
    master: PoolProcess, counted: dict[str, Any]
) -> None:
    fill(master, counted)
    with Client(master.address, timeout_s=10) as fresh:
        assert fresh.warm() == 1  # the master's one memory segment
        done_by_warm = dict(counted)
        first_read(fresh)
    assert done_by_warm["info"] == 1 and done_by_warm["attach"] == 1
    assert counted["info"] == 1 and counted["attach"] == 1  # nothing more on the read
    # the segment's pages are populated in the background, never in a reader's call
    assert counted["populated_in_caller"] == [False]


def test_an_unwarmed_client_sets_up_on_its_first_read(
    master: PoolProcess, counted: dict[str, Any]
) -> None:
    fill(master, counted)
    with Client(master.address, timeout_s=10) as fresh:
        first_read(fresh)
        assert counted["info"] == 1 and counted["attach"] == 1
        first_read(fresh)  # a later read sets nothing up
        assert counted["info"] == 1 and counted["attach"] == 1
