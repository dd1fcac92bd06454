"""A pool with a cluster secret, as real processes: the auth tests' fixture."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvpool.client.client import Client
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.waiting import wait_until

SECRET = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"
WRONG = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"


def secret_file(directory: Path, text: str = SECRET, name: str = "secret") -> Path:
    path = directory / name
    path.write_text(text + "\n")
    os.chmod(path, 0o600)
    return path


@dataclass
class SecuredPool:
    master: PoolProcess
    node: PoolProcess
    node_id: str
    data_address: str


@contextmanager
def secured_pool(
    directory: Path, *master_flags: str, node_size: str = "16MiB", **node_keys: object
) -> Iterator[SecuredPool]:
    """A master with no segment of its own (objects land on the node) and one node,
    both with the cluster secret in a file (``node_keys``: more of the node's config)."""
    path = secret_file(directory)
    with (
        start_master("--segment_size", "0", "--secret_file", str(path), *master_flags) as master,
        start_node(
            node_config(directory, master.address, node_size, secret_file=str(path), **node_keys)
        ) as node,
    ):
        with Client(master.address, credential=SECRET, timeout_s=5) as c:
            wait_until(lambda: c.stats()["tiers"]["memory"]["capacity"] > 0)
            (owner,) = [o for o in c.stats()["clients"] if o["client_id"].startswith("node-")]
        yield SecuredPool(master, node, owner["client_id"], owner["address"])
