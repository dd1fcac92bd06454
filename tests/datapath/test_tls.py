"""TLS on a node's data port: bytes equal through it, a plain or mistrusting client gets
a clear error (never a hang), the server keeps serving, the wire carries no plaintext,
and the handshake still runs inside."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvpool.datapath.data_ops import read, read_into, write
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.errors import AuthError, PeerTimeout
from kvpool.protocol.data import DATA_REQUEST_CODEC, SegmentRead
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.security.tls import TLSConfig
from kvpool.storage.segment import Segment
from tests.datapath.test_segment_server import batch_round_trip
from tests.tls_material import Material, make_material

SECRET = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"
WRONG = "9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9a8b"
KNOWN = b"the user's prompt, as KV: " + b"7" * 64


@pytest.fixture(scope="module")
def material(tmp_path_factory: pytest.TempPathFactory) -> Material:
    return make_material(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def segment() -> Iterator[Segment]:
    seg = Segment.create(32 << 20)
    yield seg
    seg.close()


def _server(
    material: Material, segment: Segment, *, mutual: bool = False, **kw: object
) -> SegmentServer:
    cfg = TLSConfig(material.server.cert, material.server.key, material.ca.cert if mutual else "")
    srv = SegmentServer(timeout_s=5.0, tls=cfg.server_context(), **kw)  # type: ignore[arg-type]
    srv.add_segment("seg0", segment)
    srv.start()
    return srv


def _client(material: Material, **kw: object) -> ssl.SSLContext:
    ctx = TLSConfig(ca=material.ca.cert, **kw).client_context()  # type: ignore[arg-type]
    assert ctx is not None
    return ctx


@pytest.fixture
def server(material: Material, segment: Segment) -> Iterator[SegmentServer]:
    srv = _server(material, segment)
    yield srv
    srv.close()


def _connect(server: SegmentServer, tls: ssl.SSLContext | None, **kw: object) -> SegmentConnection:
    return SegmentConnection(*server.address, PeerSettings(5.0, tls=tls, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [1, 64 << 10, 16 << 20])
def test_bytes_round_trip_equal_over_tls(
    server: SegmentServer, segment: Segment, material: Material, size: int
) -> None:
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    with _connect(server, _client(material)) as conn:
        assert write(conn, "seg0", 4096, data) == size
        out = np.zeros(size, dtype=np.uint8)
        assert read_into(conn, "seg0", 4096, out) == size
        # many small frames in a row on one connection (joined records)
        for i in range(50):
            write(conn, "seg0", i * 8, i.to_bytes(8, "little"))
        assert read(conn, "seg0", 49 * 8, 8) == (49).to_bytes(8, "little")
    np.testing.assert_array_equal(out, data)
    assert segment.read(4096, size) == data.tobytes()


@pytest.mark.parametrize("size", [100, 1 << 20])  # joined into one record, and not
def test_a_ranged_batch_round_trips_over_tls(
    server: SegmentServer, material: Material, size: int
) -> None:
    with _connect(server, _client(material)) as conn:
        batch_round_trip(conn, [np.full(size, i + 1, dtype=np.uint8) for i in range(5)])


def test_a_client_without_tls_gets_a_clear_error_and_the_server_keeps_serving(
    server: SegmentServer, material: Material
) -> None:
    start = time.monotonic()
    with _connect(server, None) as plain, pytest.raises(AuthError, match="requires TLS"):
        read(plain, "seg0", 0, 5)
    # with a credential the plain client starts the kvpool handshake: refused in its words
    cred = Credential.parse(SECRET, "k")
    with (
        _connect(server, None, credential=cred, client_id="c") as plain,
        pytest.raises(AuthError, match="requires TLS"),
    ):
        read(plain, "seg0", 0, 5)
    assert time.monotonic() - start < 4.0  # a refusal, not a timeout
    with _connect(server, _client(material)) as conn:
        write(conn, "seg0", 0, b"alive")
        assert read(conn, "seg0", 0, 5) == b"alive"
    assert server._server.tls_refused >= 2


def test_a_client_trusting_another_ca_gets_a_certificate_error(
    server: SegmentServer, material: Material
) -> None:
    other = TLSConfig(ca=material.other_ca.cert).client_context()
    with _connect(server, other) as conn, pytest.raises(AuthError, match="not trusted"):
        read(conn, "seg0", 0, 5)
    with _connect(server, _client(material)) as conn:
        assert read(conn, "seg0", 0, 1) is not None


def test_the_certificate_must_name_the_address_dialled(
    material: Material, segment: Segment
) -> None:
    cfg = TLSConfig(material.wrong_host.cert, material.wrong_host.key)
    srv = SegmentServer(timeout_s=5.0, tls=cfg.server_context())
    srv.add_segment("seg0", segment)
    srv.start()
    try:
        with (
            _connect(srv, _client(material)) as conn,
            pytest.raises(AuthError, match=r"subjectAltName names 127\.0\.0\.1"),
        ):
            read(conn, "seg0", 0, 5)
    finally:
        srv.close()


def test_a_silent_peer_is_dropped_and_does_not_block_others(
    server: SegmentServer, material: Material
) -> None:
    idle = socket.create_connection(server.address, timeout=5)  # says nothing at all
    try:
        with _connect(server, _client(material)) as conn:
            write(conn, "seg0", 0, b"ok")
            assert read(conn, "seg0", 0, 2) == b"ok"
    finally:
        idle.close()


def test_the_wire_carries_no_plaintext(server: SegmentServer, material: Material) -> None:
    """Relay one TLS client through a raw socket pair and look at every byte."""
    seen = {"up": bytearray(), "down": bytearray()}
    relay = socket.create_server(("127.0.0.1", 0))
    relay.settimeout(5)

    def pump(src: socket.socket, dst: socket.socket, key: str) -> None:
        src.settimeout(5)
        try:
            while chunk := src.recv(65536):
                seen[key] += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        inbound, _ = relay.accept()
        outbound = socket.create_connection(server.address, timeout=5)
        with inbound, outbound:
            t = threading.Thread(target=pump, args=(outbound, inbound, "down"), daemon=True)
            t.start()
            pump(inbound, outbound, "up")
            t.join(5)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    port = relay.getsockname()[1]
    with SegmentConnection("127.0.0.1", port, PeerSettings(5.0, tls=_client(material))) as conn:
        write(conn, "seg0", 100, KNOWN)
        assert read(conn, "seg0", 100, len(KNOWN)) == KNOWN
    acceptor.join(10)
    relay.close()
    assert len(seen["up"]) > len(KNOWN) and len(seen["down"]) > len(KNOWN)
    for key in ("up", "down"):
        assert KNOWN[:24] not in seen[key]
        assert b"seg0" not in seen[key]


def test_the_kvpool_handshake_runs_inside_tls(material: Material, segment: Segment) -> None:
    cred = Credential.parse(SECRET, "k")
    srv = _server(material, segment, credential=cred, server_id="node-a")
    try:
        with _connect(srv, _client(material), credential=cred, client_id="c") as conn:
            write(conn, "seg0", 0, b"secret-proved")
            assert read(conn, "seg0", 0, 13) == b"secret-proved"
        wrong = Credential.parse(WRONG, "k")
        with (
            _connect(srv, _client(material), credential=wrong, client_id="c") as conn,
            pytest.raises(AuthError),
        ):
            read(conn, "seg0", 0, 5)
        # TLS alone is not the cluster secret: no handshake, no data
        with _connect(srv, _client(material)) as conn, pytest.raises(AuthError):
            read(conn, "seg0", 0, 5)
    finally:
        srv.close()


def test_mutual_tls_wants_a_client_certificate(material: Material, segment: Segment) -> None:
    srv = _server(material, segment, mutual=True)
    try:
        with (
            _connect(srv, _client(material)) as conn,
            pytest.raises(AuthError, match="KVPOOL_TLS_CERT and KVPOOL_TLS_KEY"),
        ):
            read(conn, "seg0", 0, 5)
        mine = _client(material, cert=material.client.cert, key=material.client.key)
        with _connect(srv, mine) as conn:
            write(conn, "seg0", 0, b"mtls")
            assert read(conn, "seg0", 0, 4) == b"mtls"
    finally:
        srv.close()


def test_a_raw_plain_request_reads_no_memory(server: SegmentServer, segment: Segment) -> None:
    segment.write(0, KNOWN)
    with socket.create_connection(server.address, timeout=5) as s:
        s.sendall(DATA_REQUEST_CODEC.encode(SegmentRead("seg0", 0, len(KNOWN))))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert KNOWN not in data and b"requires TLS" in data


def test_a_tls_peer_that_stops_answering_is_a_timeout_not_a_hang(material: Material) -> None:
    """TLS completes, then the server never replies: the read ends at the timeout."""
    ctx = TLSConfig(material.server.cert, material.server.key).server_context()
    assert ctx is not None
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5)
    done = threading.Event()

    def mute() -> None:
        conn, _ = listener.accept()
        with ctx.wrap_socket(conn, server_side=True) as tls:
            done.wait(10)  # reads nothing, answers nothing
            del tls

    thread = threading.Thread(target=mute, daemon=True)
    thread.start()
    start = time.monotonic()
    try:
        with (
            SegmentConnection(
                *listener.getsockname(), PeerSettings(1.0, tls=_client(material))
            ) as conn,
            pytest.raises(PeerTimeout),
        ):
            read(conn, "seg0", 0, 5)
        assert time.monotonic() - start < 4.0
    finally:
        done.set()
        thread.join(10)
        listener.close()


def test_a_quiet_tls_connection_is_dropped_and_the_client_reconnects(
    material: Material, segment: Segment
) -> None:
    srv = _server(material, segment, idle_timeout_s=0.5)
    srv.timeout_s = 0.5  # the idle wait wakes each timeout_s to look at the idle clock
    try:
        with _connect(srv, _client(material)) as conn:
            write(conn, "seg0", 0, b"before")
            deadline = time.monotonic() + 10
            while srv.stats.dropped_connections == 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert srv.stats.dropped_connections == 1  # the server let go of it
            time.sleep(1.1)  # past the client's reuse check
            assert read(conn, "seg0", 0, 6) == b"before"  # on a new connection
        assert srv.stats.connections == 2
    finally:
        srv.close()


def test_a_tls_server_that_hangs_up_on_a_send_is_said_to_want_a_client_certificate() -> None:
    # On TLS 1.3 a server with tls_ca refuses a client without a certificate after the
    # handshake; on a loaded host its alert can be lost to the close, and the client's
    # next send fails with a bare EOF.  That used to read "connection failed while
    # sending: EOF occurred in violation of protocol", naming no cause.
    from kvpool.sockio import peer_alert, why_send_failed

    eof = ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:2427)")
    err = peer_alert(eof, "sending")
    assert "wants a client certificate" in str(err) and "KVPOOL_TLS_CERT" in str(err)
    left, right = socket.socketpair()
    with left, right:
        assert "wants a client certificate" in str(why_send_failed(left, eof))
        plain = why_send_failed(left, BrokenPipeError(32, "Broken pipe"))
        assert "certificate" not in str(plain)  # a plain socket's failure says only itself
