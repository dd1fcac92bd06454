"""The segment data server and its blocking TCP client.

:class:`SegmentServer` serves :mod:`kvpool.protocol.data` requests against the
segments a node holds.  One thread per connection with blocking sockets: in CPython
the fastest way to move large buffers, because ``recv_into`` / ``sendall`` run whole
multi-megabyte transfers with the GIL released, where an event loop would wake per chunk.

- A write's payload is received with ``recv_into`` straight into the segment's memory;
  a read is sent with ``sendall`` of a view of the segment.  No copy in Python.
- A refused write (unknown segment, out of range) still drains its payload, then
  replies :class:`~kvpool.protocol.data.Error`; the connection stays usable.
- A frame whose body does not decode (unknown tag) gets an ``Error`` reply and the
  connection goes on; a bad header (magic, oversized) gets an ``Error`` and the
  connection is closed.  Either way only that connection is affected.
- Once a request has started, every wait is bounded by ``timeout_s`` (see
  :class:`~kvpool.transfer.channel.Channel`); a client that vanishes mid-payload only ends
  its own connection thread.

:class:`SegmentConnection` is the client side: ``write`` / ``read_into`` a caller
buffer (bytes-like, NumPy, CPU tensor) at ``(segment_id, offset)``.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from kvpool.errors import (
    ChecksumMismatch,
    KVPoolError,
    ObjectNotFound,
    PeerTimeout,
    ProtocolError,
    TransferError,
    UnknownSegment,
)
from kvpool.protocol.codec import Codec
from kvpool.protocol.data import (
    DataReply,
    DataRequest,
    Error,
    Ok,
    SegmentInfo,
    SegmentInfoReply,
    SegmentRead,
    SegmentWrite,
    SsdRead,
    error_reply,
)
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.storage.segment import Segment
from kvpool.storage.ssd import SsdStore
from kvpool.transfer import wire
from kvpool.transfer.channel import Channel
from kvpool.transfer.wire import BadRequest

__all__ = [
    "PIPELINE_DEPTH",
    "REPLY_CODEC",
    "REQUEST_CODEC",
    "SegmentConnection",
    "SegmentServer",
    "ServerStats",
]

log = logging.getLogger(__name__)

REQUEST_CODEC: Codec[DataRequest] = Codec(DataRequest)
REPLY_CODEC: Codec[DataReply] = Codec(DataReply)
_ACCEPT_POLL_S = 0.2
# Requests in flight per pipelined batch (write_many / read_many_into).
PIPELINE_DEPTH = 64


@dataclass
class ServerStats:
    """Counters since start (monotonic, for metrics).  Read freely; update with :meth:`add`
    (connection threads update concurrently, and ``+=`` on an attribute is not atomic)."""

    connections: int = 0
    requests: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    error_replies: int = 0
    protocol_errors: int = 0
    dropped_connections: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)


class SegmentServer:
    """Serves reads and writes of registered segments over TCP.

    ``host_token`` and each segment's shared-memory name are advertised through
    ``SegmentInfo`` so same-host clients can bypass TCP (see :mod:`kvpool.transfer.path`).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_s: float = 10.0,
        idle_timeout_s: float | None = None,
        host_token: str = "",
        ssd: SsdStore | None = None,
    ) -> None:
        self.host = host
        self.ssd = ssd
        self.port = port
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.host_token = host_token
        self.stats = ServerStats()
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._stopping = threading.Event()

    # -- segments ---------------------------------------------------------------

    def add_segment(self, segment_id: str, segment: Segment) -> None:
        """Serve ``segment`` under ``segment_id`` (replacing any previous one)."""
        with self._lock:
            self._segments[segment_id] = segment

    def remove_segment(self, segment_id: str) -> Segment | None:
        """Stop serving ``segment_id``; the caller closes the returned segment."""
        with self._lock:
            return self._segments.pop(segment_id, None)

    def _segment(self, segment_id: str) -> Segment:
        with self._lock:
            segment = self._segments.get(segment_id)
        if segment is None:
            raise UnknownSegment(f"segment {segment_id!r} is not served here")
        return segment

    # -- lifecycle --------------------------------------------------------------

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound (the port is chosen when 0 was asked)."""
        return self.host, self.port

    def start(self) -> tuple[str, int]:
        """Bind, listen, and start accepting; returns the bound address."""
        listener = socket.create_server((self.host, self.port), backlog=128)
        listener.settimeout(_ACCEPT_POLL_S)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kvpool-data-accept:{self.port}", daemon=True
        )
        self._accept_thread.start()
        return self.address

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection, and wait (bounded) for their threads."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout_s)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        for _, thread in conns:
            thread.join(timeout_s)

    def __enter__(self) -> SegmentServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            wire.tune_socket(conn)
            _keepalive(conn)
            thread = threading.Thread(
                target=self._serve_connection, args=(conn,), name="kvpool-data-conn", daemon=True
            )
            with self._lock:
                self._conns[conn] = thread
                self.stats.add("connections")
            thread.start()

    # -- one connection ---------------------------------------------------------

    def _serve_connection(self, conn: socket.socket) -> None:
        channel: Channel[DataReply, DataRequest] = Channel(
            conn, REPLY_CODEC, REQUEST_CODEC, self.timeout_s
        )
        try:
            while not self._stopping.is_set() and self._serve_one(channel):
                pass
        except ProtocolError as exc:
            # Bad header: the stream cannot be resynchronised.  Say why, then close.
            self.stats.add("protocol_errors")
            log.warning("closing data connection after a malformed frame: %s", exc)
            with contextlib.suppress(KVPoolError):
                self._reply(channel, error_reply(exc))
        except (TransferError, PeerTimeout) as exc:
            self.stats.add("dropped_connections")
            log.info("data connection ended: %s", exc)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _reply(
        self,
        channel: Channel[DataReply, DataRequest],
        reply: DataReply,
        payload: memoryview | None = None,
    ) -> None:
        if isinstance(reply, Error):
            self.stats.add("error_replies")
        channel.send(reply, payload)

    def _serve_one(self, channel: Channel[DataReply, DataRequest]) -> bool:
        """Handle one request; ``False`` when the peer closed cleanly."""
        got = channel.recv_request(self.idle_timeout_s)
        if got is None:
            return False
        if isinstance(got, BadRequest):
            self.stats.add("protocol_errors")
            self._reply(channel, error_reply(got.error))
            return True
        request, payload_length = got
        self.stats.add("requests")
        try:
            reply, payload = self._handle(channel, request, payload_length)
        except ChecksumMismatch as exc:  # a corrupt SSD object: a miss, not a broken link
            self._reply(channel, error_reply(exc))
            return True
        except (TransferError, PeerTimeout):
            raise
        except KVPoolError as exc:
            self._reply(channel, error_reply(exc))
            return True
        self._reply(channel, reply, payload)
        return True

    def _handle(
        self, channel: Channel[DataReply, DataRequest], request: DataRequest, payload_length: int
    ) -> tuple[DataReply, memoryview | None]:
        expected = request.length if isinstance(request, SegmentWrite) else 0
        if payload_length != expected:
            channel.discard_payload(payload_length)
            raise ProtocolError(
                f"{type(request).__name__} declares {expected} payload bytes, "
                f"frame carries {payload_length}"
            )
        if isinstance(request, SegmentWrite):
            try:
                target = self._segment(request.segment_id).view(request.offset, request.length)
            except KVPoolError:
                channel.discard_payload(payload_length)
                raise
            channel.recv_payload_into(target)  # straight into the segment's memory
            self.stats.add("bytes_written", request.length)
            return Ok(), None
        if isinstance(request, SegmentRead):
            source = self._segment(request.segment_id).view(request.offset, request.length)
            self.stats.add("bytes_read", request.length)
            return Ok(request.length), source
        if isinstance(request, SsdRead):
            return self._ssd_read(request)
        segment = self._segment(request.segment_id)
        info = SegmentInfoReply(request.segment_id, segment.size, segment.name, self.host_token)
        return info, None

    def _ssd_read(self, request: SsdRead) -> tuple[DataReply, memoryview | None]:
        """An SSD object into a fresh buffer (the file is checked before anything is
        sent, so a corrupt object is an error reply, never a payload)."""
        if self.ssd is None:
            raise ObjectNotFound(f"{request.key}: this node has no SSD tier")
        size = self.ssd.value_size(request.key)
        if size != request.length:
            raise ObjectNotFound(
                f"{request.key} on SSD has {size} bytes, the request expects {request.length}"
            )
        buf = memoryview(bytearray(size))
        self.ssd.read_into(request.key, buf)
        self.stats.add("bytes_read", size)
        return Ok(size), buf


def _keepalive(conn: socket.socket) -> None:
    """Let the kernel find clients that vanished without a FIN (host down, partition):
    an idle connection waits without a timeout, so without this it would wait forever."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux names; other systems keep their defaults
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


class SegmentConnection:
    """A blocking client connection to one :class:`SegmentServer`.

    Connects on first use (and again after a failed exchange).  Calls are serialised;
    use one connection per thread for parallel transfers.  Every call finishes within
    ``timeout_s`` or raises :class:`~kvpool.errors.PeerTimeout`; a dead peer raises
    :class:`~kvpool.errors.TransferError`; a refusal by the server raises the error it
    reported (e.g. :class:`~kvpool.errors.UnknownSegment`).
    """

    def __init__(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self._channel: Channel[DataRequest, DataReply] | None = None
        self._lock = threading.Lock()

    def connect(self) -> None:
        """Open the connection now (otherwise the first call does)."""
        with self._lock:
            self._connected()

    def _connected(self) -> Channel[DataRequest, DataReply]:
        if self._channel is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            except TimeoutError:
                raise PeerTimeout(f"connecting to {self.host}:{self.port} timed out") from None
            except OSError as exc:
                raise TransferError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
            wire.tune_socket(sock)
            self._channel = Channel(sock, REQUEST_CODEC, REPLY_CODEC, self.timeout_s)
        return self._channel

    def _exchange(
        self, request: DataRequest, out: memoryview | None, into: memoryview | None
    ) -> DataReply:
        """Send ``request`` (+ ``out``), receive the reply (+ its payload into ``into``)."""
        with self._lock:
            channel = self._connected()
            try:
                deadline = wire.deadline_after(self.timeout_s)
                channel.send(request, out)
                reply, length = channel.recv(deadline)
                if length:
                    if into is None or length != len(into):
                        raise ProtocolError(
                            f"reply carries {length} payload bytes, expected "
                            f"{0 if into is None else len(into)}"
                        )
                    channel.recv_payload_into(into, deadline)
            except KVPoolError:
                # The stream may be mid-frame: never reuse it.
                self._drop()
                raise
        if isinstance(reply, Error):
            raise reply.to_exception()
        return reply

    def write(self, segment_id: str, offset: int, buffer: Any) -> int:
        """Write ``buffer`` at ``offset`` of the segment; returns the bytes written."""
        src = byte_view(buffer)
        self._exchange(SegmentWrite(segment_id, offset, len(src)), src, None)
        return len(src)

    def read_into(self, segment_id: str, offset: int, buffer: Any) -> int:
        """Fill ``buffer`` from ``offset`` of the segment; returns the bytes read."""
        dst = writable_byte_view(buffer)
        reply = self._exchange(SegmentRead(segment_id, offset, len(dst)), None, dst)
        if not isinstance(reply, Ok) or reply.length != len(dst):
            self.close()
            raise ProtocolError(f"unexpected reply to a segment read: {reply!r}")
        return len(dst)

    def write_many(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | None]:
        """Pipelined :meth:`write` of ``(segment_id, offset, buffer)`` items.

        Requests go out back to back and the replies are read afterwards, so many small
        values cost one round trip per :data:`PIPELINE_DEPTH` items instead of one each.
        Returns one entry per item: ``None`` or the error the node refused it with (the
        other items still happen).  A broken connection raises for the whole batch.
        """
        views = [byte_view(buffer) for _, _, buffer in items]
        requests = [SegmentWrite(s, o, len(v)) for (s, o, _), v in zip(items, views, strict=True)]
        return self._pipeline(requests, views, [None] * len(items))

    def read_many_into(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | None]:
        """Pipelined :meth:`read_into` of ``(segment_id, offset, buffer)`` items; see
        :meth:`write_many` for the results."""
        views = [writable_byte_view(buffer) for _, _, buffer in items]
        requests = [SegmentRead(s, o, len(v)) for (s, o, _), v in zip(items, views, strict=True)]
        return self._pipeline(requests, [None] * len(items), views)

    def _pipeline(
        self,
        requests: Sequence[DataRequest],
        outs: Sequence[memoryview | None],
        intos: Sequence[memoryview | None],
    ) -> list[KVPoolError | None]:
        # No deadlock: one direction of each window is small (write replies, read
        # requests: tens of bytes each), so it always fits in the socket buffers while
        # the other direction streams.
        results: list[KVPoolError | None] = []
        with self._lock:
            channel = self._connected()
            try:
                for start in range(0, len(requests), PIPELINE_DEPTH):
                    window = range(start, min(start + PIPELINE_DEPTH, len(requests)))
                    for i in window:
                        channel.send(requests[i], outs[i])
                    for i in window:
                        reply, length = channel.recv(wire.deadline_after(self.timeout_s))
                        into = intos[i]
                        expected = 0 if into is None or isinstance(reply, Error) else len(into)
                        if length != expected or not isinstance(reply, Ok | Error):
                            raise ProtocolError(f"unexpected reply in a pipeline: {reply!r}")
                        if into is not None and length:
                            channel.recv_payload_into(into)
                        results.append(reply.to_exception() if isinstance(reply, Error) else None)
            except KVPoolError:
                self._drop()
                raise
        return results

    def read(self, segment_id: str, offset: int, length: int) -> bytes:
        """A copy of ``length`` bytes at ``offset`` of the segment."""
        buf = bytearray(length)
        self.read_into(segment_id, offset, buf)
        return bytes(buf)

    def ssd_read_into(self, key: str, buffer: Any) -> int:
        """Fill ``buffer`` (exactly the object's size) from the node's SSD tier."""
        dst = writable_byte_view(buffer)
        reply = self._exchange(SsdRead(key, len(dst)), None, dst)
        if not isinstance(reply, Ok) or reply.length != len(dst):
            self.close()
            raise ProtocolError(f"unexpected reply to an SSD read: {reply!r}")
        return len(dst)

    def info(self, segment_id: str) -> SegmentInfoReply:
        """The segment's size, shared-memory name and host token."""
        reply = self._exchange(SegmentInfo(segment_id), None, None)
        if not isinstance(reply, SegmentInfoReply):
            self.close()
            raise ProtocolError(f"unexpected reply to SegmentInfo: {reply!r}")
        return reply

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> SegmentConnection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
