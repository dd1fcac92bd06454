"""kvpool's etcd gateway client against a real etcd."""

from __future__ import annotations

import socket
import threading

import pytest

from kvpool.errors import TransferError
from kvpool.ha.etcd import Etcd, parse_endpoints
from kvpool.testing.etcd import EtcdCluster, free_port


def test_endpoints_take_commas_semicolons_and_urls() -> None:
    assert parse_endpoints("10.0.0.1:2379; http://10.0.0.2:2379/,") == (
        "http://10.0.0.1:2379",
        "http://10.0.0.2:2379",
    )


def test_only_one_of_two_creates_a_key_and_its_lease_takes_it_away(etcd: EtcdCluster) -> None:
    client = Etcd(parse_endpoints(etcd.endpoints))
    a, b = client.grant(5), client.grant(5)
    won, _, revision, _ = client.create("/t/leader", "a", a)
    assert won
    lost, current, _, _ = client.create("/t/leader", "b", b)
    assert not lost and current is not None
    assert (current.value, current.create_revision, current.lease) == ("a", revision, a)
    client.put("/t/masters/a", "x", a)
    assert [kv.key for kv in client.get_prefix("/t/")] == ["/t/leader", "/t/masters/a"]
    assert client.keepalive(a) == 5
    client.revoke(a)
    assert client.get("/t/leader") is None and client.get_prefix("/t/masters/") == []
    assert client.keepalive(a) == 0  # an ended lease is not renewed
    won, _, later, _ = client.create("/t/leader", "b", b)
    assert won and later > revision  # the next leader's epoch is larger


def test_a_dead_endpoint_is_skipped_and_none_alive_is_a_transfer_error(
    etcd: EtcdCluster,
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    client = Etcd(parse_endpoints(f"{dead},{etcd.endpoints}"))
    client.put("/t/k", "v")
    assert client.get("/t/k") is not None
    with pytest.raises(TransferError, match="cannot reach etcd"):
        Etcd(parse_endpoints(dead)).get("/t/k")


def test_an_endpoint_that_does_not_speak_http_is_skipped(etcd: EtcdCluster) -> None:
    # A connection to an unused local port can land on itself and read its own request
    # back; that member is as good as dead, not a crash of the leader's campaign.
    with socket.socket() as echo:
        echo.bind(("127.0.0.1", 0))
        echo.listen()

        def answer() -> None:
            conn, _ = echo.accept()
            with conn:
                conn.sendall(conn.recv(4096))

        threading.Thread(target=answer, daemon=True).start()
        client = Etcd(parse_endpoints(f"127.0.0.1:{echo.getsockname()[1]},{etcd.endpoints}"))
        client.put("/t/echo", "v")
    assert client.get("/t/echo") is not None


def test_create_reads_prefixes_in_the_same_transaction(etcd: EtcdCluster) -> None:
    client = Etcd(parse_endpoints(etcd.endpoints))
    a, b = client.grant(5), client.grant(5)
    client.put("/t/nodes/n1", "x")
    client.put("/t/masters/a", "x", a)
    won, current, revision, (masters, nodes) = client.create(
        "/t/leader", "a", a, ("/t/masters/", "/t/nodes/")
    )
    assert won and current is None
    assert [kv.key for kv in masters] == ["/t/masters/a"]
    assert [kv.key for kv in nodes] == ["/t/nodes/n1"]
    client.put("/t/masters/b", "x", b)
    lost, current, _, (masters, nodes) = client.create(
        "/t/leader", "b", b, ("/t/masters/", "/t/nodes/")
    )
    assert not lost and current is not None
    assert (current.value, current.create_revision) == ("a", revision)
    assert [kv.key for kv in masters] == ["/t/masters/a", "/t/masters/b"]
    assert [kv.key for kv in nodes] == ["/t/nodes/n1"]
