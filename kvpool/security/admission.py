"""The server's side of one connection's handshake as bytes in, bytes out, without sockets.

:class:`Admission` tells a plain peer from a handshake by the first four bytes and says
how many bytes to read next, so a caller never reads a byte of the port's own protocol.
"""

from __future__ import annotations

from kvpool.errors import AuthError, ProtocolError
from kvpool.security.credentials import Credential
from kvpool.security.handshake import (
    AUTH_MAGIC,
    HEADER,
    FrameReader,
    Identity,
    ServerHandshake,
    refusal,
)

__all__ = ["Admission"]


class Admission:
    """The server's side of one connection's handshake, fed bytes as they arrive: the
    waiting room (:mod:`kvpool.datapath.waiting_room`) runs it on a non-blocking socket,
    :func:`~kvpool.security.socket_auth.admit` on a blocking one.  :meth:`need` is how
    many bytes to read next, exactly (never a byte of the port's own protocol that
    follows); :meth:`feed` takes them and gives what to send back.  It ends with
    :attr:`identity` (proved) or :attr:`failure` (an AuthError; its refusal was the last
    bytes :meth:`feed` gave)."""

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
