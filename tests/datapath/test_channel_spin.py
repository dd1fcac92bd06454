"""A call polls for its reply before it sleeps (``spin_us``): the same answers, errors
and order as a blocking call, whether the reply comes inside the window or after it."""

from __future__ import annotations

import socket
import threading

import msgspec
import pytest

from kvpool.datapath.channel import DEFAULT_SPIN_US, MAX_SPIN_US, Channel, reply_spin_us
from kvpool.errors import ConfigError, TransferError
from kvpool.protocol.codec import Codec


class Msg(msgspec.Struct, tag=True):
    text: str


codec: Codec[Msg] = Codec(Msg)


class CountingSocket(socket.socket):
    """A socket that records the flags of every ``recv_into``: which reads polled."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.flags: list[int] = []

    def recv_into(self, buffer, nbytes=0, flags=0):  # type: ignore[no-untyped-def, override]
        self.flags.append(flags)
        return super().recv_into(buffer, nbytes, flags)


def spinning_pair(spin_us: int) -> tuple[Channel[Msg, Msg], Channel[Msg, Msg], CountingSocket]:
    a, b = socket.socketpair()
    counted = CountingSocket(a)
    return (
        Channel(counted, codec, codec, 5.0, spin_us=spin_us),
        Channel(b, codec, codec, 5.0),
        counted,
    )


def serve(
    server: Channel[Msg, Msg], count: int, delay: threading.Event | None = None
) -> threading.Thread:
    def run() -> None:
        for _ in range(count):
            request, _length = server.recv()
            if delay is not None:
                delay.wait(5)
            server.send(Msg(f"re:{request.text}"))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_reply_inside_the_window_is_read_by_the_poll() -> None:
    client, server, counted = spinning_pair(MAX_SPIN_US)
    thread = serve(server, 3)
    for i in range(3):
        assert client.call(Msg(str(i))) == (Msg(f"re:{i}"), 0)
    thread.join(5)
    assert socket.MSG_DONTWAIT in counted.flags  # the poll ran, and read replies
    client.close()
    server.close()


def test_without_a_spin_every_read_blocks() -> None:
    client, server, counted = spinning_pair(0)
    thread = serve(server, 2)
    for i in range(2):
        assert client.call(Msg(str(i))) == (Msg(f"re:{i}"), 0)
    thread.join(5)
    assert counted.flags and socket.MSG_DONTWAIT not in counted.flags
    client.close()
    server.close()


def test_a_reply_after_the_window_is_read_by_the_blocking_path() -> None:
    client, server, counted = spinning_pair(1)
    late = threading.Event()
    thread = serve(server, 1, delay=late)
    timer = threading.Timer(0.05, late.set)  # well after a 1 µs window
    timer.start()
    assert client.call(Msg("slow")) == (Msg("re:slow"), 0)
    thread.join(5)
    assert counted.flags[-1] == 0  # it gave up polling and slept until the reply
    client.close()
    server.close()


def test_posted_replies_stay_in_order_with_a_spin() -> None:
    owed: list[Msg] = []
    a, b = socket.socketpair()
    client = Channel(a, codec, codec, 5.0, owed.append, spin_us=MAX_SPIN_US)
    server = Channel(b, codec, codec, 5.0)
    thread = serve(server, 4)
    client.post(Msg("p1"))
    client.post(Msg("p2"))
    assert client.call(Msg("c1")) == (Msg("re:c1"), 0)
    assert client.call(Msg("c2")) == (Msg("re:c2"), 0)
    thread.join(5)
    assert owed == [Msg("re:p1"), Msg("re:p2")]
    client.close()
    server.close()


def test_a_peer_that_closes_while_polled_is_a_transfer_error() -> None:
    client, server, _ = spinning_pair(MAX_SPIN_US)

    def close_after_request() -> None:
        server.recv()
        server.close()

    thread = threading.Thread(target=close_after_request, daemon=True)
    thread.start()
    with pytest.raises(TransferError, match="closed"):
        client.call(Msg("x"))
    thread.join(5)
    client.close()


def test_the_spin_comes_from_the_environment_and_bad_values_name_the_variable() -> None:
    assert reply_spin_us({}) == DEFAULT_SPIN_US
    assert reply_spin_us({"KVPOOL_RPC_SPIN_US": "0"}) == 0
    assert reply_spin_us({"KVPOOL_RPC_SPIN_US": " 200 "}) == 200
    for bad in ("-1", "fast", "1.5", str(MAX_SPIN_US + 1)):
        with pytest.raises(ConfigError, match="KVPOOL_RPC_SPIN_US") as err:
            reply_spin_us({"KVPOOL_RPC_SPIN_US": bad})
        assert "0 (no spin)" in str(err.value)


def test_a_reply_received_on_its_own_is_polled_for_too() -> None:
    """A data connection sends and receives separately (payloads in between): its
    ``recv(reply=True)`` polls as a call does; a plain ``recv`` (a server's) does not."""
    client, server, counted = spinning_pair(MAX_SPIN_US)
    thread = serve(server, 2)
    client.send(Msg("a"))
    assert client.recv(reply=True) == (Msg("re:a"), 0)
    assert socket.MSG_DONTWAIT in counted.flags
    counted.flags.clear()
    client.send(Msg("b"))
    assert client.recv() == (Msg("re:b"), 0)
    assert socket.MSG_DONTWAIT not in counted.flags
    thread.join(5)
    client.close()
    server.close()
