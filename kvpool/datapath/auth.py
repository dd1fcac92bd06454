"""The handshake of :mod:`kvpool.protocol.auth` over a blocking socket.

:func:`authenticate` is the client's step (the master link, a data connection),
:func:`admit` the threaded servers' (a node's data port).  Both finish within their
deadline or raise :class:`~kvpool.errors.PeerTimeout`; a refusal or a failed proof raises
:class:`~kvpool.errors.AuthError`.  A server that refuses says why in a Refuse frame and
the caller closes the connection.  After them, the socket carries its port's own frames.
"""

from __future__ import annotations

import contextlib
import socket

from kvpool.core.credentials import Credential
from kvpool.datapath.framing import deadline_after, recv_exactly_into
from kvpool.datapath.framing import send_bytes as _send
from kvpool.errors import AuthError, KVPoolError, ProtocolError, TransferError
from kvpool.protocol.auth import (
    AUTH_MAGIC,
    HEADER,
    ClientHandshake,
    FrameReader,
    Identity,
    ServerHandshake,
    refusal,
)

__all__ = ["Admission", "admit", "admit_with", "authenticate"]

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
        # a tenant's key to one node's data port (kvpool.datapath.tenant_path)
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


class Admission:
    """The server's side of one connection's handshake, fed bytes as they arrive: the
    waiting room (:mod:`kvpool.datapath.waiting_room`) runs it on a non-blocking socket,
    :func:`admit` on a blocking one.  :meth:`need` is how many bytes to read next, exactly
    (never a byte of the port's own protocol that follows); :meth:`feed` takes them and
    gives what to send back.  It ends with :attr:`identity` (proved) or :attr:`failure`
    (an AuthError; its refusal was the last bytes :meth:`feed` gave)."""

    def __init__(
        self,
        credential: Credential,
        server_id: str,
        roles: tuple[str, ...],
        refuse_plain: bytes,
    ) -> None:
        self._side = ServerHandshake(credential, server_id, roles)
        self._reader = FrameReader()
        self._refuse_plain = refuse_plain
        self._magic = bytearray()  # the first bytes, until they are the handshake's or not
        self._proving = False  # the Challenge sent: the next frame is the proof
        self.identity: Identity | None = None
        self.failure: AuthError | None = None

    @property
    def done(self) -> bool:
        return self.identity is not None or self.failure is not None

    def need(self) -> int:
        if len(self._magic) < len(AUTH_MAGIC):
            return len(AUTH_MAGIC) - len(self._magic)
        have = len(self._reader.buffer)
        if have < HEADER.size:
            return HEADER.size - have
        return max(1, HEADER.size + int(HEADER.unpack_from(self._reader.buffer)[2]) - have)

    def feed(self, data: bytes) -> bytes:
        if len(self._magic) < len(AUTH_MAGIC):
            self._magic += data
            if len(self._magic) < len(AUTH_MAGIC):
                return b""
            if bytes(self._magic) != AUTH_MAGIC:
                self.failure = AuthError("a peer without a credential (no handshake) was refused")
                return self._refuse_plain
            data = bytes(self._magic)
        self._reader.feed(data)
        try:
            frame = self._reader.next_frame()
            if frame is None:
                return b""
            if not self._proving:
                self._proving = True
                reply = self._side.on_hello(frame)
                if self._side.failure is not None:
                    self.failure = AuthError(str(self._side.failure))
                return reply
            reply, self.identity = self._side.on_proof(frame)
            if self.identity is None:
                self.failure = AuthError(str(self._side.failure))
            return reply
        except ProtocolError as exc:
            self.failure = AuthError(f"a broken handshake was refused: {exc}")
            return refusal(f"a broken handshake: {exc}")


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
