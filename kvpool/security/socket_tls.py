"""TLS on a blocking socket: the client's wrap and the threaded servers' accept step.

ssl's errors become kvpool's (an ``AuthError`` naming the setting to fix, or a
``PeerTimeout``).  The kvpool handshake still runs inside the TLS channel: TLS hides the
bytes, the HMAC handshake proves the cluster secret.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Callable

from kvpool.errors import AuthError, PeerTimeout, TransferError

__all__ = [
    "TLS_RECORD_HANDSHAKE",
    "accept_tls",
    "speaks_tls",
    "tls_required",
    "wrap_client",
]

TLS_RECORD_HANDSHAKE = 0x16
_PEEK = 8


def wrap_client(
    sock: socket.socket, context: ssl.SSLContext, host: str, timeout_s: float, where: str
) -> ssl.SSLSocket:
    """TLS over ``sock`` (closed on failure), verifying the server's certificate for
    ``host`` (the address dialled)."""
    sock.settimeout(timeout_s)
    try:
        tls = context.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        sock.close()
        raise AuthError(
            f"{where}: its TLS certificate is not trusted ({exc.verify_message}): set "
            "KVPOOL_TLS_CA (or tls_ca) to the CA that signed it, and make sure its "
            f"subjectAltName names {host}"
        ) from None
    except TimeoutError:
        sock.close()
        raise PeerTimeout(f"{where}: the TLS handshake timed out") from None
    except ssl.SSLError as exc:
        sock.close()
        raise AuthError(
            f"{where}: the TLS handshake failed ({exc.reason or exc}): does the server "
            "speak TLS, and does it want a client certificate (KVPOOL_TLS_CERT/KEY)?"
        ) from None
    except OSError as exc:
        sock.close()
        raise TransferError(
            f"{where} closed the connection during the TLS handshake ({exc}): does it "
            "speak TLS? (a server without tls_cert does not)"
        ) from None
    return tls


# A server with TLS first peeks at the connection's first byte: a TLS ClientHello starts
# with 0x16 (a handshake record).  Anything else is a client without TLS, which gets
# ``refuse_plain(head)`` in plain text (its protocol's own error reply, so it reads a
# clear "this port requires TLS" instead of a reset) and is closed.
def accept_tls(
    conn: socket.socket,
    context: ssl.SSLContext,
    timeout_s: float,
    refuse_plain: Callable[[bytes], bytes],
) -> ssl.SSLSocket:
    """The server's TLS handshake on a fresh connection; raises AuthError (a plain
    client, refused with ``refuse_plain``; a failed handshake) or PeerTimeout.  On
    success ``conn`` is detached into the returned socket; on failure the caller
    closes ``conn``."""
    deadline = time.monotonic() + timeout_s
    conn.settimeout(timeout_s)
    try:
        head = conn.recv(_PEEK, socket.MSG_PEEK)
    except TimeoutError:
        raise PeerTimeout("a peer sent nothing (no TLS handshake) in time") from None
    except OSError as exc:
        raise TransferError(f"connection failed before TLS: {exc}") from None
    if not head:
        raise TransferError("a peer closed the connection before TLS")
    if head[0] != TLS_RECORD_HANDSHAKE:
        with contextlib.suppress(OSError):
            conn.sendall(refuse_plain(head))
            conn.shutdown(socket.SHUT_WR)
            conn.settimeout(0.2)
            while conn.recv(4096):
                pass
        raise AuthError("a peer without TLS was refused")
    conn.settimeout(max(deadline - time.monotonic(), 0.001))
    try:
        return context.wrap_socket(conn, server_side=True)
    except TimeoutError:
        raise PeerTimeout("a peer's TLS handshake timed out") from None
    except ssl.SSLError as exc:
        raise AuthError(f"a TLS handshake failed: {exc.reason or exc}") from None


def speaks_tls(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether ``host:port`` answers a TLS handshake (verification off: only to tell a
    client without TLS why a server closed on it).  One bounded exchange."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname = False
    probe.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout_s) as sock,
            probe.wrap_socket(sock),
        ):
            return True
    except (OSError, ValueError):  # ssl.SSLError is an OSError
        return False


def tls_required(where: str) -> AuthError:
    """The error of a client without TLS whose server speaks TLS."""
    return AuthError(
        f"{where} requires TLS: set KVPOOL_TLS_CA (or tls_ca; kvpool.Client(tls=...)) to "
        "the CA that signed its certificate"
    )
