"""What the tests of the pool's processes share (tests/client, tests/master, tests/node).

The ``master`` and ``client`` fixtures: a fresh ``kvpool master`` per test (8 MiB segment,
2 s client TTL, so an expiry is seen quickly) and a client connected to it; each folder's
conftest.py imports them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvpool.client.client import Client
from kvpool.testing.processes import PoolProcess, start_master

__all__ = ["client", "master"]


@pytest.fixture
def master() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "8MiB", "--client_ttl", "2") as proc:
        yield proc


@pytest.fixture
def client(master: PoolProcess) -> Iterator[Client]:
    with Client(master.address, timeout_s=5) as c:
        yield c
