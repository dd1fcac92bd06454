"""Frames over blocking sockets, with deadlines and in-place payload receive.

The codec (:mod:`kvpool.protocol.codec`) is pure; these functions are its plainest
blocking-socket edge, for any socket and any codec (the P->D transfer worker and the
master's client use them).  :class:`kvpool.datapath.channel.Channel` does the same with
fewer syscalls per exchange (kernel timeouts, one ``sendmsg`` per frame, header and body
in one ``recv``) and is what the segment data path uses; prefer it for hot request/reply
loops (a small round trip is ~15 µs shorter on the reference VM).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from dataclasses import dataclass
from typing import TypeVar

from kvpool.errors import KVPoolError, PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.codec import HEADER_SIZE, Codec
from kvpool.security.socket_tls import peer_alert

__all__ = [
    "SMALL_PAYLOAD",
    "BadRequest",
    "call",
    "deadline_after",
    "discard",
    "recv_exactly_into",
    "recv_frame",
    "recv_request",
    "send_bytes",
    "send_frame",
    "tune_socket",
]

M = TypeVar("M")
R = TypeVar("R")

# Below this a payload is joined to its header and sent in one syscall (one TCP
# segment with NODELAY); above it the copy would cost more than the extra send.
SMALL_PAYLOAD = 16 * 1024
_DISCARD_CHUNK = 1 << 20


# Rules:
#
# - Every wait is bounded by an absolute ``deadline`` (``time.monotonic()`` seconds):
#   running out raises :class:`~kvpool.errors.PeerTimeout`; a closed or reset connection
#   raises :class:`~kvpool.errors.TransferError`.  Nothing here waits forever except
#   :func:`recv_request` with ``idle_timeout=None``, which a server uses between requests.
# - Payloads are received with ``recv_into`` straight into the caller's buffer and sent
#   with ``sendall`` of the caller's memoryview: no intermediate copy in Python.
def deadline_after(timeout_s: float) -> float:
    """The absolute deadline ``timeout_s`` seconds from now."""
    return time.monotonic() + timeout_s


def tune_socket(sock: socket.socket, buffer_bytes: int | None = None) -> None:
    """TCP_NODELAY for request/reply latency; optionally fixed socket buffers.

    ``buffer_bytes=None`` leaves the kernel's buffer autotuning on: setting SO_RCVBUF
    turns autotuning off, and the kernel caps the value at ``net.core.rmem_max``, which
    on stock kernels is smaller than what autotuning reaches on its own.
    """
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes is not None:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)


def _remaining(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout(f"timed out waiting for {what}")
    return left


def recv_exactly_into(
    sock: socket.socket, view: memoryview, deadline: float, what: str = "data"
) -> None:
    """Fill ``view`` completely from ``sock`` before ``deadline``."""
    received = 0
    total = len(view)
    while received < total:
        sock.settimeout(_remaining(deadline, what))
        try:
            n = sock.recv_into(view[received:])
        except TimeoutError:
            raise PeerTimeout(f"timed out waiting for {what}") from None
        except ssl.SSLError as exc:  # e.g. a TLS server refusing this client's certificate
            raise peer_alert(exc, f"receiving {what}") from None
        except OSError as exc:
            raise TransferError(f"connection failed while receiving {what}: {exc}") from None
        if n == 0:
            raise TransferError(
                f"peer closed the connection after {received} of {total} bytes of {what}"
            )
        received += n


def discard(sock: socket.socket, length: int, deadline: float) -> None:
    """Receive and drop ``length`` bytes (a refused write's payload), keeping the stream in sync."""
    scratch = memoryview(bytearray(min(length, _DISCARD_CHUNK)))
    while length > 0:
        chunk = min(length, len(scratch))
        recv_exactly_into(sock, scratch[:chunk], deadline, "a refused payload")
        length -= chunk


def _sendall(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    sock.settimeout(_remaining(deadline, "the peer to accept data"))
    try:
        sock.sendall(data)
    except TimeoutError:
        raise PeerTimeout("timed out sending: the peer stopped reading") from None
    except OSError as exc:
        raise why_send_failed(sock, exc) from None


def why_send_failed(sock: socket.socket, exc: OSError) -> KVPoolError:
    """The error of a failed send.  A TLS peer that closed on us usually said why first
    (an alert such as "certificate required", on TLS 1.3 sent after the handshake): read
    it."""
    if isinstance(sock, ssl.SSLSocket):
        with contextlib.suppress(OSError):
            sock.settimeout(0.2)
            try:
                sock.recv(1)
            except ssl.SSLError as alert:
                return peer_alert(alert, "sending")
    if isinstance(exc, ssl.SSLError):
        return peer_alert(exc, "sending")
    return TransferError(f"connection failed while sending: {exc}")


def send_bytes(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    """Send ``data`` whole before ``deadline`` (a handshake frame, a refusal)."""
    _sendall(sock, data, deadline)


def send_frame(
    sock: socket.socket,
    codec: Codec[M],
    message: M,
    payload: memoryview | None,
    deadline: float,
) -> None:
    """Send one frame: header + body, then ``payload`` (a flat byte view) if given."""
    length = 0 if payload is None else len(payload)
    head = codec.encode(message, length)
    if payload is None or length == 0:
        _sendall(sock, head, deadline)
    elif length <= SMALL_PAYLOAD:
        _sendall(sock, head + payload, deadline)
    else:
        _sendall(sock, head, deadline)
        _sendall(sock, payload, deadline)


def _recv_rest(
    sock: socket.socket, codec: Codec[M], header: bytearray, deadline: float
) -> tuple[M, int]:
    parsed = codec.decode_header(header)
    body = bytearray(parsed.body_length)
    recv_exactly_into(sock, memoryview(body), deadline, "a frame body")
    try:
        message = codec.decode_body(body)
    except ProtocolError:
        # The frame's payload is still in the stream; drop it so the stream stays in
        # sync and the caller can answer with an error and carry on.
        discard(sock, parsed.payload_length, deadline)
        raise
    return message, parsed.payload_length


def recv_frame(sock: socket.socket, codec: Codec[M], deadline: float) -> tuple[M, int]:
    """Receive one frame's header and body; return ``(message, payload_length)``.

    The caller must then consume exactly ``payload_length`` bytes (with
    :func:`recv_exactly_into` or :func:`discard`) before the next frame.  Raises
    :class:`~kvpool.errors.ProtocolError` on a malformed frame; when only the body was
    bad, the whole frame has been consumed and the stream is still usable.
    """
    header = bytearray(HEADER_SIZE)
    recv_exactly_into(sock, memoryview(header), deadline, "a reply")
    return _recv_rest(sock, codec, header, deadline)


@dataclass(frozen=True, slots=True)
class BadRequest:
    """A frame with a valid header whose body did not decode (e.g. an unknown message
    tag).  The whole frame, payload included, has been consumed: reply with ``error``
    and keep serving the connection."""

    error: ProtocolError


def recv_request(
    sock: socket.socket, codec: Codec[M], timeout_s: float, idle_timeout: float | None
) -> tuple[M, int] | BadRequest | None:
    """A server's :func:`recv_frame`: wait up to ``idle_timeout`` (``None``: forever)
    for a request to start, then ``timeout_s`` for the rest of its header and body.

    Returns ``None`` when the peer closes cleanly between requests, and
    :class:`BadRequest` for a consumed frame with an undecodable body.  A bad header
    (magic, limits) raises :class:`~kvpool.errors.ProtocolError`: the stream cannot be
    resynchronised, so reply if you like and close.
    """
    header = bytearray(HEADER_SIZE)
    view = memoryview(header)
    sock.settimeout(idle_timeout)
    try:
        n = sock.recv_into(view)
    except TimeoutError:
        raise PeerTimeout("timed out waiting for the next request") from None
    except OSError as exc:
        raise TransferError(f"connection failed: {exc}") from None
    if n == 0:
        return None
    deadline = deadline_after(timeout_s)
    recv_exactly_into(sock, view[n:], deadline, "a frame header")
    parsed = codec.decode_header(header)
    body = bytearray(parsed.body_length)
    recv_exactly_into(sock, memoryview(body), deadline, "a frame body")
    try:
        message = codec.decode_body(body)
    except ProtocolError as exc:
        discard(sock, parsed.payload_length, deadline)
        return BadRequest(exc)
    return message, parsed.payload_length


def call(
    sock: socket.socket,
    request_codec: Codec[M],
    reply_codec: Codec[R],
    request: M,
    timeout_s: float,
    payload: memoryview | None = None,
) -> tuple[R, int]:
    """One request/reply exchange; returns the reply and its pending payload length."""
    deadline = deadline_after(timeout_s)
    send_frame(sock, request_codec, request, payload, deadline)
    return recv_frame(sock, reply_codec, deadline)
