"""What the tests of the pool's processes share (tests/client, tests/master, tests/node).

The ``master`` and ``client`` fixtures: a fresh ``kvpool master`` per test (8 MiB segment,
2 s client TTL, so an expiry is seen quickly) and a client connected to it; each folder's
conftest.py imports them.  A master's and a node's settings for an SSD tier of their own,
and where the index says keys are.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.protocol import messages as m
from kvpool.testing.processes import PoolProcess, node_config, start_master

__all__ = ["client", "master", "ssd_flags", "ssd_node_config", "tiers_of"]


@pytest.fixture
def master() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "8MiB", "--client_ttl", "2") as proc:
        yield proc


@pytest.fixture
def client(master: PoolProcess) -> Iterator[Client]:
    with Client(master.address, timeout_s=5) as c:
        yield c


def ssd_flags(ssd: Path) -> tuple[str, ...]:
    """A master with a 1 MiB segment that offloads to a 16 MiB SSD tier under ``ssd``."""
    return (
        "--segment_size",
        "1MiB",
        "--enable_offload=true",
        f"--ssd_offload_path={ssd}",
        "--ssd_offload_limit",
        "16MiB",
    )


def ssd_node_config(directory: Path, master: str, ssd: Path) -> Path:
    """A node's mooncake.json: 1 MiB of memory that offloads to a 16 MiB SSD tier under ``ssd``."""
    return node_config(
        directory,
        master,
        "1MiB",
        enable_ssd_offload=True,
        ssd_offload_path=str(ssd),
        ssd_offload_limit="16MiB",
    )


def tiers_of(c: Client, keys: list[str]) -> dict[str, str]:
    """Where the index says each key is ("" for a miss); the read leases are released."""
    owner = "test-tiers"
    reply = c.call(m.BatchGet(owner, keys))
    assert isinstance(reply, m.Placements)
    c.call(m.ReleaseOwner(owner))
    return {p.key: p.tier if p.placed else "" for p in reply.items}
