from __future__ import annotations

import socket
import threading

import msgspec
import pytest

from kvpool.datapath import framing
from kvpool.errors import PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.codec import Codec


class Hello(msgspec.Struct, tag=True):
    name: str


class Other(msgspec.Struct, tag=True):
    x: int


codec: Codec[Hello] = Codec(Hello)


def test_frames_and_payloads_cross_a_socket_in_place() -> None:
    a, b = socket.socketpair()
    with a, b:
        payload = memoryview(bytes(range(256)) * 1000)
        sender = threading.Thread(
            target=framing.send_frame,
            args=(a, codec, Hello("x"), payload, framing.deadline_after(5)),
        )
        sender.start()
        message, length = framing.recv_frame(b, codec, framing.deadline_after(5))
        dst = bytearray(length)
        framing.recv_exactly_into(b, memoryview(dst), framing.deadline_after(5))
        sender.join(10)
    assert message == Hello("x") and dst == payload


def test_silence_is_a_timeout_and_a_close_is_a_transfer_error() -> None:
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(PeerTimeout, match="timed out"):
            framing.recv_frame(b, codec, framing.deadline_after(0.2))
        a.sendall(b"KVP")
        a.close()
        with pytest.raises(TransferError, match="closed the connection after 3 of 12"):
            framing.recv_frame(b, codec, framing.deadline_after(5))


def test_request_with_bad_body_is_consumed_and_reported() -> None:
    a, b = socket.socketpair()
    with a, b:
        other: Codec[Other] = Codec(Other)
        a.sendall(other.encode(Other(1), 5) + b"12345" + codec.encode(Hello("next")))
        bad = framing.recv_request(b, codec, 5, 5)
        assert isinstance(bad, framing.BadRequest)
        assert isinstance(bad.error, ProtocolError)
        assert framing.recv_request(b, codec, 5, 5) == (Hello("next"), 0)
        a.close()
        assert framing.recv_request(b, codec, 5, 5) is None  # clean close between requests


def test_idle_timeout_bounds_the_wait_for_a_request() -> None:
    a, b = socket.socketpair()
    with a, b, pytest.raises(PeerTimeout, match="next request"):
        framing.recv_request(b, codec, 5, 0.1)
