"""The blocking TCP client of a segment data server: runs lists of data-path operations on a
node's segments and SSD tier, pipelined in ranged requests, receiving replies' payloads
straight into the caller's buffers.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence

from kvpool.closing import Closing
from kvpool.datapath import framing
from kvpool.datapath.channel import Channel, reply_spin_us
from kvpool.datapath.data_ops import DataOp, OpResult, ReadOp, SsdReadOp, WriteOp
from kvpool.errors import (
    AuthError,
    KVPoolError,
    Overloaded,
    PeerTimeout,
    ProtocolError,
    TransferError,
)
from kvpool.protocol.data import (
    DATA_REPLY_CODEC,
    DATA_REQUEST_CODEC,
    DataReply,
    DataRequest,
    Error,
    Ok,
    SegmentDemote,
    SegmentInfo,
    SegmentInfoReply,
    SegmentRead,
    SegmentReadMany,
    SegmentWrite,
    SegmentWriteMany,
    SsdRead,
    SsdRemove,
)
from kvpool.security.peer import PLAIN_PEER, PeerSettings
from kvpool.security.socket_auth import authenticate
from kvpool.security.socket_tls import wrap_client
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.storage.checksum import hasher

__all__ = ["PIPELINE_DEPTH", "SegmentConnection"]

# Requests in flight per pipelined batch (a list's writes or reads), and values per
# ranged request (one sendmsg gathers them: well under the kernel's 1024 iovecs).
PIPELINE_DEPTH = 64
# Bytes per ranged request: a window's frame stays far below the codec's payload limit.
WINDOW_BYTES = 256 << 20
# A connection unused this long is checked before reuse: the server closes idle ones.
_REUSE_CHECK_S = 1.0


class SegmentConnection(Closing):
    """A blocking client connection to one :class:`SegmentServer`.

    Connects on first use (and again after a failed exchange).  Calls are serialised;
    use one connection per thread for parallel transfers.  Every call finishes within
    ``peer.timeout_s`` or raises :class:`~kvpool.errors.PeerTimeout`; a dead peer raises
    :class:`~kvpool.errors.TransferError`; a refusal by the server raises the error it
    reported (e.g. :class:`~kvpool.errors.UnknownSegment`), except in :meth:`run`, where
    it is that op's result.  With ``peer.credential``, each new connection first proves
    it (role ``data``, as ``peer.client_id``) and checks the node's proof: a refusal
    raises :class:`~kvpool.errors.AuthError`.
    """

    def __init__(self, host: str, port: int, peer: PeerSettings = PLAIN_PEER) -> None:
        self.peer = peer
        self.host = host
        self.port = port
        self._channel: Channel[DataRequest, DataReply] | None = None
        self._lock = threading.Lock()
        self._used = 0.0  # monotonic time of the last exchange
        self.spin_us = reply_spin_us()

    def connect(self) -> None:
        """Open the connection now (otherwise the first call does)."""
        with self._lock:
            self._connected()

    def _connected(self) -> Channel[DataRequest, DataReply]:
        now = time.monotonic()
        idle = now - self._used > _REUSE_CHECK_S
        if self._channel is not None and idle and _closed_by_peer(self._channel.sock):
            self._drop()  # quiet too long: the server let go of it
        self._used = now
        if self._channel is None:
            peer, timeout_s = self.peer, self.peer.timeout_s
            try:
                sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
            except TimeoutError:
                raise PeerTimeout(f"connecting to {self.host}:{self.port} timed out") from None
            except OSError as exc:
                raise TransferError(f"cannot connect to {self.host}:{self.port}: {exc}") from None
            framing.tune_socket(sock)
            where = f"data server {self.host}:{self.port}"
            if peer.tls is not None:
                sock = wrap_client(sock, peer.tls, self.host, timeout_s, where)
            if peer.credential is not None:
                try:
                    authenticate(sock, peer.credential, "data", peer.client_id, timeout_s, where)
                except BaseException:
                    sock.close()
                    raise
            self._channel = Channel(
                sock, DATA_REQUEST_CODEC, DATA_REPLY_CODEC, timeout_s, spin_us=self.spin_us
            )
        return self._channel

    def _exchange(
        self,
        request: DataRequest,
        out: memoryview | None,
        into: memoryview | None,
        on_bytes: Callable[[memoryview], object] | None = None,
    ) -> DataReply:
        """Send ``request`` (+ ``out``), receive the reply (+ its payload into ``into``).
        The node's refusal is returned (an :class:`Error`), a broken exchange raised."""
        with self._lock:
            channel = self._connected()
            try:
                deadline = framing.deadline_after(self.peer.timeout_s)
                channel.send(request, out)
                reply, length = channel.recv(deadline, reply=True)
                if length:
                    if into is None or length != len(into):
                        raise ProtocolError(
                            f"reply carries {length} payload bytes, expected "
                            f"{0 if into is None else len(into)}"
                        )
                    channel.recv_payload_into(into, deadline, on_bytes)
            except KVPoolError:
                # The stream may be mid-frame: never reuse it.
                self._drop()
                raise
        if isinstance(reply, Error) and reply.code in (Overloaded.code, AuthError.code):
            self.close()  # refused (at its limit, or unauthenticated): the server closes
        return reply

    def _call(self, request: DataRequest) -> DataReply:
        """:meth:`_exchange` without payloads, the node's refusal raised."""
        reply = self._exchange(request, None, None)
        if isinstance(reply, Error):
            raise reply.to_exception()
        return reply

    def _moved(self, reply: DataReply, length: int, what: str) -> None:
        """Check a read's reply: Ok with ``length`` bytes, or the stream is not trusted."""
        if not isinstance(reply, Ok) or reply.length != length:
            self.close()
            raise ProtocolError(f"unexpected reply to {what}: {reply!r}")

    # -- the data path's operations (kvpool.datapath.data_ops) ---------------------

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        """The ops over this connection, with the results and raises of
        :mod:`kvpool.datapath.data_ops`.  One op is one request; the writes of a list
        (noted ones apart), its reads and its checked reads each go as one pipelined
        batch (:meth:`_batch`); an SSD read is one request each."""
        if len(ops) == 1:
            return _update_running(ops, [self._one(ops[0])])
        results: list[OpResult] = [None] * len(ops)
        writes: dict[bool, tuple[list[int], list[WriteOp]]] = {}  # by noted
        reads: dict[bool, tuple[list[int], list[ReadOp]]] = {}  # by checked
        for i, op in enumerate(ops):
            if isinstance(op, WriteOp):
                at, write_group = writes.setdefault(bool(op.key), ([], []))
                at.append(i)
                write_group.append(op)
            elif isinstance(op, ReadOp):
                at, read_group = reads.setdefault(op.checked, ([], []))
                at.append(i)
                read_group.append(op)
            else:
                results[i] = self._one(op)
        for noted, (where, write_ops) in writes.items():
            _scatter(results, where, self._writes(write_ops, noted))
        for checked, (where, read_ops) in reads.items():
            _scatter(results, where, self._reads(read_ops, checked))
        _update_running(ops, results)
        return results

    def _one(self, op: DataOp) -> OpResult:
        """One op, one request: the node's refusal is the result."""
        if isinstance(op, WriteOp):
            src = byte_view(op.buffer)
            request = SegmentWrite(op.segment_id, op.offset, len(src), op.key, op.checksum)
            reply = self._exchange(request, src, None)
            if isinstance(reply, Error):
                return reply.to_exception()
            return op.checksum if op.key else None  # a tagged write is noted as it lands
        dst = writable_byte_view(op.buffer)
        if isinstance(op, SsdReadOp):
            reply = self._exchange(SsdRead(op.key, len(dst)), None, dst)
            if isinstance(reply, Error):
                return reply.to_exception()
            self._moved(reply, len(dst), "an SSD read")
            return None
        running = hasher() if op.checked else None
        on_bytes = None if running is None else running.update
        reply = self._exchange(SegmentRead(op.segment_id, op.offset, len(dst)), None, dst, on_bytes)
        if isinstance(reply, Error):
            return reply.to_exception()
        self._moved(reply, len(dst), "a segment read")
        # hashed piece by piece as the bytes arrived (of no bytes: checksum(b""))
        return None if running is None else running.intdigest()

    def _writes(self, ops: Sequence[WriteOp], noted: bool) -> list[OpResult]:
        """Writes as one batch; noted ones carry their tags, and their checksums back."""
        views = [byte_view(op.buffer) for op in ops]
        notes = [(op.key, op.checksum) for op in ops] if noted else None
        done = self._batch(ops, views, write=True, notes=notes)
        if not noted:
            return list(done)
        return [op.checksum if r is None else r for op, r in zip(ops, done, strict=True)]

    def _reads(self, ops: Sequence[ReadOp], checked: bool) -> list[OpResult]:
        """Reads as one batch; checked ones hashed as each value lands."""
        views = [writable_byte_view(op.buffer) for op in ops]
        if not checked:
            return list(self._batch(ops, views, write=False))
        digests = [0] * len(views)

        def landed(i: int, digest: int) -> None:
            digests[i] = digest

        results = self._batch(ops, views, write=False, landed=landed)
        return [digests[i] if r is None else r for i, r in enumerate(results)]

    def _batch(
        self,
        ops: Sequence[WriteOp] | Sequence[ReadOp],
        views: list[memoryview],
        *,
        write: bool,
        notes: Sequence[tuple[str, int]] | None = None,
        landed: Callable[[int, int], None] | None = None,
    ) -> list[KVPoolError | None]:
        """Windows of up to :data:`PIPELINE_DEPTH` items (and :data:`WINDOW_BYTES`), each
        one ranged request (:class:`SegmentWriteMany` / :class:`SegmentReadMany`): the
        node handles one request per window, not one per value.  A window the node
        refuses as a whole is asked again item by item, so each item gets its own
        result.  ``notes``: each write's ``(key, checksum)`` tag.  ``landed(i, digest)``
        is told each read item's checksum, computed as its bytes arrive (see
        :func:`_receive_checked`)."""
        results: list[KVPoolError | None] = []
        for window in _windows(views):
            chunk = [(ops[i].segment_id, ops[i].offset, len(views[i])) for i in window]
            parts = [views[i] for i in window]
            tags = [notes[i] for i in window] if notes else []
            in_window = None if landed is None else (lambda j, d, w=window: landed(w[j], d))
            if len(window) > 1:
                refused = self._ranged(chunk, parts, write, tags, in_window)
                if refused is None:
                    results.extend([None] * len(window))
                    continue
                if refused.code in (Overloaded.code, AuthError.code):
                    self.close()  # the server closes a refused connection
                    return results + [refused.to_exception()] * (len(ops) - len(results))
            done = self._pipeline_items(chunk, parts, write, tags, in_window)
            results.extend(done)
            if done and isinstance(done[-1], Overloaded):  # nothing after it was served
                return results + [done[-1]] * (len(ops) - len(results))
        return results

    def _ranged(
        self,
        ranges: list[tuple[str, int, int]],
        parts: list[memoryview],
        write: bool,
        tags: list[tuple[str, int]],
        landed: Callable[[int, int], None] | None = None,
    ) -> Error | None:
        """One ranged exchange; the node's refusal (nothing was moved), or None."""
        with self._lock:
            channel = self._connected()
            try:
                deadline = framing.deadline_after(self.peer.timeout_s)
                if write:
                    channel.send_parts(SegmentWriteMany(ranges, tags), parts)
                else:
                    channel.send(SegmentReadMany(ranges))
                reply, length = channel.recv(deadline, reply=True)
                expected = 0 if write or isinstance(reply, Error) else sum(len(p) for p in parts)
                if length != expected or not isinstance(reply, Ok | Error):
                    raise ProtocolError(f"unexpected reply to a ranged transfer: {reply!r}")
                for j, part in enumerate(parts if length else ()):
                    if landed is None:
                        channel.recv_payload_into(part)
                    else:
                        landed(j, _receive_checked(channel, part))
            except KVPoolError:
                self._drop()
                raise
        return reply if isinstance(reply, Error) else None

    def _pipeline_items(
        self,
        ranges: list[tuple[str, int, int]],
        parts: list[memoryview],
        write: bool,
        tags: list[tuple[str, int]],
        landed: Callable[[int, int], None] | None = None,
    ) -> list[KVPoolError | None]:
        if write:
            requests: list[DataRequest] = (
                [SegmentWrite(*r, *tag) for r, tag in zip(ranges, tags, strict=True)]
                if tags
                else [SegmentWrite(*r) for r in ranges]
            )
            return self._pipeline(requests, parts, [None] * len(parts))
        requests = [SegmentRead(*r) for r in ranges]
        return self._pipeline(requests, [None] * len(parts), parts, landed)

    def _pipeline(
        self,
        requests: Sequence[DataRequest],
        outs: Sequence[memoryview | None],
        intos: Sequence[memoryview | None],
        landed: Callable[[int, int], None] | None = None,
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
                        reply, length = channel.recv(
                            framing.deadline_after(self.peer.timeout_s), reply=True
                        )
                        into = intos[i]
                        expected = 0 if into is None or isinstance(reply, Error) else len(into)
                        if length != expected or not isinstance(reply, Ok | Error):
                            raise ProtocolError(f"unexpected reply in a pipeline: {reply!r}")
                        if into is not None and length:
                            if landed is None:
                                channel.recv_payload_into(into)
                            else:
                                landed(i, _receive_checked(channel, into))
                        if isinstance(reply, Error) and reply.code == Overloaded.code:
                            # the connection was refused: nothing after it was served
                            self._drop()
                            refused = reply.to_exception()
                            return results + [refused] * (len(requests) - len(results))
                        results.append(reply.to_exception() if isinstance(reply, Error) else None)
            except KVPoolError:
                self._drop()
                raise
        return results

    def demote(self, segment_id: str, offset: int, length: int, key: str, checksum: int) -> None:
        """Ask the node to copy an object of its segment into its SSD tier."""
        reply = self._call(SegmentDemote(segment_id, offset, length, key, checksum))
        if not isinstance(reply, Ok):
            self.close()
            raise ProtocolError(f"unexpected reply to a demotion: {reply!r}")

    def ssd_remove(self, keys: list[str]) -> None:
        """Delete objects from the node's SSD tier."""
        reply = self._call(SsdRemove(keys))
        if not isinstance(reply, Ok):
            self.close()
            raise ProtocolError(f"unexpected reply to an SSD removal: {reply!r}")

    def info(self, segment_id: str) -> SegmentInfoReply:
        """The segment's size, shared-memory name and host token."""
        reply = self._call(SegmentInfo(segment_id))
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


def _update_running(ops: Sequence[DataOp], results: list[OpResult]) -> list[OpResult]:
    """Each read's ``running`` checksum updated with its bytes, in list order, once the
    list has landed (a failed read's checksum is never read: its object is a miss)."""
    for op, result in zip(ops, results, strict=True):
        if isinstance(op, ReadOp) and op.running is not None and result is None:
            op.running.update(writable_byte_view(op.buffer))
    return results


def _scatter(results: list[OpResult], where: list[int], done: list[OpResult]) -> None:
    """Put a group's results back at its ops' places in the list."""
    for i, result in zip(where, done, strict=True):
        results[i] = result


def _receive_checked(channel: Channel[DataRequest, DataReply], into: memoryview) -> int:
    """Receive one value into ``into`` and return its checksum, hashed piece by piece as
    the bytes land (the rest of the value, and of the batch, arrives meanwhile)."""
    running = hasher()
    channel.recv_payload_into(into, on_bytes=running.update)
    return running.intdigest()


def _windows(views: Sequence[memoryview]) -> list[range]:
    """Consecutive index ranges of at most PIPELINE_DEPTH views and WINDOW_BYTES bytes
    (a single larger view is a window of its own)."""
    windows: list[range] = []
    start, size = 0, 0
    for i, view in enumerate(views):
        if i > start and (i - start >= PIPELINE_DEPTH or size + len(view) > WINDOW_BYTES):
            windows.append(range(start, i))
            start, size = i, 0
        size += len(view)
    if start < len(views):
        windows.append(range(start, len(views)))
    return windows


def _closed_by_peer(sock: socket.socket) -> bool:
    """True when the peer closed (or reset) the connection; a look, no byte consumed."""
    try:
        # On TLS, a look at the raw stream (SSLSocket.recv takes no flags): a close
        # still reads as b""; pending bytes (a TLS session ticket) as open.
        return socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False  # open, nothing to read: the usual case
    except OSError:
        return True
