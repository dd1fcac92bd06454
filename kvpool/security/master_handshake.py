"""The master's side of authentication: the RPC handshake on the event loop, and who may
speak for which id.

A connection that opens with the handshake's magic proves a key (roles ``client``, ``node``,
``tenant``) before the RPC protocol gets it, with the :class:`Identity` it proved; one that
sends a plain RPC frame instead gets an ``AuthError`` reply and is closed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

from kvpool.errors import AuthError, KVPoolError, ProtocolError
from kvpool.protocol import messages as m
from kvpool.protocol.data import error_reply
from kvpool.protocol.messages import MASTER_REPLY_CODEC
from kvpool.security.credentials import Credential
from kvpool.security.handshake import FrameReader, Identity, ServerHandshake, refusal

__all__ = ["HANDSHAKE_TIMEOUT_S", "AuthProtocol", "Owners", "plain_refusal"]

log = logging.getLogger("kvpool.master")

#: a connection must finish the handshake within this long
HANDSHAKE_TIMEOUT_S = 10.0
#: what a node's own connection may send
NODE_REQUESTS = (m.Register, m.AddSegment, m.Heartbeat, m.Restore)
_LINGER_S = 1.0


def _close_after(transport: asyncio.Transport, data: bytes) -> None:
    """Write ``data`` and close so the peer reads it (a FIN, then a bounded linger)."""
    transport.write(data)
    if transport.can_write_eof():
        transport.write_eof()
        asyncio.get_running_loop().call_later(_LINGER_S, transport.abort)
    else:
        transport.close()


def plain_refusal(transport: asyncio.Transport, host: str) -> None:
    """A peer sent RPC frames without a handshake: an AuthError reply, then the close."""
    log.warning("refused an RPC connection without a credential")
    exc = AuthError(
        f"the master at {host} requires a credential: set KVPOOL_SECRET_FILE (or "
        "KVPOOL_SECRET) to this cluster's secret"
    )
    _close_after(transport, MASTER_REPLY_CODEC.encode(error_reply(exc)))


def no_secret_refusal(transport: asyncio.Transport) -> None:
    """A peer started a handshake with a master that has no secret."""
    _close_after(
        transport,
        refusal(
            "this master has no secret configured (started without --secret_file/"
            "KVPOOL_SECRET_FILE): configure it on the master too, or unset it here"
        ),
    )


class Owners:
    """Which open connection owns which id (the event loop's thread only).

    Rules, checked before any request reaches the service (:meth:`check`):

    - A connection that proved a node key (role ``node``) speaks only as that node, and
      only the node's own requests (register, add a segment, heartbeat, restore).
    - An id that owns storage (it registered as a node, or added a segment) belongs to
      the connection that did so while that connection is open: the same id from another
      connection cannot register, add segments, heartbeat or restore, so nobody can take
      over a live node and make the master drop its objects.  When the owner's connection
      closes (the node stopped, or reconnects), the id is free again.
    """

    def __init__(self) -> None:
        self._by_id: dict[str, object] = {}

    def check(self, conn: object, identity: Identity | None, request: object) -> AuthError | None:
        """The refusal of ``request`` from ``conn``, or None (and the binding it makes)."""
        client_id = getattr(request, "client_id", None)
        node_id = identity.client_id if identity is not None and identity.role == "node" else None
        as_node = node_id is not None
        if node_id is not None and (not isinstance(request, NODE_REQUESTS) or client_id != node_id):
            what = type(request).__name__
            other = client_id not in (None, node_id)
            return AuthError(
                f"node {node_id}'s credential may not send {what}"
                + (f" as {client_id}" if other else "")
            )
        if not isinstance(request, NODE_REQUESTS) or not isinstance(client_id, str):
            return None
        owner = self._by_id.get(client_id)
        if owner is not None and owner is not conn:
            return AuthError(
                f"{client_id} is a live node on another connection; an id cannot be taken "
                "over while its node is connected (use this node's own id)"
            )
        if as_node or isinstance(request, m.AddSegment):
            self._by_id[client_id] = conn
        return None

    def release(self, conn: object) -> None:
        """``conn`` closed: the ids it owned are free."""
        for client_id in [k for k, v in self._by_id.items() if v is conn]:
            del self._by_id[client_id]


class AuthProtocol(asyncio.Protocol):
    """One connection's handshake; ``admitted(transport, identity, rest)`` takes it over."""

    def __init__(
        self,
        credential: Credential,
        admitted: Callable[[asyncio.Transport, Identity, bytes], None],
        timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        self.side = ServerHandshake(credential, "master", ("client", "node", "tenant"))
        self.reader = FrameReader()
        self.admitted = admitted
        self.timeout_s = timeout_s
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._hello_done = False
        self._done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()

    def _expired(self) -> None:
        if not self._done and self.transport is not None:
            log.info("closing a connection: no handshake within %gs", self.timeout_s)
            self._done = True
            self.transport.abort()

    def _fail(self, reason: bytes, exc: KVPoolError) -> None:
        assert self.transport is not None
        log.warning("refused an RPC connection: %s", exc)
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
        self.transport.pause_reading()
        _close_after(self.transport, reason)

    def data_received(self, data: bytes) -> None:
        if self._done:
            return
        assert self.transport is not None
        self.reader.feed(data)
        try:
            while not self._done and (frame := self.reader.next_frame()) is not None:
                if not self._hello_done:
                    self._hello_done = True
                    reply = self.side.on_hello(frame)
                    if self.side.failure is not None:
                        self._fail(reply, self.side.failure)
                        return
                    self.transport.write(reply)
                    continue
                reply, identity = self.side.on_proof(frame)
                if identity is None:
                    assert self.side.failure is not None
                    self._fail(reply, self.side.failure)
                    return
                self.transport.write(reply)
                self._done = True
                if self._timer is not None:
                    self._timer.cancel()
                self.admitted(self.transport, identity, self.reader.rest())
        except ProtocolError as exc:
            self._fail(refusal(f"a broken handshake: {exc}"), exc)
