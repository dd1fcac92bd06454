"""A real ``kvpool master`` fed random and mutated frames on its RPC port.

After every example, on fresh connections: the master still answers ``/health``, and a
real client's put and get of a new key return exactly the bytes written.  The hostile
connection itself must end in well-formed replies and a close once the peer half-closes
(never a hang), and no ordinary bad input may be answered ``INTERNAL`` (that code is for
the master's own bugs).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvpool.client.client import Client
from kvpool.errors import ProtocolError
from kvpool.net import http_get
from kvpool.protocol import messages as m
from kvpool.protocol.codec import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, HEADER_SIZE
from kvpool.protocol.data import Error
from kvpool.testing.processes import PoolProcess, start_master
from tests.fuzz.frames import FUZZ_SOCKET, header, mutated_frames, typed_bodies
from tests.fuzz.peer import decode_replies, is_rpc, send_and_close, send_and_read
from tests.fuzz.wires import WIRES

pytestmark = pytest.mark.timeout(240)

MASTER_WIRE = next(w for w in WIRES if w.name == "master-request")
_keys = itertools.count()
INTERNAL = "INTERNAL"  # kvpool.errors.error_code of anything outside the hierarchy


@pytest.fixture(scope="module")
def master() -> Iterator[PoolProcess]:
    with start_master("--segment_size", "8MiB") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(master: PoolProcess) -> Iterator[Client]:
    with Client(master.address, timeout_s=10) as c:
        yield c


def address(master: PoolProcess) -> tuple[str, int]:
    return master.host, master.port


def assert_master_serves(master: PoolProcess, client: Client) -> None:
    """A later, well-formed request on another connection gets the right answer."""
    assert master.proc.poll() is None, "the master exited:\n" + "\n".join(master.lines)
    health = http_get(f"http://{master.address}/health", timeout_s=10)
    assert health.ok, health.error
    key = f"fuzz-probe-{next(_keys)}"
    value = os.urandom(1024)
    client.put(key, value)
    assert client.get(key) == value
    assert client.remove(key)


def internal_errors(replies: list[object]) -> list[Error]:
    return [r for r in replies if isinstance(r, Error) and r.code == INTERNAL]


@FUZZ_SOCKET
@given(frame=mutated_frames(MASTER_WIRE))
def test_any_frame_leaves_the_master_serving_everyone_else(
    master: PoolProcess, client: Client, frame: bytes
) -> None:
    assume(not rogue_segment(body_of(frame)))
    outcome = send_and_close(address(master), frame)
    assert outcome.closed, f"the master held a half-closed connection open after {frame!r}"
    if is_rpc(frame):  # else the first bytes went to HTTP, which answers as it likes
        replies = decode_replies(outcome.received, m.MASTER_REPLY_CODEC)
        if not known_bug(body_of(frame)):
            assert not internal_errors(replies), (frame, replies)
    assert_master_serves(master, client)


BAD_BODIES = {
    "unknown tag": b"\x81\xa4type\xa5Bogus",
    "wrong field type": b"\x82\xa4type\xa6Exists\xa3key\x07",
    "not msgpack": b"\xc1\xc1\xc1",
    "missing field": b"\x81\xa4type\xa8PutStart",
}


@pytest.mark.parametrize("body", list(BAD_BODIES.values()), ids=list(BAD_BODIES))
def test_a_bad_body_gets_an_error_reply_and_the_connection_goes_on(
    master: PoolProcess, client: Client, body: bytes
) -> None:
    good = m.MASTER_REQUEST_CODEC.encode(m.Exists("nothing-here"))
    replies, closed = send_and_read(
        address(master), header(len(body), 0) + body + good, m.MASTER_REPLY_CODEC, want=2
    )
    assert not closed and len(replies) == 2, replies
    assert isinstance(replies[0], Error) and replies[0].code != INTERNAL
    assert not isinstance(replies[1], Error), replies  # the next request on it is answered
    assert_master_serves(master, client)


BAD_HEADERS = {
    "body over the limit": header(DEFAULT_MAX_BODY + 1, 0),
    "payload over the limit": header(8, DEFAULT_MAX_PAYLOAD + 1),
    "empty body": header(0, 0),
}


@pytest.mark.parametrize("raw", list(BAD_HEADERS.values()), ids=list(BAD_HEADERS))
def test_a_bad_header_gets_an_error_reply_and_a_close(
    master: PoolProcess, client: Client, raw: bytes
) -> None:
    replies, closed = send_and_read(address(master), raw, m.MASTER_REPLY_CODEC, until_close=True)
    assert [type(r) for r in replies] == [Error] and closed
    assert_master_serves(master, client)


def test_a_request_announcing_a_payload_is_refused_from_its_header(
    master: PoolProcess, client: Client
) -> None:
    body = m.MASTER_REQUEST_CODEC.encode(m.Stats())[12:]
    replies, closed = send_and_read(
        address(master),
        header(len(body), DEFAULT_MAX_PAYLOAD) + body,
        m.MASTER_REPLY_CODEC,
        until_close=True,
    )
    assert closed, "the master still waits for a 1 GiB payload"
    assert [type(r) for r in replies] == [Error]


# a small pool of names, so a sequence's requests meet each other (Register then
# AddSegment of that client, PutStart then PutEnd of that key, ...)
SEQUENCE_NAMES = st.sampled_from(["c", "k", "seg", "c/seg", ""])


def body_of(frame: bytes) -> bytes:
    """The body bytes a frame announces (b"" when its header does not parse)."""
    try:
        length, _ = m.MASTER_REQUEST_CODEC.parse_header(frame[:HEADER_SIZE])
    except ProtocolError:
        return b""
    return frame[HEADER_SIZE : HEADER_SIZE + length]


def _request(body: bytes) -> m.MasterRequest | None:
    try:
        return m.MASTER_REQUEST_CODEC.decode_body(body)
    except ProtocolError:
        return None


def rogue_segment(body: bytes) -> bool:
    """An AddSegment: a segment whose owner registered an address nobody serves takes
    others' puts until the first failed transfer to it is reported (the master cannot
    know beforehand), so a fuzzed one would fail the next probe put once."""
    return isinstance(_request(body), m.AddSegment)


def known_bug(body: bytes) -> bool:
    """Requests left out of the sequence property so that its probe put stays meaningful:
    a segment added at an address nobody serves takes others' puts until a failed
    transfer to it is reported (see rogue_segment)."""
    return rogue_segment(body)


@FUZZ_SOCKET
@given(
    bodies=st.lists(
        typed_bodies(MASTER_WIRE, SEQUENCE_NAMES).filter(lambda b: not known_bug(b)),
        min_size=1,
        max_size=8,
    )
)
def test_any_sequence_of_requests_gets_one_reply_each_and_none_internal(
    master: PoolProcess, client: Client, bodies: list[bytes]
) -> None:
    stream = b"".join(header(len(b), 0) + b for b in bodies)
    outcome = send_and_close(address(master), stream)
    assert outcome.closed
    replies = decode_replies(outcome.received, m.MASTER_REPLY_CODEC)
    assert len(replies) == len(bodies), replies
    assert not internal_errors(replies), list(
        zip(map(m.MASTER_REQUEST_CODEC.decode_body, bodies), replies, strict=True)
    )
    assert_master_serves(master, client)


@pytest.mark.parametrize("size", [0, -1])
def test_an_empty_or_negative_put_is_not_an_internal_error(master: PoolProcess, size: int) -> None:
    body = m.MASTER_REQUEST_CODEC.encode(m.PutStart("fuzz-empty", "fuzz-empty-key", size))
    replies, _ = send_and_read(address(master), body, m.MASTER_REPLY_CODEC)
    assert replies and not internal_errors(replies), replies


def test_a_negative_tokens_per_key_is_not_an_internal_error(master: PoolProcess) -> None:
    body = m.MASTER_REQUEST_CODEC.encode(m.PrefixLookup(["fuzz-none"], tokens_per_key=-1))
    replies, _ = send_and_read(address(master), body, m.MASTER_REPLY_CODEC)
    assert replies and not internal_errors(replies), replies


def test_an_unknown_tier_is_not_an_internal_error(master: PoolProcess) -> None:
    body = m.MASTER_REQUEST_CODEC.encode(m.AddSegment("fuzz-c", "fuzz-s", 1024, tier="tape"))
    replies, _ = send_and_read(address(master), body, m.MASTER_REPLY_CODEC)
    assert replies and not internal_errors(replies), replies


def test_a_batch_put_end_of_unequal_lists_is_not_an_internal_error(master: PoolProcess) -> None:
    body = m.MASTER_REQUEST_CODEC.encode(m.BatchPutEnd("fuzz-c", ["k1", "k2"], [1]))
    replies, _ = send_and_read(address(master), body, m.MASTER_REPLY_CODEC)
    assert replies and not internal_errors(replies), replies


def test_a_segment_nobody_can_reach_never_receives_other_clients_puts(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with start_master("--segment_size", "0") as lone, Client(lone.address, timeout_s=5) as c:
        rogue = m.MASTER_REQUEST_CODEC.encode(
            m.Register("fuzz-rogue")
        ) + m.MASTER_REQUEST_CODEC.encode(m.AddSegment("fuzz-rogue", "fuzz-seg", 64 << 20))
        replies, _ = send_and_read(address(lone), rogue, m.MASTER_REPLY_CODEC, want=2)
        assert len(replies) == 2
        if not any(isinstance(r, Error) for r in replies):  # accepted: then it must work
            c.put("fuzz-victim", b"x" * 1024)
            assert c.get("fuzz-victim") == b"x" * 1024
