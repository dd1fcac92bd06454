from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from kvpool.net import (
    DEFAULT_MASTER_PORT,
    free_port,
    free_port_runs,
    http_get,
    port_free,
    split_address,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10.0.0.1:7", ("10.0.0.1", 7)),
        ("node-a", ("node-a", DEFAULT_MASTER_PORT)),
        ("[::1]:9", ("::1", 9)),
        ("[::1]", ("::1", DEFAULT_MASTER_PORT)),
        ("::1", ("::1", DEFAULT_MASTER_PORT)),
        (":5", ("127.0.0.1", 5)),
    ],
)
def test_split_address(text: str, expected: tuple[str, int]) -> None:
    assert split_address(text) == expected


def test_a_port_that_is_not_a_number_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        split_address("host:http")


def test_port_free_sees_a_listener() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert not port_free("127.0.0.1", s.getsockname()[1])
    assert port_free("127.0.0.1", free_port())


def test_http_get_reports_a_refusal_as_a_value() -> None:
    reply = http_get(f"http://127.0.0.1:{free_port()}/health", timeout_s=2)
    assert reply.status is None and not reply.ok and reply.error


def test_http_get_reports_an_answer_that_is_not_http_as_a_value() -> None:
    # What `kvpool up`'s health probe read when its socket connected to itself on a port
    # nobody listened on yet: its own request line came back as the status line.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        def echo() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(4096))

        thread = threading.Thread(target=echo, daemon=True)
        thread.start()
        reply = http_get(f"http://127.0.0.1:{port}/health", timeout_s=5)
        thread.join(timeout=5)
    assert reply.status is None and not reply.ok
    assert "GET /health" in reply.error


def test_free_port_runs_stay_below_the_ephemeral_range() -> None:
    # An ephemeral port can be taken by any outgoing connection between choosing it and
    # binding it (and a probe of it can connect to itself): `kvpool up`'s port 0 avoids them.
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    runs = free_port_runs("127.0.0.1", [1, 4, 2])
    ports = [b + i for b, n in zip(runs, [1, 4, 2], strict=True) for i in range(n)]
    assert len(set(ports)) == 7
    assert all(1024 <= p < low for p in ports)
    for p in ports:
        assert port_free("127.0.0.1", p)
