"""A rolling rotation of the cluster secret on real processes (127.0.0.1): a master, a
node and clients, each restarted or replaced one at a time, first onto a file holding the
new secret and the previous one, then onto the new secret alone.  After every step every
live client writes and reads through the node, and nothing is refused; at the end a
client holding only the old secret is."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.errors import AuthError, KVPoolError
from kvpool.net import free_port
from kvpool.security.credentials import Credential
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.master.auth_pool import SECRET as OLD
from tests.master.auth_pool import WRONG
from tests.waiting import wait_until

NEW = "7d2a9c4e6b1f3a5c8e0d2b4f6a8c1e3d5b7f9a0c2e4b6d8f1a3c5e7b9d0f2a4c"


def _status(address: str, secret: str) -> int:
    """The status code of ``GET /api/status`` with the operator token of ``secret``."""
    token = Credential.parse(secret, "k").operator_token()
    request = urllib.request.Request(
        f"http://{address}/api/status", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


class Rotation:
    """The pool's processes and which secret file each runs on."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.files = {
            "old": self._file("old", OLD),
            "both": self._file("both", f"{NEW}\n{OLD}"),
            "new": self._file("new", NEW),
        }
        self.master_address = f"127.0.0.1:{free_port()}"
        self.master: PoolProcess | None = None
        self.node: PoolProcess | None = None
        self.clients: dict[str, Client] = {}
        self.keys: list[str] = []

    def _file(self, name: str, text: str) -> str:
        path = self.dir / f"{name}.secret"
        path.write_text(text + "\n")
        os.chmod(path, 0o600)
        return str(path)

    def start_master(self, state: str) -> None:
        if self.master is not None:
            self.master.close()
        port = self.master_address.rsplit(":", 1)[1]
        self.master = start_master(
            "--port", port, "--segment_size", "0", "--client_ttl", "4",
            "--secret_file", self.files[state],
        )  # fmt: skip

    def start_node(self, state: str) -> None:
        if self.node is not None:
            self.node.close()
        config = node_config(self.dir, self.master_address, secret_file=self.files[state])
        self.node = start_node(config)

    def client(self, name: str, state: str) -> None:
        if name in self.clients:
            self.clients.pop(name).close()
        with open(self.files[state], encoding="utf-8") as f:
            credential = f.read()
        self.clients[name] = Client(
            self.master_address, credential=credential, timeout_s=5, allow_shm=False
        )

    def wait_for_node(self) -> None:
        """Every client reaches the master and the node is (re-)registered.  A client's
        first call after the master restarted fails on its old connection (the restart's
        own outage, not the rotation's; the next call reconnects): that is a
        TransferError, and a refusal (AuthError) here fails the test."""

        def ready(client: Client) -> bool:
            try:
                return bool(client.stats()["tiers"]["memory"]["capacity"] > 0)
            except AuthError:
                raise
            except KVPoolError:
                return False

        for client in self.clients.values():
            wait_until(lambda c=client: ready(c), timeout_s=30)

    def check(self, step: str) -> None:
        """Every live client writes a key and reads back every key written since the
        node last started: no request may fail."""
        for name, client in self.clients.items():
            key = f"{step}/{name}"
            client.put(key, key.encode() * 100)
            self.keys.append(key)
        for client in self.clients.values():
            for key in self.keys:
                assert client.get(key) == key.encode() * 100, (step, key)

    def close(self) -> None:
        for client in self.clients.values():
            client.close()
        for proc in (self.node, self.master):
            if proc is not None:
                proc.close()


@pytest.fixture
def rotation(tmp_path: Path) -> Iterator[Rotation]:
    r = Rotation(tmp_path)
    try:
        yield r
    finally:
        r.close()


@pytest.mark.timeout(240)
def test_a_rolling_rotation_refuses_no_request(rotation: Rotation) -> None:
    r = rotation
    r.start_master("old")
    r.start_node("old")
    r.client("a", "old")
    r.client("b", "old")
    r.wait_for_node()
    r.check("before")
    # phase 1: one process at a time onto "new, then previous"
    r.client("b", "both")  # a client that proves the old secret to the old master
    r.check("client-b-both")
    r.start_node("both")  # its memory is gone: only what is written from now on counts
    r.keys.clear()
    r.wait_for_node()
    r.check("node-both")
    r.start_master("both")
    r.wait_for_node()
    r.check("master-both")  # client a still holds only the old secret
    # the operator's HTTP token of either secret reads the master's status
    for secret in (OLD, NEW):
        assert _status(r.master_address, secret) == 200
    assert _status(r.master_address, WRONG) == 401
    r.client("a", "both")
    r.check("client-a-both")
    # phase 2: drop the previous secret, one process at a time
    r.start_master("new")
    r.wait_for_node()
    r.check("master-new")
    assert _status(r.master_address, OLD) == 401
    r.start_node("new")
    r.keys.clear()
    r.wait_for_node()
    r.check("node-new")
    r.client("a", "new")
    r.client("b", "new")
    r.check("after")
    # done: the old secret opens nothing any more
    stale = Client(r.master_address, credential=OLD, timeout_s=5)
    with stale, pytest.raises(AuthError, match="different secrets"):
        stale.stats()
