"""A rank's pull port (its ``kv_port``) as every transport runs it: all but how pages move.

P listens and answers decode connections' requests; D dials one bounded connection per P
rank, handshake included.  Anything but ``Pull``, ``PullDone``, ``Done`` and ``Refused`` is
answered ``Refused`` outside a pull.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from kvpool.config.kv_transfer import TRANSFER_CONNECTOR
from kvpool.connectors.pages import CacheSet, PagedCaches
from kvpool.connectors.transfer.transport import PeerUnreachable, PullHandler
from kvpool.datapath.framing import (
    BadRequest,
    deadline_after,
    recv_request,
    send_frame,
    tune_socket,
)
from kvpool.datapath.server import ThreadedServer
from kvpool.errors import ConfigError, KVPoolError, TransferError
from kvpool.protocol.codec import Codec
from kvpool.protocol.pull import Done, Pull, PullDone, Refused
from kvpool.security.admission import Admission
from kvpool.security.kv_port import decode_admission, open_to_prefill
from kvpool.security.peer import PeerSettings

__all__ = ["ACCEPT_POLL_S", "IDLE_S", "MovePages", "PortTransport", "PullPort"]

logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{TRANSFER_CONNECTOR}]"
#: how often the accept loop looks at the stop flag
ACCEPT_POLL_S = 0.5
#: a decode connection idle this long between requests is closed
IDLE_S = 60.0

#: A transport's own part of an admitted pull: move its pages over ``conn`` before
#: ``deadline``; the bytes moved, or ``None`` when D could not take them (then P sends no
#: ``Done`` and the pull is not served).  Raises KVPoolError when the stream broke.
MovePages = Callable[[socket.socket, Pull, float], int | None]


# A thread accepts on the rank's port; each decode connection gets a thread that opens
# with the credential handshake (kvpool.security.kv_port), then answers requests until the
# decode closes, idles IDLE_S, breaks the stream or P stops.  The transport's PullHandler
# admits or refuses each pull; the transport's own MovePages moves an admitted one's
# pages, and Done follows what it moved.  The peer settings' timeout bounds each exchange
# on P; D's dial takes the time left of its own connect bound.  The port carries no TLS
# (docs/security.md): settings with a TLS context are refused, never silently dropped.
class PullPort:
    """A rank's pull port: P listens on its ``kv_port``, D dials a P rank's."""

    def __init__(
        self,
        *,
        requests: Codec[Any],
        replies: Codec[Any],
        peer: PeerSettings,
        move: MovePages,
    ) -> None:
        if peer.tls is not None:
            raise ConfigError("kv_port: a pull port carries no TLS; pass peer settings without one")
        self._requests = requests
        self._replies = replies
        self._peer = peer
        self._move = move
        self.refused_auth = 0  # decode connections refused for their credential
        self._server: ThreadedServer | None = None

    def listen(self, host: str, port: int, handler: PullHandler) -> None:
        """Listen on ``host:port``; ``OSError`` when it cannot."""
        server = ThreadedServer(
            host,
            port,
            lambda conn, _identity: self._serve(conn, handler),
            name="kvpool-kv",
            backlog=None,
            accept_poll_s=ACCEPT_POLL_S,
            admission=self._admission if self._peer.credential is not None else None,
            on_refused=self._refused,
        )
        server.start()
        self._server = server

    def dial(self, host: str, port: int, timeout_s: float) -> socket.socket:
        """D's connection to the P rank on ``host:port``, bounded by ``timeout_s``, with the
        handshake when the settings carry a credential (proved as their ``client_id``);
        :class:`PeerUnreachable` when nothing answers."""
        if timeout_s <= 0:
            raise PeerUnreachable(f"no time left to connect to {host}:{port}")
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError:
            raise PeerUnreachable(f"connecting to prefill {host}:{port} timed out") from None
        except OSError as exc:
            raise PeerUnreachable(f"cannot connect to prefill {host}:{port}: {exc}") from None
        tune_socket(sock)
        credential = self._peer.credential
        if credential is not None:
            try:
                open_to_prefill(sock, credential, self._peer.client_id, timeout_s, f"{host}:{port}")
            except BaseException:
                sock.close()
                raise
        return sock

    def close(self) -> None:
        if self._server is not None:
            self._server.close(timeout_s=2 * ACCEPT_POLL_S)

    def _serve(self, conn: socket.socket, handler: PullHandler) -> None:
        # the server closes conn when this returns; its close() wakes a blocked recv
        assert self._server is not None
        tune_socket(conn)  # with a credential, the waiting room has run the handshake
        while not self._server.stopping:
            try:
                got = recv_request(conn, self._requests, self._peer.timeout_s, idle_timeout=IDLE_S)
                if got is None:
                    return
                deadline = deadline_after(self._peer.timeout_s)
                if isinstance(got, BadRequest):  # another version? say so, keep serving
                    self._reply(conn, Refused(f"bad request: {got.error}"), deadline)
                    continue
                message, _ = got
                if isinstance(message, Pull):
                    self._serve_pull(conn, message, handler, deadline)
                elif isinstance(message, PullDone):
                    reason = handler.done(message)
                    self._reply(conn, Refused(reason) if reason else Done(0), deadline)
                else:
                    name = type(message).__name__
                    self._reply(conn, Refused(f"{name} without a pull"), deadline)
            except KVPoolError as exc:
                logger.warning("%s dropping a decode connection: %s", _PREFIX, exc)
                return

    def _admission(self) -> Admission:
        assert self._server is not None and self._peer.credential is not None
        where = f"{self._server.host}:{self._server.port}"
        return decode_admission(self._peer.credential, where, self._replies)

    def _refused(self, reason: str) -> None:
        self.refused_auth += 1
        n = self.refused_auth
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            logger.warning("%s refused a decode connection (%d so far): %s", _PREFIX, n, reason)

    def _serve_pull(
        self, conn: socket.socket, pull: Pull, handler: PullHandler, deadline: float
    ) -> None:
        reason = handler.admit(pull, deadline)
        if reason is not None:
            self._reply(conn, Refused(reason), deadline)
            return
        total = self._move(conn, pull, deadline)
        if total is None:
            return
        self._reply(conn, Done(total), deadline)
        handler.served(pull, total)

    def _reply(self, conn: socket.socket, reply: Done | Refused, deadline: float) -> None:
        send_frame(conn, self._replies, reply, None, deadline)


class PortTransport:
    """What every transport shares around its :class:`PullPort`: P serves pulls only once
    the caches are registered, and the port counts refused credentials.  A transport
    makes the port with its codecs and its :data:`MovePages`, and registers the caches."""

    def __init__(
        self, peer: PeerSettings, requests: Codec[Any], replies: Codec[Any], move: MovePages
    ) -> None:
        self._port = PullPort(requests=requests, replies=replies, peer=peer, move=move)
        self._caches: PagedCaches | CacheSet | None = None

    @property
    def refused_auth(self) -> int:
        """Decode connections refused for their credential."""
        return self._port.refused_auth

    def serve(self, host: str, port: int, handler: PullHandler) -> None:
        if self._caches is None:
            raise TransferError("KV caches are not registered yet")
        self._port.listen(host, port, handler)

    def close(self) -> None:
        self._port.close()
