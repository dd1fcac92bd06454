"""The handshake of :mod:`kvpool.security.handshake` over a blocking socket.

The client's step (:func:`authenticate`) and the threaded servers' (:func:`admit`) finish
within their deadline or raise ``PeerTimeout``; a refusal or a failed proof raises
``AuthError``.  After them, the socket carries its port's own frames.
"""

from __future__ import annotations

import contextlib
import socket

from kvpool.errors import AuthError, KVPoolError, ProtocolError, TransferError
from kvpool.security.admission import Admission
from kvpool.security.credentials import Credential
from kvpool.security.handshake import HEADER, ClientHandshake, FrameReader, Identity

# the deadlines and exact reads of every blocking socket in kvpool (framing turns a TLS
# alert met on a read into the error that says which setting to fix)
from kvpool.sockio import deadline_after, recv_exactly_into
from kvpool.sockio import send_bytes as _send

__all__ = ["admit", "admit_with", "authenticate"]

_SHORT_READ = 4096


def _recv_frame(sock: socket.socket, reader: FrameReader, deadline: float) -> tuple[int, bytes]:
    """One frame: its header, then exactly its body (never a byte of what follows, which
    is the port's own protocol)."""
    while True:
        frame = reader.next_frame()
        if frame is not None:
            return frame
        have = len(reader.buffer)
        if have < HEADER.size:
            need = HEADER.size - have
        else:
            need = HEADER.size + HEADER.unpack_from(reader.buffer)[2] - have
        chunk = bytearray(need)
        recv_exactly_into(sock, memoryview(chunk), deadline, "the handshake")
        reader.feed(bytes(chunk))


def authenticate(
    sock: socket.socket,
    credential: Credential,
    role: str,
    client_id: str,
    timeout_s: float,
    where: str,
) -> str:
    """Prove ``credential`` to the server on ``sock`` as ``role``/``client_id`` and check
    its proof; returns the server's id.  ``where`` names the server in errors.  An
    AuthError whose ``__cause__`` is set means the server did not speak the handshake at
    all (it may be another protocol's server)."""
    deadline = deadline_after(timeout_s)
    if credential.data_key and role == "data":
        # a tenant's key to one node's data port (kvpool.tenancy.data_path)
        role, client_id = "tenant-data", credential.tenant
    side = ClientHandshake(credential, role, client_id)
    reader = FrameReader()
    try:
        _send(sock, side.hello(), deadline)
        proof = side.on_challenge(_recv_frame(sock, reader, deadline))
        _send(sock, proof, deadline)
        side.on_verdict(_recv_frame(sock, reader, deadline))
    except AuthError as exc:
        raise AuthError(f"{where}: {exc}") from None
    except TransferError as exc:  # chained: the server may speak another protocol
        raise AuthError(
            f"{where} closed the connection during the handshake ({exc}): does it hold a "
            "secret? (a server without one does not speak the handshake)"
        ) from exc
    except ProtocolError as exc:
        raise AuthError(
            f"{where} does not speak the handshake ({exc}): it has no secret configured, "
            "or it is not a kvpool server"
        ) from exc
    return side.server_id


def admit(
    sock: socket.socket,
    credential: Credential,
    server_id: str,
    roles: tuple[str, ...],
    timeout_s: float,
    refuse_plain: bytes,
) -> Identity:
    """Run the server's side on a fresh connection.  A peer that starts with anything but
    a handshake is sent ``refuse_plain`` (its protocol's own error reply, so a client
    without a credential reads a clear AuthError) and refused.  Raises AuthError (sent
    to the peer already) or PeerTimeout/TransferError; the caller closes ``sock``."""
    return admit_with(sock, Admission(credential, server_id, roles, refuse_plain), timeout_s)


def admit_with(sock: socket.socket, admission: Admission, timeout_s: float) -> Identity:
    """:func:`admit` with an :class:`Admission` made beforehand (blocking)."""
    deadline = deadline_after(timeout_s)
    while not admission.done:
        chunk = bytearray(admission.need())
        recv_exactly_into(sock, memoryview(chunk), deadline, "the handshake")
        reply = admission.feed(bytes(chunk))
        if reply:
            if admission.failure is not None:
                with contextlib.suppress(KVPoolError):
                    _send(sock, reply, deadline)
                _linger(sock)
                raise admission.failure
            _send(sock, reply, deadline)
    if admission.failure is not None:
        raise admission.failure
    assert admission.identity is not None
    return admission.identity


def _linger(sock: socket.socket) -> None:
    """Stop writing and read a little of what the peer sent, so the close is no reset
    that would drop the refusal before the peer reads it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(0.2)
        while sock.recv(_SHORT_READ):
            pass
