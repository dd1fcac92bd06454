"""kvpool's TCP transport for P→D pulls: the default :class:`~.transport.KVTransport`.

P: a thread accepts on the rank's port; each decode connection gets a thread that reads
requests (:mod:`kvpool.protocol.pull`) and answers them as the :class:`~.transport.PullHandler`
decides, sending page slices straight from the KV caches with ``sendall`` of a
memoryview.  D: one connection per pull, page slices received with ``recv_into`` straight
into the KV caches.  No staging copy on either side: one page slice is contiguous in both
caches (caches in device memory are copied through host staging, one layer of a pull at a
time: :mod:`kvpool.connectors.device_pages`).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Sequence

from kvpool.closing import Closing
from kvpool.config.kv_transfer import TRANSFER_CONNECTOR
from kvpool.connectors.pages import PagedCaches
from kvpool.connectors.transfer.auth import admit_decode, open_to_prefill
from kvpool.connectors.transfer.transport import PeerUnreachable, PullHandler
from kvpool.core.credentials import Credential
from kvpool.errors import KVPoolError, PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.pull import (
    PULL_REPLY_CODEC,
    PULL_REQUEST_CODEC,
    Done,
    Layer,
    Pull,
    PullDone,
    Refused,
)
from kvpool.transfer.framing import (
    BadRequest,
    deadline_after,
    recv_exactly_into,
    recv_frame,
    recv_request,
    send_frame,
    tune_socket,
)
from kvpool.transfer.server import ThreadedServer

__all__ = ["TcpLink", "TcpTransport"]

logger = logging.getLogger("vllm.kvpool.transfer")
_PREFIX = f"[{TRANSFER_CONNECTOR}]"
_ACCEPT_POLL_S = 0.5  # how often the accept loop looks at the stop flag
_IDLE_S = 60.0  # a decode connection idle this long between requests is closed


class TcpTransport:
    """Pulls over plain TCP sockets, one thread per decode connection on P."""

    name = "tcp"

    def __init__(
        self,
        *,
        transfer_timeout_s: float,
        credential: Credential | None = None,
        client_id: str = "decode",
    ) -> None:
        self._timeout_s = transfer_timeout_s
        # with a credential every connection opens with the handshake (.auth)
        self._credential = credential
        self._client_id = client_id
        self.refused_auth = 0  # decode connections refused for their credential
        self._caches: PagedCaches | None = None
        self._server: ThreadedServer | None = None

    def register(self, caches: PagedCaches) -> None:
        self._caches = caches

    def close(self) -> None:
        if self._server is not None:
            self._server.close(timeout_s=2 * _ACCEPT_POLL_S)

    # -- D ---------------------------------------------------------------------------

    def connect(self, host: str, port: int, timeout_s: float) -> TcpLink:
        if self._caches is None:
            raise TransferError("KV caches are not registered yet")
        if timeout_s <= 0:
            raise PeerUnreachable(f"no time left to connect to {host}:{port}")
        try:
            sock = socket.create_connection((host, port), timeout=timeout_s)
        except TimeoutError:
            raise PeerUnreachable(f"connecting to prefill {host}:{port} timed out") from None
        except OSError as exc:
            raise PeerUnreachable(f"cannot connect to prefill {host}:{port}: {exc}") from None
        tune_socket(sock)
        if self._credential is not None:
            try:
                open_to_prefill(
                    sock, self._credential, self._client_id, timeout_s, f"{host}:{port}"
                )
            except BaseException:
                sock.close()
                raise
        return TcpLink(sock, self._caches)

    # -- P ---------------------------------------------------------------------------

    def serve(self, host: str, port: int, handler: PullHandler) -> None:
        if self._caches is None:
            raise TransferError("KV caches are not registered yet")
        server = ThreadedServer(
            host,
            port,
            lambda conn: self._serve(conn, handler),
            name="kvpool-kv",
            backlog=None,
            accept_poll_s=_ACCEPT_POLL_S,
        )
        server.start()
        self._server = server

    def _serve(self, conn: socket.socket, handler: PullHandler) -> None:
        # the server closes conn when this returns; its close() wakes a blocked recv
        assert self._server is not None
        tune_socket(conn)
        if self._credential is not None and not self._admitted(conn):
            return
        while not self._server.stopping:
            try:
                got = recv_request(conn, PULL_REQUEST_CODEC, self._timeout_s, idle_timeout=_IDLE_S)
                if got is None:
                    return
                deadline = deadline_after(self._timeout_s)
                if isinstance(got, BadRequest):  # another version? say so, keep serving
                    _reply(conn, Refused(f"bad request: {got.error}"), deadline)
                    continue
                message, _ = got
                if isinstance(message, Pull):
                    self._serve_pull(conn, message, handler, deadline)
                else:
                    reason = handler.done(message)
                    _reply(conn, Refused(reason) if reason else Done(0), deadline)
            except KVPoolError as exc:
                logger.warning("%s dropping a decode connection: %s", _PREFIX, exc)
                return

    def _admitted(self, conn: socket.socket) -> bool:
        assert self._server is not None and self._credential is not None
        where = f"{self._server.host}:{self._server.port}"
        refused = admit_decode(conn, self._credential, where, self._timeout_s, PULL_REPLY_CODEC)
        if refused is not None:
            self.refused_auth += 1
            logger.warning("%s refused a decode connection: %s", _PREFIX, refused)
        return refused is None

    def _serve_pull(
        self, conn: socket.socket, pull: Pull, handler: PullHandler, deadline: float
    ) -> None:
        caches = self._caches
        assert caches is not None
        reason = handler.admit(pull, deadline)
        if reason is not None:
            _reply(conn, Refused(reason), deadline)
            return
        page_bytes = pull.head_count * caches.head_bytes
        layer_bytes = page_bytes * len(pull.block_ids)
        for index, name in enumerate(pull.layers):
            header = PULL_REPLY_CODEC.encode(Layer(index, page_bytes), layer_bytes)
            _send_all(conn, header, deadline)
            for view in caches.sending(name, pull.block_ids, pull.head_start, pull.head_count):
                _send_all(conn, view, deadline)
        total = layer_bytes * len(pull.layers)
        _reply(conn, Done(total), deadline)
        handler.served(pull, total)


class TcpLink(Closing):
    """One D → P connection; a context manager that closes the socket."""

    def __init__(self, sock: socket.socket, caches: PagedCaches) -> None:
        self._sock = sock
        self._caches = caches

    def close(self) -> None:
        self._sock.close()

    def pull(self, pull: Pull, block_ids: Sequence[int], dst_start: int, deadline: float) -> int:
        sock, caches = self._sock, self._caches
        send_frame(sock, PULL_REQUEST_CODEC, pull, None, deadline)
        total = 0
        for index, name in enumerate(pull.layers):
            reply, payload = recv_frame(sock, PULL_REPLY_CODEC, deadline)
            _expect_layer(reply, payload, index, pull.page_bytes, len(block_ids))
            with caches.receiving(name, block_ids, dst_start, pull.head_count) as views:
                for view in views:
                    recv_exactly_into(sock, view, deadline, "KV pages")
            total += payload
        reply, _ = recv_frame(sock, PULL_REPLY_CODEC, deadline)
        if not isinstance(reply, Done):
            raise ProtocolError(f"expected the end of the transfer, got {reply!r}")
        return total

    def done(self, message: PullDone, deadline: float) -> None:
        send_frame(self._sock, PULL_REQUEST_CODEC, message, None, deadline)
        recv_frame(self._sock, PULL_REPLY_CODEC, deadline)


def _reply(conn: socket.socket, reply: Done | Refused, deadline: float) -> None:
    send_frame(conn, PULL_REPLY_CODEC, reply, None, deadline)


def _send_all(sock: socket.socket, data: bytes | memoryview, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout("timed out sending KV pages")
    sock.settimeout(left)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise PeerTimeout("timed out sending KV pages: the decode stopped reading") from None
    except OSError as exc:
        raise TransferError(f"connection to the decode failed: {exc}") from None


def _expect_layer(reply: object, payload: int, index: int, page_bytes: int, blocks: int) -> None:
    if isinstance(reply, Refused):
        raise TransferError(f"prefill refused: {reply.reason}")
    if not isinstance(reply, Layer) or reply.index != index:
        raise ProtocolError(f"expected layer {index}, got {reply!r}")
    if reply.page_bytes != page_bytes or payload != page_bytes * blocks:
        raise ProtocolError(
            f"layer {index}: {payload} bytes of {reply.page_bytes}-byte pages, "
            f"expected {blocks} pages of {page_bytes}"
        )
