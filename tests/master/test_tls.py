"""A pool with TLS and the cluster secret, as real processes: a master and a node with
certificates for 127.0.0.1; a client with the CA puts and gets equal bytes through both;
a client without TLS, or trusting another CA, gets a clear error (never a hang) while
the pool keeps serving; HTTP on the master's port is HTTPS."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.errors import AuthError, ObjectNotFound
from kvpool.net import http_get, split_address
from kvpool.protocol import messages as m
from kvpool.security.tls import TLSConfig
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from tests.master.auth_pool import SECRET, secret_file
from tests.tls_material import Material, make_material
from tests.waiting import wait_until

VALUE = b"the user's prompt, as KV, over TLS: " + bytes(range(256)) * 64


@dataclass
class TlsPool:
    master: PoolProcess
    node: PoolProcess
    material: Material

    def client(self, **kw: object) -> Client:
        mine = self.material.client  # the node has tls_ca: its data port wants a client cert
        tls = kw.pop("tls", TLSConfig(mine.cert, mine.key, self.material.ca.cert))
        return Client(
            self.master.address,
            credential=kw.pop("credential", SECRET),  # type: ignore[arg-type]
            timeout_s=5,
            allow_shm=False,  # every byte over the node's data port
            tls=tls,  # type: ignore[arg-type]
            **kw,  # type: ignore[arg-type]
        )


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsPool]:
    directory: Path = tmp_path_factory.mktemp("tls-pool")
    material = make_material(directory / "pki")
    secret = secret_file(directory)
    server = material.server
    with (
        start_master(
            "--segment_size", "0", "--secret_file", str(secret),
            "--tls_cert", server.cert, "--tls_key", server.key, "--tls_ca", "",
            env={"KVPOOL_TLS_CA": material.ca.cert},
        ) as master,
        start_node(
            node_config(
                directory, master.address, secret_file=str(secret),
                tls_cert=server.cert, tls_key=server.key, tls_ca=material.ca.cert,
            )
        ) as node,
    ):  # fmt: skip
        p = TlsPool(master, node, material)
        with p.client() as c:
            wait_until(lambda: c.stats()["tiers"]["memory"]["capacity"] > 0)
        yield p


def test_a_client_with_the_ca_puts_and_gets_equal_bytes(pool: TlsPool) -> None:
    # the master has no segment (--segment_size 0): the bytes go over the node's data port
    with pool.client() as c:
        c.put("tls-key", VALUE)
        assert c.get("tls-key") == VALUE
    with pool.client() as other:  # a second client, a fresh connection to the node
        assert other.get("tls-key") == VALUE


def test_a_client_without_tls_gets_a_clear_error_not_a_hang(pool: TlsPool) -> None:
    start = time.monotonic()
    for credential in (SECRET, None):
        with (
            pool.client(tls=TLSConfig(), credential=credential) as c,
            pytest.raises(AuthError, match="requires TLS: set KVPOOL_TLS_CA"),
        ):
            c.get("tls-key")
    assert time.monotonic() - start < 8
    with pool.client() as c:  # and the master keeps serving everyone else
        c.put("after-plain", b"still here")
        assert c.get("after-plain") == b"still here"


def test_a_client_trusting_another_ca_gets_a_certificate_error(pool: TlsPool) -> None:
    with (
        pool.client(tls=TLSConfig(ca=pool.material.other_ca.cert)) as c,
        pytest.raises(AuthError, match="certificate is not trusted"),
    ):
        c.get("tls-key")
    with pool.client() as c:
        assert c.get("tls-key") == VALUE


def test_the_node_wants_a_client_certificate_when_it_has_tls_ca(pool: TlsPool) -> None:
    with pool.client() as c:
        c.put("mtls-key", b"on the node")
    # the master (no --tls_ca) lets this client in; the node's data port does not (a
    # failed read is a miss, as for a node that cannot be reached; the cause is named)
    with (
        pool.client(tls=TLSConfig(ca=pool.material.ca.cert)) as c,
        pytest.raises(ObjectNotFound, match="wants a client certificate"),
    ):
        c.get("mtls-key")


def test_the_master_port_carries_no_plaintext_and_http_is_https(pool: TlsPool) -> None:
    # A raw plain request gets no RPC reply in clear: nothing the master says is readable.
    with socket.create_connection(split_address(pool.master.address), timeout=5) as s:
        s.sendall(m.MASTER_REQUEST_CODEC.encode(m.Exists("tls-key")))
        s.settimeout(5)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
    assert b"tls-key" not in data and b"node-" not in data
    plain = http_get(f"http://{pool.master.address}/health", 3)
    assert plain.status is None
    secure = http_get(f"https://{pool.master.address}/health", 3, ca=pool.material.ca.cert)
    assert secure.status == 200
    wrong = http_get(f"https://{pool.master.address}/health", 3, ca=pool.material.other_ca.cert)
    assert wrong.status is None and "CERTIFICATE_VERIFY_FAILED" in str(wrong.error)


def test_bad_tls_settings_stop_master_and_node_with_one_line(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    master = subprocess.run(
        [sys.executable, "-m", "kvpool", "master", "--port", "0", "--tls_cert", missing,
         "--tls_key", missing],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert master.returncode == 2
    assert master.stderr.strip().splitlines() == [
        f"kvpool master: --tls_cert: {missing} is not a file; give the path of a PEM file "
        "(openssl can make one; docs/security.md#tls)"
    ]
    config = node_config(tmp_path, "127.0.0.1:1", tls_cert=missing, tls_key=missing)
    node = subprocess.run(
        [sys.executable, "-m", "kvpool", "node", "--data-port", "0"],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, KVPOOL_CONFIG_PATH=str(config)),
    )  # fmt: skip
    assert node.returncode == 2
    assert node.stderr.strip().endswith(f"tls_cert: {missing} is not a file; give the path "
                                        "of a PEM file (openssl can make one; "
                                        "docs/security.md#tls)")  # fmt: skip


def test_kvpool_status_speaks_https_with_the_ca(pool: TlsPool, tmp_path: Path) -> None:
    env = dict(
        os.environ,
        KVPOOL_TLS_CA=pool.material.ca.cert,
        KVPOOL_SECRET_FILE=str(secret_file(tmp_path)),
    )
    argv = [sys.executable, "-m", "kvpool", "status", "--master", pool.master.address, "--json"]
    shown = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert shown.returncode == 0, shown.stderr
    assert '"clients"' in shown.stdout
    env.pop("KVPOOL_TLS_CA")
    plain = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert plain.returncode == 1
