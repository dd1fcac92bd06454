"""kvpool's TCP transport for P→D pulls: the default :class:`~.transport.KVTransport`.

Pages ride the pull connection itself: P ``sendall``s each layer's page slices straight
from its KV caches, D ``recv_into``s them straight into its own.  No staging copy, as one
page slice is contiguous in both caches (device caches go through host staging).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from kvpool.closing import Closing
from kvpool.connectors.pages import CacheSet, PagedCaches
from kvpool.connectors.transfer.pull_port import PortTransport
from kvpool.datapath.framing import recv_exactly_into, recv_frame, send_frame
from kvpool.errors import PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.pull import (
    PULL_REPLY_CODEC,
    PULL_REQUEST_CODEC,
    Done,
    Layer,
    Pull,
    PullDone,
    Refused,
)
from kvpool.security.peer import PeerSettings

__all__ = ["TcpPullLink", "TcpPullTransport"]


class TcpPullTransport(PortTransport):
    """P→D pulls over plain TCP sockets, one thread per decode connection on P (not the
    data plane's :class:`kvpool.datapath.transport.TcpTransport`)."""

    name = "tcp"

    def __init__(self, peer: PeerSettings) -> None:
        # with a credential every connection opens with the handshake (.pull_port)
        super().__init__(peer, PULL_REQUEST_CODEC, PULL_REPLY_CODEC, self._send_pages)

    def register(self, caches: PagedCaches | CacheSet) -> None:
        self._caches = caches

    # -- D ---------------------------------------------------------------------------

    def connect(self, host: str, port: int, timeout_s: float) -> TcpPullLink:
        if self._caches is None:
            raise TransferError("KV caches are not registered yet")
        sock = self._port.dial(host, port, timeout_s)
        return TcpPullLink(sock, self._caches)

    # -- P ---------------------------------------------------------------------------

    def _send_pages(self, conn: socket.socket, pull: Pull, deadline: float) -> int:
        """P's side of an admitted pull: each layer's header, then its page slices."""
        assert self._caches is not None
        caches = self._caches.of(pull.layers)  # the pull's KV cache group (admitted)
        page_bytes = pull.head_count * caches.head_bytes
        layer_bytes = page_bytes * len(pull.block_ids)
        for index, name in enumerate(pull.layers):
            header = PULL_REPLY_CODEC.encode(Layer(index, page_bytes), layer_bytes)
            _send_all(conn, header, deadline)
            for view in caches.sending(name, pull.block_ids, pull.head_start, pull.head_count):
                _send_all(conn, view, deadline)
        return layer_bytes * len(pull.layers)


class TcpPullLink(Closing):
    """One D → P connection; a context manager that closes the socket."""

    def __init__(self, sock: socket.socket, caches: PagedCaches | CacheSet) -> None:
        self._sock = sock
        self._caches = caches

    def close(self) -> None:
        self._sock.close()

    def pull(self, pull: Pull, block_ids: Sequence[int], dst_start: int, deadline: float) -> int:
        sock, caches = self._sock, self._caches.of(pull.layers)
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
