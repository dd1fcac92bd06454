from __future__ import annotations

import socket
import threading
import time

from kvpool.datapath.server import ThreadedServer
from tests.waiting import wait_until


def echo(conn: socket.socket, _identity: object = None) -> None:
    while data := conn.recv(1024):
        conn.sendall(data)


def test_each_connection_is_served_in_its_own_thread() -> None:
    with ThreadedServer("127.0.0.1", 0, echo, name="test-echo") as server:
        a = socket.create_connection(server.address, timeout=5)
        b = socket.create_connection(server.address, timeout=5)
        with a, b:
            b.sendall(b"second")  # served while the first connection sits idle
            assert b.recv(16) == b"second"
            a.sendall(b"first")
            assert a.recv(16) == b"first"
            wait_until(lambda: server.connections == 2, what="both connections open")
        wait_until(lambda: server.connections == 0, what="closed connections forgotten")


def test_close_wakes_handlers_blocked_in_recv_and_is_bounded() -> None:
    server = ThreadedServer("127.0.0.1", 0, echo, name="test-blocked")
    server.start()
    conns = [socket.create_connection(server.address, timeout=5) for _ in range(3)]
    for conn in conns:  # a connection reaches its handler with its first bytes
        conn.sendall(b"x")
        assert conn.recv(1) == b"x"
    wait_until(lambda: server.connections == 3, what="three connections open")
    started = time.monotonic()
    server.close(timeout_s=5)
    assert time.monotonic() - started < 2  # woken by the shutdown, not by the timeout
    assert server.connections == 0 and server.stopping
    for conn in conns:
        assert conn.recv(1) == b""  # the server's side is closed
        conn.close()


def test_a_failing_handler_ends_only_its_own_connection() -> None:
    calls = threading.Semaphore(0)

    def handle(conn: socket.socket, _identity: object) -> None:
        calls.release()
        if conn.recv(1) == b"!":
            raise RuntimeError("handler bug")
        echo(conn)

    with ThreadedServer("127.0.0.1", 0, handle, name="test-failing") as server:
        with socket.create_connection(server.address, timeout=5) as bad:
            bad.sendall(b"!")
            assert bad.recv(1) == b""  # closed by the server after the handler raised
        with socket.create_connection(server.address, timeout=5) as good:
            good.sendall(b"xok")
            assert good.recv(16) == b"ok"
        assert calls.acquire(timeout=5) and calls.acquire(timeout=5)
