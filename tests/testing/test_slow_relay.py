"""The slow relay the HA tests put in front of etcd: bytes pass intact both ways, and a
reply comes no sooner than the delay (once per reply, not per chunk)."""

from __future__ import annotations

import socket
import threading
import time

from kvpool.testing.slow_relay import SlowRelay


def echo_server() -> tuple[socket.socket, threading.Thread]:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(65536):
                # the reply in two chunks, as an HTTP server writes headers then a body
                half = len(data) // 2
                conn.sendall(data[:half])
                time.sleep(0.01)
                conn.sendall(data[half:])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_bytes_pass_intact_and_the_reply_waits_the_delay_once() -> None:
    listener, thread = echo_server()
    payload = bytes(range(256)) * 40
    with (
        SlowRelay(listener.getsockname()[:2], 0.2) as relay,
        socket.create_connection(("127.0.0.1", relay.port)) as conn,
    ):
        sent = time.monotonic()
        conn.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = conn.recv(65536)
            assert chunk, "the relay closed early"
            got += chunk
        took = time.monotonic() - sent
        conn.shutdown(socket.SHUT_WR)
        assert conn.recv(1) == b""  # the end passes too
    thread.join(5)
    listener.close()
    assert got == payload
    assert took >= 0.2
