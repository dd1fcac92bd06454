from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import xxhash

from kvpool.datapath import framing
from kvpool.datapath.data_ops import (
    read,
    read_into,
    read_many_into,
    ssd_read_into,
    write,
    write_many,
)
from kvpool.datapath.segment_client import PIPELINE_DEPTH, SegmentConnection
from kvpool.datapath.segment_server import DATA_IDLE_TIMEOUT_S, MAX_RANGES, SegmentServer
from kvpool.errors import (
    ChecksumMismatch,
    ObjectNotFound,
    Overloaded,
    PeerTimeout,
    PoolError,
    ProtocolError,
    TransferError,
    UnknownSegment,
)
from kvpool.protocol.codec import HEADER_SIZE, MAGIC, Codec
from kvpool.protocol.data import (
    DATA_REPLY_CODEC,
    DATA_REQUEST_CODEC,
    DataReply,
    Error,
    Ok,
    SegmentRead,
    SegmentReadMany,
    SegmentWrite,
)
from kvpool.security.peer import PeerSettings
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import SsdStore, object_path
from tests.threads import run_threads
from tests.waiting import wait_until

from .conftest import SEGMENT_SIZE


def connect(server: SegmentServer, timeout_s: float = 5.0) -> SegmentConnection:
    host, port = server.address
    return SegmentConnection(host, port, PeerSettings(timeout_s))


def raw_socket(server: SegmentServer) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=5)
    return sock


def read_reply(sock: socket.socket) -> tuple[DataReply, int]:
    return framing.recv_frame(sock, DATA_REPLY_CODEC, framing.deadline_after(5))


def assert_closed(sock: socket.socket) -> None:
    # Closing with unread input sends a reset instead of a FIN; both mean "closed".
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def assert_still_serves(server: SegmentServer) -> None:
    with connect(server) as conn:
        write(conn, "seg0", 7, b"alive")
        assert read(conn, "seg0", 7, 5) == b"alive"


@pytest.mark.parametrize("size", [0, 1, 64 * 1024, 16 << 20])
def test_round_trip_sizes(server: SegmentServer, segment: Segment, size: int) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with connect(server) as conn:
        assert write(conn, "seg0", 4096, data) == size
        out = np.zeros(size, dtype=np.uint8)
        assert read_into(conn, "seg0", 4096, out) == size
    np.testing.assert_array_equal(out, data)
    assert segment.read(4096, size) == data.tobytes()  # landed in the segment itself


def test_torch_tensor_round_trip(server: SegmentServer) -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(1024, dtype=torch.float16)
    dst = torch.zeros(1024, dtype=torch.float16)
    with connect(server) as conn:
        write(conn, "seg0", 0, src)
        read_into(conn, "seg0", 0, dst)
    assert torch.equal(src, dst)


def test_out_of_range_and_unknown_segment_are_typed_and_connection_survives(
    server: SegmentServer,
) -> None:
    with connect(server) as conn:
        with pytest.raises(PoolError, match="outside segment"):
            write(conn, "seg0", SEGMENT_SIZE - 10, b"x" * 11)
        with pytest.raises(PoolError, match="outside segment"):
            read(conn, "seg0", -1, 1)
        with pytest.raises(UnknownSegment, match="nope"):
            write(conn, "nope", 0, b"x" * 100_000)  # its payload is drained, not parsed
        write(conn, "seg0", 0, b"ok")
        assert read(conn, "seg0", 0, 2) == b"ok"
    assert server.stats.error_replies == 3


def test_bad_magic_gets_an_error_and_a_closed_connection(server: SegmentServer) -> None:
    with raw_socket(server) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
        reply, _ = read_reply(sock)
        assert isinstance(reply, Error) and reply.code == "PROTOCOL"
        assert "magic" in reply.message
        assert_closed(sock)
    assert_still_serves(server)


def test_oversized_frame_is_refused_without_reading_it(server: SegmentServer) -> None:
    with raw_socket(server) as sock:
        sock.sendall(struct.pack("!4sII", MAGIC, 100, 2**31))
        reply, _ = read_reply(sock)
        assert isinstance(reply, Error) and "exceeds" in reply.message
        assert_closed(sock)
    assert_still_serves(server)


class Bogus(msgspec.Struct, tag=True):
    x: int


def test_unknown_message_type_gets_an_error_and_the_connection_goes_on(
    server: SegmentServer,
) -> None:
    bogus: Codec[Bogus] = Codec(Bogus)
    with raw_socket(server) as sock:
        sock.sendall(bogus.encode(Bogus(1), 3) + b"abc")
        reply, _ = read_reply(sock)
        assert isinstance(reply, Error) and reply.code == "PROTOCOL"
        assert "invalid message" in reply.message
        framing.send_frame(
            sock, DATA_REQUEST_CODEC, SegmentRead("seg0", 0, 0), None, framing.deadline_after(5)
        )
        assert read_reply(sock) == (Ok(0), 0)
    assert server.stats.protocol_errors == 1


def test_payload_length_disagreeing_with_the_request_is_an_error(server: SegmentServer) -> None:
    with raw_socket(server) as sock:
        sock.sendall(DATA_REQUEST_CODEC.encode(SegmentWrite("seg0", 0, 10), 4) + b"abcd")
        reply, _ = read_reply(sock)
        assert isinstance(reply, Error) and "declares 10 payload bytes" in reply.message
        sock.sendall(DATA_REQUEST_CODEC.encode(SegmentRead("seg0", 0, 1), 0))
        reply, length = read_reply(sock)
        assert reply == Ok(1) and length == 1


def test_client_vanishing_mid_payload_does_not_hurt_the_server(server: SegmentServer) -> None:
    with raw_socket(server) as sock:
        sock.sendall(DATA_REQUEST_CODEC.encode(SegmentWrite("seg0", 0, 1 << 20), 1 << 20))
        sock.sendall(b"p" * 1000)
    wait_until(lambda: server.stats.dropped_connections == 1)
    assert_still_serves(server)


def test_server_drops_a_stalled_request_after_its_timeout(segment: Segment) -> None:
    with SegmentServer(timeout_s=0.3) as srv:
        srv.add_segment("seg0", segment)
        with raw_socket(srv) as sock:
            sock.sendall(MAGIC)  # a header that never completes
            wait_until(lambda: srv.stats.dropped_connections == 1)
            assert_closed(sock)
        assert_still_serves(srv)


def test_peer_that_never_answers_is_a_peer_timeout() -> None:
    # A listening socket nobody accepts on: connect succeeds (kernel backlog), no reply.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        host, port = silent.getsockname()[:2]
        conn = SegmentConnection(host, port, PeerSettings(0.3))
        start = time.monotonic()
        with pytest.raises(PeerTimeout):
            read(conn, "seg0", 0, 10)
        assert time.monotonic() - start < 10  # bounded by the timeout, not a hang
        conn.close()


@contextlib.contextmanager
def replying(reply: bytes) -> Iterator[tuple[str, int]]:
    """A fake data server's address: it takes one connection, reads one request, answers
    ``reply`` (bytes as they are, right or wrong) and hangs up."""
    with socket.create_server(("127.0.0.1", 0)) as fake:

        def answer() -> None:
            conn, _ = fake.accept()
            with conn:
                framing.recv_frame(conn, DATA_REQUEST_CODEC, framing.deadline_after(5))
                conn.sendall(reply)

        thread = threading.Thread(target=answer)
        thread.start()
        yield fake.getsockname()[:2]
        thread.join(10)


def test_peer_dying_mid_reply_is_a_transfer_error() -> None:
    half = DATA_REPLY_CODEC.encode(Ok(100), 100) + b"x" * 10
    with (
        replying(half) as (host, port),
        SegmentConnection(host, port, PeerSettings(5)) as conn,
        pytest.raises(TransferError, match="10 of 100"),
    ):
        read(conn, "seg0", 0, 100)


def test_unreachable_server_is_a_transfer_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(TransferError, match="cannot connect"):
        read(SegmentConnection("127.0.0.1", port, PeerSettings(2)), "seg0", 0, 1)


def test_connection_reconnects_after_the_server_restarts(segment: Segment) -> None:
    srv = SegmentServer()
    srv.add_segment("seg0", segment)
    host, port = srv.start()
    conn = SegmentConnection(host, port, PeerSettings(5))
    write(conn, "seg0", 0, b"one")
    srv.close()
    with pytest.raises(TransferError):
        read(conn, "seg0", 0, 3)
    with SegmentServer(port=port) as again:
        again.add_segment("seg0", segment)
        assert read(conn, "seg0", 0, 3) == b"one"
    conn.close()


def test_parallel_clients_write_disjoint_regions(server: SegmentServer, segment: Segment) -> None:
    chunk = 1 << 20
    failures: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with connect(server) as conn:
                for r in range(4):
                    write(conn, "seg0", i * chunk, bytes([i * 16 + r]) * chunk)
                assert read(conn, "seg0", i * chunk, chunk) == bytes([i * 16 + 3]) * chunk
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    run_threads(threads, 60)
    assert not failures
    for i in range(4):
        assert segment.read(i * chunk, chunk) == bytes([i * 16 + 3]) * chunk
    # Counters updated from four connection threads at once lose nothing.
    assert server.stats.requests == 4 * 5
    assert server.stats.bytes_written == 16 * chunk
    assert server.stats.bytes_read == 4 * chunk


def test_header_size_is_stable() -> None:
    # The wire format is a contract with other processes; changing it needs a new magic.
    assert HEADER_SIZE == 12 and MAGIC == b"KVP1"


def test_protocol_error_from_a_garbled_reply_drops_the_connection() -> None:
    with replying(b"NOPE" + bytes(8)) as (host, port):
        conn = SegmentConnection(host, port, PeerSettings(5))
        with pytest.raises(ProtocolError, match="magic"):
            read(conn, "seg0", 0, 4)
        assert conn._channel is None  # never reused mid-frame


def test_ssd_objects_are_read_over_the_data_connection(tmp_path: Path, segment: Segment) -> None:
    ssd = SsdStore.open(tmp_path, 1 << 20)
    ssd.put("k1", b"on-ssd" * 100)
    ssd.put("k2", b"soon-corrupt")
    with SegmentServer(ssd=ssd) as srv:
        srv.add_segment("seg0", segment)
        with connect(srv) as conn:
            buf = bytearray(600)
            assert ssd_read_into(conn, "k1", buf) == 600 and buf == b"on-ssd" * 100
            with pytest.raises(ObjectNotFound):
                ssd_read_into(conn, "missing", bytearray(3))
            with pytest.raises(ObjectNotFound, match="expects"):
                ssd_read_into(conn, "k1", bytearray(10))
            path = object_path(tmp_path, "k2")
            raw = bytearray(path.read_bytes())
            raw[-1] ^= 0xFF
            path.write_bytes(raw)
            with pytest.raises(ChecksumMismatch):
                ssd_read_into(conn, "k2", bytearray(12))
            write(conn, "seg0", 0, b"still-up")  # a miss does not cost the connection
            assert read(conn, "seg0", 0, 8) == b"still-up"
    assert ssd.stats.corruptions == 1


def test_node_without_ssd_answers_ssd_reads_with_a_miss(server: SegmentServer) -> None:
    with connect(server) as conn, pytest.raises(ObjectNotFound, match="no SSD tier"):
        ssd_read_into(conn, "k", bytearray(1))


def test_pipelined_writes_and_reads_report_per_item_errors(
    server: SegmentServer, segment: Segment
) -> None:
    count = PIPELINE_DEPTH * 2 + 5  # several windows
    values = [bytes([i % 256]) * 4096 for i in range(count)]
    items: list[tuple[str, int, object]] = [("seg0", i * 4096, v) for i, v in enumerate(values)]
    items[3] = ("nope", 0, b"x" * 10)
    items[70] = ("seg0", SEGMENT_SIZE - 1, b"xy")
    with connect(server) as conn:
        results = write_many(conn, items)
        assert isinstance(results[3], UnknownSegment)
        assert isinstance(results[70], PoolError)
        assert [i for i, r in enumerate(results) if r is not None] == [3, 70]
        outs = [bytearray(4096) for _ in range(count)]
        reads: list[tuple[str, int, object]] = [
            ("seg0", i * 4096, out) for i, out in enumerate(outs)
        ]
        reads[5] = ("seg0", SEGMENT_SIZE, bytearray(1))
        read_results = read_many_into(conn, reads)
        assert [i for i, r in enumerate(read_results) if r is not None] == [5]
        for i in range(count):
            if i not in (3, 5, 70):
                assert outs[i] == values[i], i
        assert read(conn, "seg0", 0, 4) == values[0][:4]  # the connection is still good


def batch_round_trip(conn: SegmentConnection, values: list[np.ndarray]) -> None:
    """Write ``values`` side by side into seg0 in one batch, read them back in one batch
    into buffers filled with 0xFF (a byte the callers' values do not hold), compare."""
    size, ok = len(values[0]), [None] * len(values)
    assert write_many(conn, [("seg0", i * size, v) for i, v in enumerate(values)]) == ok
    outs = [np.full(size, 0xFF, dtype=np.uint8) for _ in values]
    assert read_many_into(conn, [("seg0", i * size, o) for i, o in enumerate(outs)]) == ok
    for v, o in zip(values, outs, strict=True):
        np.testing.assert_array_equal(v, o)


def test_pipelined_large_values_do_not_deadlock(server: SegmentServer) -> None:
    size = 4 << 20
    with connect(server) as conn:
        batch_round_trip(conn, [np.full(size, i, dtype=np.uint8) for i in range(6)])


def test_a_demotion_copies_matching_bytes_and_refuses_changed_ones(
    tmp_path: Path, segment: Segment
) -> None:
    ssd = SsdStore.open(tmp_path, 1 << 20)
    with SegmentServer(ssd=ssd) as srv:
        srv.add_segment("seg0", segment)
        with connect(srv) as conn:
            write(conn, "seg0", 0, b"demote-me" * 10)
            good = xxhash.xxh3_64_intdigest(b"demote-me" * 10)
            conn.demote("seg0", 0, 90, "kept", good)
            assert ssd.get("kept") == b"demote-me" * 10
            write(conn, "seg0", 0, b"overtaken" * 10)  # a new write got there first
            with pytest.raises(ChecksumMismatch):
                conn.demote("seg0", 0, 90, "stale", good)
            assert "stale" not in ssd
            assert read(conn, "seg0", 0, 9) == b"overtaken"  # the connection keeps serving


# -- what a peer can make a data server hold (issue 11, item 3) ------------------------


def test_an_idle_connection_is_closed_after_the_idle_timeout(segment: Segment) -> None:
    # what a node's data port does unless told otherwise: idle peers do not stay forever
    assert SegmentServer().idle_timeout_s == DATA_IDLE_TIMEOUT_S
    with SegmentServer(timeout_s=5.0, idle_timeout_s=0.2) as srv:
        srv.add_segment("seg0", segment)
        with raw_socket(srv) as sock:
            sock.settimeout(10)
            # it waits for its first request without a thread, then is closed (after
            # the waiting room's HANDSHAKE_S: the idle timeout counts after a request)
            wait_until(lambda: srv._server.waiting == 1, what="the connection was accepted")
            assert sock.recv(1) == b""  # closed by the server, not by us
            wait_until(lambda: srv.connections == 0, what="its thread ended")
        assert_still_serves(srv)


def test_a_client_reconnects_by_itself_after_an_idle_close(segment: Segment) -> None:
    with SegmentServer(timeout_s=5.0, idle_timeout_s=0.2) as srv:
        srv.add_segment("seg0", segment)
        with connect(srv) as conn:
            write(conn, "seg0", 0, b"before")
            wait_until(lambda: srv.connections == 0, what="the idle close")
            wait_until(lambda: time.monotonic() - conn._used > 1.0, what="unused for a while")
            assert read(conn, "seg0", 0, 6) == b"before"  # no error: a fresh connection
        assert srv.stats.connections == 2


def test_connections_over_the_cap_get_a_clear_refusal(segment: Segment) -> None:
    with SegmentServer(timeout_s=5.0, max_connections=2) as srv:
        srv.add_segment("seg0", segment)
        held = [connect(srv), connect(srv)]
        for conn in held:
            write(conn, "seg0", 0, b"ok")
        extra = connect(srv)
        with pytest.raises(Overloaded, match="limit of 2 connections"):
            read(extra, "seg0", 0, 2)
        # pipelined: every item is refused, none lost silently
        results = write_many(extra, [("seg0", 0, b"a"), ("seg0", 8, b"b")])
        assert [type(r) for r in results] == [Overloaded, Overloaded]
        assert srv.connections == 2 and srv._server.refused == 2
        held[0].close()
        wait_until(lambda: srv.connections == 1, what="a slot freed")
        assert read(extra, "seg0", 0, 2) == b"ok"  # and then it is served
        for conn in (*held, extra):
            conn.close()


def test_a_raw_peer_over_the_cap_reads_the_refusal_before_the_close(segment: Segment) -> None:
    with SegmentServer(timeout_s=5.0, max_connections=1) as srv:
        srv.add_segment("seg0", segment)
        with raw_socket(srv) as first:
            first.sendall(DATA_REQUEST_CODEC.encode(SegmentRead("seg0", 0, 4)))
            assert read_reply(first)[1] == 4  # served: it holds the one slot
            assert first.recv(4, socket.MSG_WAITALL)
            wait_until(lambda: srv.connections == 1)
            with raw_socket(srv) as sock:
                sock.sendall(DATA_REQUEST_CODEC.encode(SegmentRead("seg0", 0, 4)))
                reply, length = read_reply(sock)
                assert isinstance(reply, Error) and reply.code == Overloaded.code
                assert length == 0
                assert_closed(sock)
            first.close()


def test_ssd_reads_share_one_byte_budget(tmp_path: Path, segment: Segment) -> None:
    ssd = SsdStore.open(tmp_path, 4 << 20)
    ssd.put("big", b"b" * (1 << 20))
    with SegmentServer(timeout_s=0.3, ssd=ssd, ssd_read_budget=1 << 20) as srv:
        srv.add_segment("seg0", segment)
        with connect(srv, timeout_s=5) as conn:
            buf = bytearray(1 << 20)
            assert ssd_read_into(conn, "big", buf) == 1 << 20  # as large as the budget: fine
            wait_until(lambda: srv.ssd_reads.held == 0, what="given back once sent")
            assert srv.ssd_reads.take(1, 1)  # another reader holds a byte of it...
            with pytest.raises(Overloaded, match="budget"):  # ...so this one finds no room
                ssd_read_into(conn, "big", buf)
            srv.ssd_reads.give(1)
            assert ssd_read_into(conn, "big", buf) == 1 << 20  # the connection goes on


def test_a_batch_is_one_request_per_window_and_a_refused_window_is_retried_per_item(
    server: SegmentServer, segment: Segment
) -> None:
    count = PIPELINE_DEPTH + 6  # two windows
    values = [bytes([i % 251 + 1]) * 1000 for i in range(count)]
    with connect(server) as conn:
        before = server.stats.requests
        assert (
            write_many(conn, [("seg0", i * 1000, v) for i, v in enumerate(values)])
            == [None] * count
        )
        outs = [bytearray(1000) for _ in range(count)]
        assert (
            read_many_into(conn, [("seg0", i * 1000, o) for i, o in enumerate(outs)])
            == [None] * count
        )
        assert outs == [bytearray(v) for v in values]
        assert server.stats.requests - before == 4  # a ranged request per window
        # one bad range: the ranged write is refused whole (nothing of it written), and
        # the items asked again one by one write the good ones
        fresh = [b"\xee" * 1000, b"\xdd" * 1000]
        items: list[tuple[str, int, object]] = [("seg0", 0, fresh[0]), ("nope", 0, fresh[1])]
        before = server.stats.requests
        results = write_many(conn, items)
        assert results[0] is None and isinstance(results[1], UnknownSegment)
        assert server.stats.requests - before == 3  # the ranged one, then one per item
        assert read(conn, "seg0", 0, 1000) == fresh[0]


def test_a_ranged_read_of_too_many_ranges_is_refused_and_the_connection_goes_on(
    server: SegmentServer,
) -> None:
    with raw_socket(server) as sock:
        too_many = SegmentReadMany([("seg0", 0, 1)] * (MAX_RANGES + 1))
        sock.sendall(DATA_REQUEST_CODEC.encode(too_many))
        reply, length = read_reply(sock)
        assert isinstance(reply, Error) and reply.code == ProtocolError.code and length == 0
        assert f"at most {MAX_RANGES} ranges" in reply.message
        sock.sendall(DATA_REQUEST_CODEC.encode(SegmentReadMany([("seg0", 0, 3), ("seg0", 8, 2)])))
        reply, length = read_reply(sock)
        assert reply == Ok(5) and length == 5
