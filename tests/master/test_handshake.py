"""Every port of a pool with a secret, walked with no credential, a wrong one and the
right one: the master's RPC, its HTTP endpoints, and a node's data port."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.datapath.data_ops import read_into
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.errors import AuthError
from kvpool.net import http_get, split_address
from kvpool.protocol import messages as m
from kvpool.protocol.codec import HEADER_SIZE
from kvpool.protocol.data import DATA_REPLY_CODEC, DATA_REQUEST_CODEC, Error, SegmentRead
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.testing.processes import start_master
from tests.master.auth_pool import SECRET, WRONG, SecuredPool, secret_file, secured_pool

TOKEN = Credential.parse(SECRET, "k").operator_token()
STOLEN = 16 << 20  # what the raw read of the issue asked a node for


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredPool]:
    with (
        secured_pool(tmp_path_factory.mktemp("auth")) as p,
        Client(p.master.address, credential=SECRET, allow_shm=False) as c,
    ):
        c.put("victim", b"the user's prompt, as KV" * 100)
        yield p


def _get(pool: SecuredPool, path: str, token: str | None = None) -> tuple[int | None, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    reply = http_get(f"http://{pool.master.address}{path}", 5, headers=headers)
    return reply.status, reply.body


def _recv_reply(s: socket.socket) -> bytes:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data


def _segment_id(pool: SecuredPool) -> str:
    with Client(pool.master.address, credential=SECRET) as c:
        (owner,) = [o for o in c.stats()["clients"] if o["client_id"] == pool.node_id]
    return str(owner["segments"][0])


def test_the_master_rpc_port_refuses_a_client_without_a_credential(pool: SecuredPool) -> None:
    with (
        Client(pool.master.address, credential=None, timeout_s=5) as c,
        pytest.raises(AuthError, match="requires a credential: set KVPOOL_SECRET_FILE"),
    ):
        c.get("victim")
    # raw: the refusal is a reply frame of the RPC protocol, then the connection closes
    with socket.create_connection(split_address(pool.master.address), timeout=5) as s:
        frame = m.MASTER_REQUEST_CODEC.encode(m.Exists("victim"))
        s.sendall(frame)
        s.sendall(frame)  # what follows the first frame is dropped, never answered
        data = _recv_reply(s)
    header = m.MASTER_REPLY_CODEC.decode_header(data[:HEADER_SIZE])
    assert len(data) == HEADER_SIZE + header.body_length  # one reply, then the close
    reply = m.MASTER_REPLY_CODEC.decode_body(data[HEADER_SIZE:])
    assert isinstance(reply, Error) and reply.code == AuthError.code


def test_the_master_rpc_port_refuses_a_wrong_secret(pool: SecuredPool) -> None:
    with (
        Client(pool.master.address, credential=WRONG, timeout_s=5) as c,
        pytest.raises(AuthError, match="different secrets, or this is not the real server"),
    ):
        c.get("victim")


def test_the_master_http_endpoints_need_the_operators_token(pool: SecuredPool) -> None:
    for path in ("/api/status", "/metrics", "/status"):
        status, body = _get(pool, path)
        assert status == 401, path
        assert pool.node_id.encode() not in body and pool.data_address.encode() not in body
        assert _get(pool, path, Credential.parse(WRONG, "k").operator_token())[0] == 401
        assert _get(pool, path, SECRET)[0] == 401  # the secret itself is no token
    status, body = _get(pool, "/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, body = _get(pool, "/api/status", TOKEN)
    assert status == 200
    snapshot = json.loads(body)
    assert pool.node_id in [c["client_id"] for c in snapshot["clients"]]
    assert _get(pool, "/metrics", TOKEN)[0] == 200
    assert "objects" in json.loads(_get(pool, "/health", TOKEN)[1])


def test_a_nodes_data_port_gives_nothing_without_a_credential(pool: SecuredPool) -> None:
    host, port = split_address(pool.data_address)
    segment = _segment_id(pool)
    # the raw 16 MiB read: an AuthError reply, no payload, then the close
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(DATA_REQUEST_CODEC.encode(SegmentRead(segment, 0, STOLEN)))
        data = _recv_reply(s)
    header = DATA_REPLY_CODEC.decode_header(data[:HEADER_SIZE])
    reply = DATA_REPLY_CODEC.decode_body(data[HEADER_SIZE : HEADER_SIZE + header.body_length])
    assert isinstance(reply, Error) and reply.code == AuthError.code
    assert header.payload_length == 0 and len(data) < 1024
    with (
        SegmentConnection(host, port, PeerSettings(5)) as conn,
        pytest.raises(AuthError, match="requires a credential"),
    ):
        read_into(conn, segment, 0, bytearray(64))
    wrong = Credential.parse(WRONG, "k")
    with (
        SegmentConnection(host, port, PeerSettings(5, credential=wrong, client_id="c")) as conn,
        pytest.raises(AuthError, match="did not prove the cluster secret"),
    ):
        read_into(conn, segment, 0, bytearray(64))
    # a node credential of another node is no key to this node's data port
    other = Credential.parse(Credential.parse(SECRET, "k").node_credential("node-x"), "k")
    with (
        SegmentConnection(
            host, port, PeerSettings(5, credential=other, client_id="node-x")
        ) as conn,
        pytest.raises(AuthError, match="cannot act for"),
    ):
        read_into(conn, segment, 0, bytearray(64))


def test_with_the_secret_every_port_serves_and_refusals_cost_no_one_else(
    pool: SecuredPool,
) -> None:
    host, port = split_address(pool.data_address)
    right = Credential.parse(SECRET, "k")
    with Client(pool.master.address, credential=SECRET, allow_shm=False, timeout_s=5) as c:
        value = os.urandom(200_000)
        c.put("k-right", value)
        for _ in range(3):  # refused peers in between: the served client goes on
            with (
                Client(pool.master.address, credential=WRONG, timeout_s=5) as bad,
                pytest.raises(AuthError),
            ):
                bad.exists("k-right")
            with SegmentConnection(host, port, PeerSettings(5)) as raw, pytest.raises(AuthError):
                read_into(raw, _segment_id(pool), 0, bytearray(8))
            assert c.get("k-right") == value
        assert c.get("victim") == b"the user's prompt, as KV" * 100
    with SegmentConnection(host, port, PeerSettings(5, credential=right, client_id="c")) as conn:
        assert read_into(conn, _segment_id(pool), 0, bytearray(64)) == 64


def test_metrics_stay_readable_when_the_operator_says_so(tmp_path: Path) -> None:
    path = secret_file(tmp_path)
    with start_master("--segment_size", "0", "--secret_file", str(path), "--open_metrics") as m_:
        assert http_get(f"http://{m_.address}/metrics", 5).status == 200
        assert http_get(f"http://{m_.address}/api/status", 5).status == 401


def test_a_client_with_a_secret_told_a_master_without_one(tmp_path: Path) -> None:
    with (
        start_master("--segment_size", "1MiB") as plain,
        Client(plain.address, credential=SECRET, timeout_s=5) as c,
        pytest.raises(AuthError, match="this master has no secret configured"),
    ):
        c.exists("k")


def test_the_store_connectors_pool_handle_takes_the_node_configs_secret(
    pool: SecuredPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpool.engines import open_engine
    from kvpool.testing.processes import node_config

    path = secret_file(tmp_path)
    config = node_config(tmp_path, pool.master.address, secret_file=str(path))
    monkeypatch.delenv("KVPOOL_SECRET_FILE", raising=False)
    monkeypatch.delenv("KVPOOL_SECRET", raising=False)
    monkeypatch.setenv("KVPOOL_CONFIG_PATH", str(config))
    engine = open_engine("kvpool", master=pool.master.address, timeout_s=5)
    try:
        assert engine.batch_exists(["victim", "nothing"]) == [True, False]
    finally:
        engine.close()
    monkeypatch.delenv("KVPOOL_CONFIG_PATH")
    engine = open_engine("kvpool", master=pool.master.address, timeout_s=5)
    try:
        with pytest.raises(AuthError):
            engine.batch_exists(["victim"])
    finally:
        engine.close()


def test_kvpool_status_reads_the_master_with_the_environments_secret(
    pool: SecuredPool, tmp_path: Path
) -> None:
    import subprocess
    import sys

    def status(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "kvpool", "status", "--master", pool.master.address]
        clean = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_SECRET")}
        return subprocess.run(
            [*argv, "--json"], capture_output=True, text=True, timeout=60, env={**clean, **env}
        )

    refused = status({})
    assert refused.returncode == 1 and "wants the operator's token" in refused.stderr
    served = status({"KVPOOL_SECRET_FILE": str(secret_file(tmp_path))})
    assert served.returncode == 0 and pool.node_id in served.stdout
