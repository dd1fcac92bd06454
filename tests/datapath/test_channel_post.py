"""Posted requests: sent without waiting, their replies read before the next call's."""

from __future__ import annotations

import socket
import struct
import threading
import time

import msgspec
import pytest

from kvpool.datapath.channel import MAX_OWED, Channel
from kvpool.datapath.framing import BadRequest
from kvpool.errors import PeerTimeout, TransferError
from kvpool.protocol.codec import Codec


class Msg(msgspec.Struct, tag=True):
    text: str


class Fail(msgspec.Struct, tag=True):
    reason: str


class Stray(msgspec.Struct, tag=True):
    x: int


Reply = Msg | Fail
requests: Codec[Msg] = Codec(Msg)
replies: Codec[Reply] = Codec(Reply)
strays: Codec[Stray] = Codec(Stray)


def serve_in_order(sock: socket.socket, limit: int = 1000) -> threading.Thread:
    """A peer that answers each request in order: ``fail:…`` gets a Fail, ``pay:N`` a
    reply with an N-byte payload, ``stray`` a reply the client cannot decode, ``quit``
    closes; anything else is echoed back as ``re:…``."""
    server: Channel[Reply, Msg] = Channel(sock, replies, requests, 5.0)

    def run() -> None:
        for _ in range(limit):  # bounded
            got = server.recv_request(idle_timeout=10.0)
            if got is None or isinstance(got, BadRequest):
                break
            text = got[0].text
            if text == "quit":
                break
            if text.startswith("fail:"):
                server.send(Fail(text[5:]))
            elif text.startswith("pay:"):
                size = int(text[4:])
                server.send(Msg(f"re:{text}"), memoryview(bytes([7]) * size))
            elif text == "stray":
                sock.sendall(strays.encode(Stray(1)))
            else:
                server.send(Msg(f"re:{text}"))
        server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def client_and_peer(
    timeout_s: float = 5.0,
) -> tuple[Channel[Msg, Reply], list[Reply], threading.Thread]:
    a, b = socket.socketpair()
    owed: list[Reply] = []
    channel: Channel[Msg, Reply] = Channel(a, requests, replies, timeout_s, owed.append)
    return channel, owed, serve_in_order(b)


def test_owed_replies_are_read_before_the_calls_own_reply() -> None:
    channel, owed, peer = client_and_peer()
    channel.post(Msg("release-1"))
    channel.post(Msg("release-2"))
    assert channel.owed == 2
    assert channel.call(Msg("exists")) == (Msg("re:exists"), 0)
    assert owed == [Msg("re:release-1"), Msg("re:release-2")]
    assert channel.owed == 0
    assert channel.call(Msg("next")) == (Msg("re:next"), 0)
    assert len(owed) == 2
    channel.send(Msg("quit"))
    peer.join(5)
    channel.close()


def test_an_error_reply_to_a_posted_request_is_not_the_next_calls_reply() -> None:
    channel, owed, peer = client_and_peer()
    channel.post(Msg("fail:lease gone"))
    assert channel.call(Msg("get")) == (Msg("re:get"), 0)
    assert owed == [Fail("lease gone")]
    # and the other way round: a call's own error reply is the call's
    channel.post(Msg("release"))
    assert channel.call(Msg("fail:mine")) == (Fail("mine"), 0)
    assert owed[-1] == Msg("re:release")
    channel.send(Msg("quit"))
    peer.join(5)
    channel.close()


def test_owed_payloads_and_undecodable_owed_replies_keep_the_stream_in_sync() -> None:
    channel, owed, peer = client_and_peer()
    channel.post(Msg("pay:100000"))  # larger than the staging buffer
    channel.post(Msg("stray"))
    channel.post(Msg("pay:3"))
    reply, length = channel.call(Msg("pay:5"))
    assert (reply, length) == (Msg("re:pay:5"), 5)
    payload = bytearray(5)
    channel.recv_payload_into(memoryview(payload))
    assert payload == bytes([7]) * 5
    assert owed == [Msg("re:pay:100000"), Msg("re:pay:3")]  # the stray one is dropped
    assert channel.call(Msg("after")) == (Msg("re:after"), 0)
    channel.send(Msg("quit"))
    peer.join(5)
    channel.close()


def test_posting_alone_never_lets_more_than_max_owed_pile_up() -> None:
    channel, owed, peer = client_and_peer()
    for i in range(MAX_OWED * 3):
        channel.post(Msg(f"r{i}"))
        assert channel.owed <= MAX_OWED
    channel.settle()
    assert channel.owed == 0
    assert owed == [Msg(f"re:r{i}") for i in range(MAX_OWED * 3)]
    channel.send(Msg("quit"))
    peer.join(5)
    channel.close()


def test_a_peer_gone_with_replies_owed_is_a_transfer_error_not_a_hang() -> None:
    channel, owed, peer = client_and_peer()
    channel.post(Msg("quit"))  # the peer closes without answering it
    peer.join(5)
    start = time.monotonic()
    with pytest.raises(TransferError):
        channel.call(Msg("exists"))
    assert time.monotonic() - start < 5
    assert owed == []
    channel.close()


def test_settle_with_a_short_timeout_bounds_the_wait_and_restores_the_socket_timeout() -> None:
    a, b = socket.socketpair()
    channel: Channel[Msg, Reply] = Channel(a, requests, replies, 30.0)
    before = a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll"))
    channel.post(Msg("nobody answers"))
    start = time.monotonic()
    with pytest.raises(PeerTimeout):
        channel.settle(0.2)
    assert time.monotonic() - start < 5
    after = a.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.calcsize("ll"))
    assert after == before
    channel.close()
    b.close()


def test_settle_with_nothing_owed_does_not_touch_the_socket() -> None:
    a, b = socket.socketpair()
    channel: Channel[Msg, Reply] = Channel(a, requests, replies, 5.0)
    channel.settle(0.1)  # returns at once: nothing is owed, nothing is read
    b.sendall(replies.encode(Msg("unsolicited")))
    assert channel.recv() == (Msg("unsolicited"), 0)
    channel.close()
    b.close()


def test_meanwhile_runs_after_the_request_left_and_before_its_reply_is_read() -> None:
    a, b = socket.socketpair()
    channel: Channel[Msg, Reply] = Channel(a, requests, replies, 5.0)
    peer: Channel[Reply, Msg] = Channel(b, replies, requests, 5.0)
    seen: list[str] = []

    def meanwhile() -> None:
        got = peer.recv()  # the request is already on the wire
        seen.append(got[0].text)
        peer.send(Msg("answer"))

    assert channel.call(Msg("put-start"), meanwhile=meanwhile) == (Msg("answer"), 0)
    assert seen == ["put-start"]
    channel.close()
    peer.close()


def test_meanwhile_that_raises_leaves_its_reply_owed_not_lost() -> None:
    channel, owed, peer = client_and_peer()

    def explode() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        channel.call(Msg("first"), meanwhile=explode)
    assert channel.owed == 1
    assert channel.call(Msg("second")) == (Msg("re:second"), 0)
    assert owed == [Msg("re:first")]
    channel.send(Msg("quit"))
    peer.join(5)
    channel.close()
