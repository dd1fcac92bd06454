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
from hypothesis import given

from kvpool.net import http_get
from kvpool.protocol import messages as m
from kvpool.protocol.codec import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD
from kvpool.protocol.data import Error
from kvpool.service.client import Client
from kvpool.testing.processes import PoolProcess, start_master
from tests.fuzz.frames import FUZZ_SOCKET, header, mutated_frames
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
    outcome = send_and_close(address(master), frame)
    assert outcome.closed, f"the master held a half-closed connection open after {frame!r}"
    if is_rpc(frame):  # else the first bytes went to HTTP, which answers as it likes
        replies = decode_replies(outcome.received, m.MASTER_REPLY_CODEC)
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
        address(master), header(len(body), 0) + body + good, m.MASTER_REPLY_CODEC
    )
    assert replies and isinstance(replies[0], Error) and replies[0].code != INTERNAL
    assert not closed
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


@pytest.mark.xfail(
    strict=True,
    reason="issue 11 item 3: the master waits for (and buffers) a request payload it "
    "never uses, instead of refusing it from the header and closing",
)
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
