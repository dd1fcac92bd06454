"""A connection flood from a peer with no credential, against a real secured pool: 2,000
idle and 2,000 slow-handshake connections held on the node's data port and on the
master's port while a real client keeps storing and reading, with no error and no wrong
byte, and the node's threads stay few (each waiting connection costs a descriptor only).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.net import http_get
from kvpool.security.credentials import Credential
from kvpool.testing.flood import FloodProcess
from tests.master.auth_pool import SECRET, SecuredPool, secured_pool

FLOOD = 2000  # of each kind, per port
OBJECT = 64 << 10
ROUNDS = 60


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[SecuredPool]:
    with secured_pool(tmp_path, node_size="64MiB") as p:
        yield p


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError(f"no Threads line for {pid}")


def test_a_flood_without_a_credential_locks_no_client_out(pool: SecuredPool) -> None:
    before = _threads(pool.node.pid)
    flooder = FloodProcess(pool.data_address, pool.master.address, idle=FLOOD, slow=FLOOD)
    try:
        flooder.wait_opened(2 * FLOOD)  # both ports have met every connection of the flood
        errors: list[BaseException] = []
        with Client(pool.master.address, credential=SECRET, allow_shm=False, timeout_s=10) as c:
            for i in range(ROUNDS):  # bounded: ROUNDS puts and reads, each checked
                data = bytes([i % 251]) * OBJECT
                try:
                    c.put(f"k{i}", data)
                    assert c.get(f"k{i}") == data
                except Exception as exc:  # counted, so the assertion names them all
                    errors.append(exc)
        assert errors == []
        # the operator's HTTP endpoints on the flooded port answer too
        token = Credential.parse(SECRET, "k").operator_token()
        reply = http_get(
            f"http://{pool.master.address}/metrics",
            10,
            headers={"Authorization": f"Bearer {token}"},
        )
        assert reply.ok, reply.error
        # the flood held no thread of the node's: a handful more at most
        assert _threads(pool.node.pid) < before + 16
    finally:
        flooder.stop()
    # and once it is gone the pool serves as before
    with Client(pool.master.address, credential=SECRET, allow_shm=False, timeout_s=10) as c:
        c.put("after", b"x" * OBJECT)
        assert c.get("after") == b"x" * OBJECT
