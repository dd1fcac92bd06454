"""Blocking socket reads and sends, each bounded by an absolute deadline: past it,
``PeerTimeout``; a closed or reset peer, ``TransferError``; a TLS alert, the error saying why.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time

from kvpool.errors import AuthError, KVPoolError, PeerTimeout, TransferError

__all__ = [
    "deadline_after",
    "discard",
    "peer_alert",
    "recv_exactly_into",
    "send_bytes",
    "tune_socket",
    "why_send_failed",
]

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


def peer_alert(exc: ssl.SSLError, what: str) -> AuthError | TransferError:
    """A TLS error met after the handshake (on TLS 1.3 a server's refusal of the client's
    certificate arrives with the first read): the kvpool error that says why."""
    reason = getattr(exc, "reason", None) or str(exc)  # set by the ssl module only
    if "CERTIFICATE" in reason.upper():
        return AuthError(
            f"the TLS server refused this client ({reason}): a server with tls_ca wants a "
            "client certificate its CA signed; set KVPOOL_TLS_CERT and KVPOOL_TLS_KEY "
            "(or tls_cert/tls_key)"
        )
    if isinstance(exc, ssl.SSLEOFError) or "EOF" in reason.upper():
        # the server hung up without a word: on TLS 1.3 a server with tls_ca that got
        # no client certificate does so when its alert is lost to the close
        return TransferError(
            f"TLS failed while {what}: the server closed the connection ({reason}); a "
            "server with tls_ca wants a client certificate its CA signed (KVPOOL_TLS_CERT "
            "and KVPOOL_TLS_KEY, or tls_cert/tls_key)"
        )
    return TransferError(f"TLS failed while {what}: {reason}")
