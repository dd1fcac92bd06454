"""A real segment data server (with an SSD tier) fed random and mutated data-plane frames.

After every example, on a fresh connection: a write and a read of the segment return
exactly the bytes written, and an object demoted to the SSD tier reads back intact.  The
hostile connection must end in well-formed replies and a close once the peer half-closes;
no connection handler may fail (a handler's exception is logged by the server: none may
be), and no file may appear outside the SSD tier's folder, whatever the key.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.datapath.data_ops import read, ssd_read_into, write
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.datapath.shm import host_token
from kvpool.protocol.codec import DEFAULT_MAX_PAYLOAD
from kvpool.protocol.data import DATA_REPLY_CODEC, DATA_REQUEST_CODEC, Error, SegmentWrite
from kvpool.security.peer import PeerSettings
from kvpool.storage.checksum import checksum
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import SsdStore
from tests.fuzz.frames import FUZZ_SOCKET, header, mutated_frames
from tests.fuzz.peer import Failures, decode_replies, send_and_close, send_and_read
from tests.fuzz.wires import WIRES

pytestmark = pytest.mark.timeout(240)

DATA_WIRE = next(w for w in WIRES if w.name == "data-request")
SEGMENT = 1 << 20
# names a fuzzed request may use: the served segment, probe-like keys, paths
NAMES = st.sampled_from(["seg0", "seg1", "k", "a/b", "../escape", "/abs", "."]) | st.text(
    max_size=20
)
_probes = itertools.count()


@pytest.fixture(scope="module")
def place(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("segfuzz")


@pytest.fixture(scope="module")
def failures() -> Iterator[Failures]:
    with Failures.of("kvpool.datapath") as handler:
        yield handler


@pytest.fixture(scope="module")
def server(place: Path, failures: Failures) -> Iterator[SegmentServer]:
    segment = Segment.create(SEGMENT)
    ssd = SsdStore.open(place / "ssd", 256 << 20)
    # once a request has started, the rest of it is due within timeout_s: short here, so
    # a peer stalling mid-frame is dropped quickly
    srv = SegmentServer(timeout_s=1.0, host_token=host_token(), ssd=ssd)
    srv.add_segment("seg0", segment)
    srv.start()
    yield srv
    srv.close()
    segment.close()


def outside_files(place: Path) -> set[Path]:
    """Every path under the test's folder that is not the SSD tier's own."""
    return {p for p in place.rglob("*") if not p.is_relative_to(place / "ssd")}


def assert_server_serves(server: SegmentServer, failures: Failures, place: Path) -> None:
    assert not failures.records, failures.records[0].getMessage()
    assert not outside_files(place), sorted(outside_files(place))
    probe = next(_probes)
    value = os.urandom(4096)
    offset = (probe * 4096) % (SEGMENT - 4096)
    with SegmentConnection(*server.address, PeerSettings(10)) as conn:
        write(conn, "seg0", offset, value)
        assert read(conn, "seg0", offset, len(value)) == value
        key = f"probe-{probe}"
        conn.demote("seg0", offset, len(value), key, checksum(value))
        buf = bytearray(len(value))
        assert ssd_read_into(conn, key, buf) == len(value) and bytes(buf) == value
        conn.ssd_remove([key])


@FUZZ_SOCKET
@given(frame=mutated_frames(DATA_WIRE, strings=NAMES))
def test_any_frame_leaves_the_segment_server_serving_everyone_else(
    server: SegmentServer, failures: Failures, place: Path, frame: bytes
) -> None:
    outcome = send_and_close(server.address, frame)
    assert outcome.closed, f"the server held a half-closed connection open after {frame!r}"
    decode_replies(outcome.received, DATA_REPLY_CODEC)  # well-formed, whatever they say
    assert_server_serves(server, failures, place)


def test_a_bad_body_gets_an_error_and_the_connection_goes_on(
    server: SegmentServer, failures: Failures, place: Path
) -> None:
    bad = b"\x81\xa4type\xa5Bogus"
    good = DATA_REQUEST_CODEC.encode(SegmentWrite("seg0", 0, 0))
    replies, closed = send_and_read(
        server.address, header(len(bad), 0) + bad + good, DATA_REPLY_CODEC, want=2
    )
    assert not closed and len(replies) == 2, replies
    assert isinstance(replies[0], Error) and not isinstance(replies[1], Error), replies
    assert_server_serves(server, failures, place)


def test_a_write_announcing_more_than_it_sends_ends_only_its_own_connection(
    server: SegmentServer, failures: Failures, place: Path
) -> None:
    body = DATA_REQUEST_CODEC.encode(SegmentWrite("seg0", 0, DEFAULT_MAX_PAYLOAD))[12:]
    outcome = send_and_close(server.address, header(len(body), DEFAULT_MAX_PAYLOAD) + body)
    assert outcome.closed
    assert_server_serves(server, failures, place)


STALLS = {
    "mid-header": header(40, 0)[:7],
    "mid-body": DATA_REQUEST_CODEC.encode(SegmentWrite("seg0", 0, 0))[:-3],
    "mid-payload": DATA_REQUEST_CODEC.encode(SegmentWrite("seg0", 0, 4096), 4096) + b"x" * 100,
}


@pytest.mark.parametrize("data", list(STALLS.values()), ids=list(STALLS))
def test_a_peer_stalling_mid_frame_is_dropped_in_bounded_time(
    server: SegmentServer, failures: Failures, place: Path, data: bytes
) -> None:
    _, closed = send_and_read(server.address, data, DATA_REPLY_CODEC, until_close=True)
    assert closed, "the server waited past the bound for the rest of a frame"
    assert_server_serves(server, failures, place)
