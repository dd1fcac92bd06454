"""The handshake that opens every authenticated kvpool connection, without sockets.

A mutual challenge–response with HMAC-SHA256 over nonces from both sides, the server
proving first; both sides are state machines fed with frames (the rules are beside them).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass, field

from kvpool.errors import AuthError, KVPoolError, ProtocolError
from kvpool.security.credentials import ROLES, Credential, key_for

__all__ = [
    "AUTH_MAGIC",
    "HEADER",
    "MAX_BODY",
    "ClientHandshake",
    "FrameReader",
    "Identity",
    "ServerHandshake",
    "refusal",
]

# - Every message is a frame ``KVPA`` | kind (1 byte) | body length (2 bytes, big-endian) |
#   body; the magic differs from the RPC frames' ``KVP1``, so a server tells a handshake
#   from a plain request by the first four bytes.  A refusal carries a one-line reason,
#   which the peer raises as :class:`~kvpool.errors.AuthError`.
# - After Welcome the connection speaks its port's own protocol; frames carry nothing of
#   the handshake, so the data plane pays nothing per frame.
AUTH_MAGIC = b"KVPA"
VERSION = 1
HEADER = struct.Struct("!4sBH")
#: a handshake body never needs more (ids are short); more is a broken or hostile peer
MAX_BODY = 1024
NONCE_BYTES = 32
PROOF_BYTES = 32

HELLO, CHALLENGE, PROOF, WELCOME, REFUSE = 1, 2, 3, 4, 5
_LABEL = b"kvpool-auth-1 "


def _frame(kind: int, body: bytes) -> bytes:
    return HEADER.pack(AUTH_MAGIC, kind, len(body)) + body


def refusal(reason: str) -> bytes:
    """A Refuse frame saying ``reason`` (one line, shortened to fit)."""
    return _frame(REFUSE, reason.encode()[:MAX_BODY])


class FrameReader:
    """Cuts handshake frames out of bytes as they arrive (any split)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self.buffer += data

    def next_frame(self) -> tuple[int, bytes] | None:
        """``(kind, body)`` of the next whole frame, or None until more bytes arrive."""
        if len(self.buffer) < HEADER.size:
            return None
        magic, kind, length = HEADER.unpack_from(self.buffer)
        if magic != AUTH_MAGIC:
            raise ProtocolError(f"not a kvpool handshake frame (magic {bytes(magic)!r})")
        if length > MAX_BODY:
            raise ProtocolError(f"handshake frame of {length} bytes (at most {MAX_BODY})")
        if len(self.buffer) < HEADER.size + length:
            return None
        body = bytes(self.buffer[HEADER.size : HEADER.size + length])
        del self.buffer[: HEADER.size + length]
        return kind, body

    def rest(self) -> bytes:
        """Bytes after the last frame (the port's own protocol, already arrived)."""
        rest = bytes(self.buffer)
        self.buffer.clear()
        return rest


def _expect(frame: tuple[int, bytes], kind: int, what: str) -> bytes:
    got, body = frame
    if got == REFUSE:
        raise AuthError(body.decode(errors="replace"))
    if got != kind:
        raise ProtocolError(f"handshake: expected {what}, got a frame of kind {got}")
    return body


def _field(value: bytes) -> bytes:
    return struct.pack("!H", len(value)) + value


def _proof(
    key: bytes, side: bytes, role: str, client_id: str, server_id: str, nc: bytes, ns: bytes
) -> bytes:
    transcript = b"".join(
        _field(v) for v in (role.encode(), client_id.encode(), server_id.encode(), nc, ns)
    )
    return hmac.new(key, _LABEL + side + transcript, hashlib.sha256).digest()


def _nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a server's peer proved to be."""

    role: str
    client_id: str


# Mutual challenge–response with HMAC-SHA256 over nonces from both sides::
#
#     client → server   Hello      role, client id, client nonce Nc
#     server → client   Challenge  server id, server nonce Ns, proof_s   (or Refuse)
#     client → server   Proof      proof_c                                (client checked proof_s)
#     server → client   Welcome                                           (or Refuse)
#
#     proof_x = HMAC(K, "kvpool-auth-1 " + x + transcript),  x = "server" | "client"
#     transcript = role, client id, server id, Nc, Ns (each length-prefixed)
#
# Rules:
#
# - K is the key of the claimed role (:func:`kvpool.security.credentials.key_for`); it is
#   never sent.  Both nonces are fresh per connection, so a recorded handshake replays
#   nowhere, and the two proofs carry different labels, so one side's proof is never the
#   other's.
# - The server proves first: a client knows it talks to a holder of the key before it sends
#   anything else (a request, or a value).  Only then does it prove itself.
# - The transcript binds the role and both ids, so a proof made as one node, or to one data
#   port, is no proof for another.
@dataclass
class ClientHandshake:
    """The client side: :meth:`hello`, then :meth:`on_challenge` (gives the Proof frame),
    then :meth:`on_verdict`.  Raises AuthError on a refusal or a server without the key."""

    credential: Credential
    role: str
    client_id: str
    nonce: bytes = field(default_factory=_nonce)
    server_id: str = ""

    def hello(self) -> bytes:
        if self.role not in ROLES:
            raise AuthError(f"unknown role {self.role!r}")
        body = struct.pack("!BB", VERSION, ROLES.index(self.role)) + self.nonce
        return _frame(HELLO, body + self.client_id.encode())

    def on_challenge(self, frame: tuple[int, bytes]) -> bytes:
        body = _expect(frame, CHALLENGE, "a challenge")
        if len(body) < NONCE_BYTES + PROOF_BYTES:
            raise ProtocolError("handshake: a short challenge")
        ns = body[:NONCE_BYTES]
        proofs = [body[NONCE_BYTES : NONCE_BYTES + PROOF_BYTES]]
        server_id, _, previous = body[NONCE_BYTES + PROOF_BYTES :].partition(b"\0")
        if len(previous) not in (0, PROOF_BYTES):
            raise ProtocolError("handshake: a challenge with a broken second proof")
        if previous:
            proofs.append(previous)
        self.server_id = server_id.decode(errors="replace")
        args = (self.role, self.client_id, self.server_id, self.nonce, ns)
        for candidate in self.credential.candidates():
            key = key_for(candidate, self.role, self.client_id, self.server_id)
            expected = _proof(key, b"server", *args)
            # every comparison runs: which proof matched is no timing signal
            if sum(hmac.compare_digest(p, expected) for p in proofs):
                return _frame(PROOF, _proof(key, b"client", *args))
        raise AuthError(
            f"the server ({self.server_id or 'unnamed'}) did not prove the cluster secret:"
            " the two sides hold different secrets, or this is not the real server"
        )

    def on_verdict(self, frame: tuple[int, bytes]) -> None:
        _expect(frame, WELCOME, "a welcome")


# - During a rotation a side holds two credentials, the new one and the previous one
#   (:meth:`Credential.candidates <kvpool.security.credentials.Credential.candidates>`).  The
#   server proves each: its Challenge carries proof_s under the new key, then, after the
#   server id and a NUL byte, proof_s under the previous key.  The client proves with the
#   first of its own keys (the new one first) that matches one of those, so a client and a
#   server meet on whichever secret they share, in one round trip, with no retry; the
#   server accepts a client proof under either of its keys.  With one credential the
#   Challenge is the same bytes as before rotation existed.
@dataclass
class ServerHandshake:
    """The server side: :meth:`on_hello` gives the Challenge (or a Refuse frame, after
    which it raises from :attr:`failure`), :meth:`on_proof` gives ``(Welcome or Refuse
    frame, Identity or None)``.  ``roles`` are those this port serves."""

    credential: Credential
    server_id: str
    roles: tuple[str, ...]
    nonce: bytes = field(default_factory=_nonce)
    failure: KVPoolError | None = None
    _args: tuple[str, str, str, bytes, bytes] | None = None
    _keys: tuple[bytes, ...] = ()

    def _refuse(self, reason: str) -> bytes:
        self.failure = AuthError(reason)
        return refusal(reason)

    def on_hello(self, frame: tuple[int, bytes]) -> bytes:
        kind, body = frame
        if kind != HELLO or len(body) < 2 + NONCE_BYTES:
            return self._refuse("expected a handshake hello")
        version, role_code = body[0], body[1]
        if version != VERSION:
            return self._refuse(f"handshake version {version}; this server speaks {VERSION}")
        role = ROLES[role_code] if role_code < len(ROLES) else "?"
        if role not in self.roles:
            return self._refuse(
                f"this port serves {', '.join(self.roles)}, not {role}: wrong address?"
            )
        nc = body[2 : 2 + NONCE_BYTES]
        client_id = body[2 + NONCE_BYTES :].decode(errors="replace")
        try:
            self._keys = tuple(
                key_for(c, role, client_id, self.server_id) for c in self.credential.candidates()
            )
        except AuthError as exc:
            return self._refuse(str(exc))
        self._args = (role, client_id, self.server_id, nc, self.nonce)
        first, *previous = (_proof(key, b"server", *self._args) for key in self._keys)
        body = self.nonce + first + self.server_id.encode()
        if previous:
            body += b"\0" + previous[0]
        return _frame(CHALLENGE, body)

    def on_proof(self, frame: tuple[int, bytes]) -> tuple[bytes, Identity | None]:
        kind, body = frame
        if self._args is None or kind != PROOF:
            return self._refuse("expected a handshake proof"), None
        expected = [_proof(key, b"client", *self._args) for key in self._keys]
        if not sum(hmac.compare_digest(body, e) for e in expected):
            role, client_id = self._args[0], self._args[1]
            return self._refuse(
                f"wrong credential for {role} {client_id!r}: check KVPOOL_SECRET_FILE "
                "(or --secret_file) holds this cluster's secret"
            ), None
        return _frame(WELCOME, b""), Identity(self._args[0], self._args[1])
