from __future__ import annotations

import random
import socket
import threading
import time

import msgspec
import pytest

from kvpool.datapath.channel import ON_BYTES_MIN, STAGE_SIZE, Channel
from kvpool.datapath.framing import BadRequest
from kvpool.errors import PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.codec import Codec


class Msg(msgspec.Struct, tag=True):
    text: str


class Other(msgspec.Struct, tag=True):
    x: int


codec: Codec[Msg] = Codec(Msg)


def pair(timeout_s: float = 5.0) -> tuple[Channel[Msg, Msg], Channel[Msg, Msg]]:
    a, b = socket.socketpair()
    return Channel(a, codec, codec, timeout_s), Channel(b, codec, codec, timeout_s)


@pytest.mark.parametrize("size", [0, 1, STAGE_SIZE - 100, STAGE_SIZE * 3 + 7, 4 << 20])
def test_payload_arrives_whole_whether_staged_or_direct(size: int) -> None:
    left, right = pair()
    payload = memoryview(bytes(i % 251 for i in range(size)))
    sender = threading.Thread(target=left.send, args=(Msg("p"), payload))
    sender.start()
    message, length = right.recv()
    dst = bytearray(length)
    right.recv_payload_into(memoryview(dst))
    sender.join(10)
    assert message == Msg("p") and dst == payload
    left.close()
    right.close()


def test_back_to_back_frames_in_one_recv_are_split_correctly() -> None:
    left, right = pair()
    for i in range(5):
        left.send(Msg(f"m{i}"), memoryview(bytes([i]) * 10))
    for i in range(5):
        assert right.recv() == (Msg(f"m{i}"), 10)
        buf = bytearray(10)
        right.recv_payload_into(memoryview(buf))
        assert buf == bytes([i]) * 10
    left.close()
    right.close()


def test_a_body_larger_than_the_stage_decodes() -> None:
    left, right = pair()
    text = "x" * (STAGE_SIZE * 2)
    sender = threading.Thread(target=left.send, args=(Msg(text),))
    sender.start()
    assert right.recv() == (Msg(text), 0)
    sender.join(10)
    left.close()
    right.close()


def test_silent_peer_is_a_peer_timeout_within_the_timeout() -> None:
    left, right = pair(timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(PeerTimeout):
        right.recv()
    assert time.monotonic() - start < 5
    left.close()
    right.close()


def test_a_peer_that_stops_reading_makes_send_time_out() -> None:
    left, right = pair(timeout_s=0.2)
    with pytest.raises(PeerTimeout):
        left.send(Msg("big"), memoryview(bytes(64 << 20)))  # nobody reads the other end
    left.close()
    right.close()


def test_peer_closing_mid_payload_is_a_transfer_error() -> None:
    left, right = pair()
    left.sock.sendall(codec.encode(Msg("p"), 100) + b"x" * 10)
    left.close()
    _, length = right.recv()
    with pytest.raises(TransferError, match="10 of 100"):
        right.recv_payload_into(memoryview(bytearray(length)))
    right.close()


def test_bad_body_is_consumed_and_bad_header_raises() -> None:
    left, right = pair()
    other: Codec[Other] = Codec(Other)
    left.sock.sendall(other.encode(Other(1), 3) + b"abc" + codec.encode(Msg("ok")))
    bad = right.recv_request(idle_timeout=5)
    assert isinstance(bad, BadRequest)
    assert right.recv_request(idle_timeout=5) == (Msg("ok"), 0)
    left.sock.sendall(b"JUNK" + bytes(8))
    with pytest.raises(ProtocolError, match="magic"):
        right.recv_request(idle_timeout=5)
    left.close()
    right.close()


def test_idle_wait_outlasts_the_io_timeout_and_ends_on_close() -> None:
    left, right = pair(timeout_s=0.05)
    threading.Timer(0.3, left.send, args=(Msg("late"),)).start()
    assert right.recv_request(idle_timeout=None) == (Msg("late"), 0)
    with pytest.raises(PeerTimeout, match="next request"):
        right.recv_request(idle_timeout=0.2)
    left.close()
    assert right.recv_request(idle_timeout=None) is None
    right.close()


def test_call_is_one_exchange() -> None:
    left, right = pair()

    def echo() -> None:
        got = right.recv_request(idle_timeout=5)
        assert isinstance(got, tuple)
        right.send(Msg(got[0].text.upper()))

    thread = threading.Thread(target=echo)
    thread.start()
    assert left.call(Msg("hi")) == (Msg("HI"), 0)
    thread.join(10)
    left.close()
    right.close()


def test_frames_split_at_arbitrary_points_reassemble() -> None:
    rng = random.Random(7)
    frames = [
        (f"m{i}", bytes([i % 256]) * rng.choice([0, 1, 5, 300, 9000, 20000])) for i in range(200)
    ]
    stream = b"".join(codec.encode(Msg(t), len(p)) + p for t, p in frames)
    a, b = socket.socketpair()
    right: Channel[Msg, Msg] = Channel(b, codec, codec, 5.0)

    def trickle() -> None:
        pos = 0
        while pos < len(stream):
            step = rng.choice([1, 3, 12, 100, 4000, 70000])
            a.sendall(stream[pos : pos + step])
            pos += step
            if rng.random() < 0.05:
                time.sleep(0.001)  # let the reader catch up mid-frame

    sender = threading.Thread(target=trickle)
    sender.start()
    for text, payload in frames:
        message, length = right.recv()
        assert message == Msg(text) and length == len(payload)
        buf = bytearray(length)
        right.recv_payload_into(memoryview(buf))
        assert buf == payload
    sender.join(30)
    a.close()
    right.close()


@pytest.mark.parametrize("size", [0, 100, STAGE_SIZE * 2, ON_BYTES_MIN * 5 + 17])
def test_on_bytes_sees_every_payload_byte_once_in_order_in_large_pieces(size: int) -> None:
    """What a TCP read's checksum is computed from as the bytes land: the whole payload,
    staged bytes included, in pieces no smaller than ON_BYTES_MIN but the last."""
    left, right = pair()
    payload = memoryview(random.Random(size).randbytes(size))
    sender = threading.Thread(target=left.send, args=(Msg("p"), payload))
    sender.start()
    _, length = right.recv()
    pieces: list[bytes] = []
    dst = bytearray(length)
    right.recv_payload_into(memoryview(dst), on_bytes=lambda piece: pieces.append(bytes(piece)))
    sender.join(10)
    assert b"".join(pieces) == payload and dst == payload
    assert all(len(piece) >= ON_BYTES_MIN for piece in pieces[:-1])
    if size <= ON_BYTES_MIN:
        assert len(pieces) == (1 if size else 0)
    left.close()
    right.close()
