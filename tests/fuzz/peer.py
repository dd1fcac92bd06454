"""A hostile peer: send bytes to a server, then see what it does, within a bound.

:func:`send_and_close` sends a frame and half-closes (the server reads EOF), so every
server must answer what it can and close within :data:`BOUND_S`; a server still holding
the connection after that is hung.  :func:`send_and_read` keeps the connection open and
reads frames until one comes back or the bound passes (for frames that are complete, where
a reply is due).  Both connect over TCP or to a Unix socket path.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvpool.errors import ProtocolError
from kvpool.protocol.codec import MAGIC, Codec, FrameDecoder

__all__ = [
    "BOUND_S",
    "Failures",
    "Outcome",
    "connect",
    "decode_replies",
    "send_and_close",
    "send_and_read",
]

#: how long a server may take to answer or close; generous for a loaded 2-core machine,
#: and a correct server takes milliseconds
BOUND_S = 10.0


@dataclass(frozen=True)
class Outcome:
    """What came back: the bytes, and whether the server closed within the bound."""

    received: bytes
    closed: bool


def connect(address: tuple[str, int] | str) -> socket.socket:
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(BOUND_S)
        sock.connect(address)
        return sock
    return socket.create_connection(address, timeout=BOUND_S)


def _send(sock: socket.socket, data: bytes) -> None:
    # the server may close early (a bad header): that is an allowed answer
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        sock.sendall(data)


def _received(sock: socket.socket) -> Iterator[bytes | None]:
    """What ``sock`` receives within :data:`BOUND_S`, chunk by chunk; a last ``None`` when
    the server closed (or reset) the connection, nothing more when the time ran out."""
    deadline = time.monotonic() + BOUND_S
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            yield None
            return
        yield chunk


def send_and_close(address: tuple[str, int] | str, data: bytes) -> Outcome:
    """Send ``data``, half-close, and read until EOF (at most :data:`BOUND_S`)."""
    with connect(address) as sock:
        _send(sock, data)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return Outcome(b"", True)
        received = bytearray()
        for chunk in _received(sock):
            if chunk is None:
                return Outcome(bytes(received), True)
            received += chunk
        return Outcome(bytes(received), False)


def send_and_read(
    address: tuple[str, int] | str,
    data: bytes,
    codec: Codec[Any],
    *,
    until_close: bool = False,
    want: int = 1,
) -> tuple[list[Any], bool]:
    """Send ``data`` and keep the connection open; return the reply frames (decoded) and
    whether the server closed.  Reads until ``want`` replies came, or with ``until_close``
    until the server closes (both at most :data:`BOUND_S`).  A malformed reply raises."""
    with connect(address) as sock:
        _send(sock, data)
        decoder: FrameDecoder[Any] = FrameDecoder(codec)
        replies: list[Any] = []
        for chunk in _received(sock):
            if chunk is None:
                return replies, True
            decoder.feed(chunk)
            replies += [f.message for f in decoder.frames()]
            if len(replies) >= want and not until_close:
                return replies, False
        return replies, False


class Failures(logging.Handler):
    """Collects a server's error records: 'connection handler failed' is a handler's crash."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    @classmethod
    @contextlib.contextmanager
    def of(cls, logger: str) -> Iterator[Failures]:
        """Collect ``logger``'s errors while the block runs."""
        handler = cls()
        target = logging.getLogger(logger)
        target.addHandler(handler)
        try:
            yield handler
        finally:
            target.removeHandler(handler)


def decode_replies(received: bytes, codec: Codec[Any]) -> list[Any]:
    """Every reply frame in ``received``; raises :class:`ProtocolError` on a malformed one
    (a server must never send a broken frame) and AssertionError on trailing bytes."""
    decoder: FrameDecoder[Any] = FrameDecoder(codec)
    decoder.feed(received)
    messages = [f.message for f in decoder.frames()]
    if decoder.buffered:
        raise ProtocolError(f"{decoder.buffered} bytes of a partial reply frame")
    return messages


def is_rpc(data: bytes) -> bool:
    """Whether the master's first-bytes sniffer takes ``data`` for RPC (else HTTP)."""
    return data.startswith(MAGIC)
