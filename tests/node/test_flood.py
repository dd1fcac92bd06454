"""A connection flood from a peer with no credential, against a real secured pool: 2,000
idle and 2,000 slow-handshake connections held on the node's data port and on the
master's port while a real client keeps storing and reading, with no error and no wrong
byte, and the node's threads stay few (each waiting connection costs a descriptor only).
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.core.credentials import Credential
from kvpool.net import http_get
from tests.master.auth_pool import SECRET, SecuredPool, secured_pool
from tests.waiting import wait_until

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


class Flooder:
    """``python -m kvpool.testing.flood``, its ``open`` lines read as they come."""

    def __init__(self, *addresses: str) -> None:
        argv = [*addresses, "--idle", str(FLOOD), "--slow", str(FLOOD), "--seconds", "300"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.testing.flood", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.opened = [0] * len(addresses)  # connections opened so far, per port
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            fields = line.split()[1:]
            self.opened = [int(f.split("/")[1]) for f in fields]

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self._reader.join(10)
            assert self.proc.stdout is not None
            self.proc.stdout.close()


def test_a_flood_without_a_credential_locks_no_client_out(pool: SecuredPool) -> None:
    before = _threads(pool.node.pid)
    flooder = Flooder(pool.data_address, pool.master.address)
    try:
        # both ports have met every connection of the flood
        wait_until(
            lambda: min(flooder.opened) >= 2 * FLOOD, timeout_s=120, what="the flood is open"
        )
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
