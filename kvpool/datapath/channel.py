"""A framed connection end with few syscalls: the fast path for segment transfers.

:class:`Channel` does what :mod:`kvpool.datapath.framing`'s functions do with fewer
syscalls per exchange.  The socket belongs to the channel afterwards: do not mix it with
``framing``'s functions (they use Python-level timeouts).
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from kvpool.datapath.framing import SMALL_PAYLOAD, BadRequest
from kvpool.errors import ConfigError, KVPoolError, PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.codec import HEADER_SIZE, Codec
from kvpool.sockio import deadline_after, peer_alert, why_send_failed

__all__ = [
    "DEFAULT_SPIN_US",
    "MAX_OWED",
    "MAX_SPIN_US",
    "ON_BYTES_MIN",
    "STAGE_SIZE",
    "Channel",
    "reply_spin_us",
]

S = TypeVar("S")
R = TypeVar("R")

STAGE_SIZE = 8 * 1024
# The smallest piece recv_payload_into hands to ``on_bytes``: a call per recv of a few
# KiB would cost more than the overlap gains.
ON_BYTES_MIN = 256 * 1024
_DISCARD_CHUNK = 1 << 20
# Posted requests whose replies are not read yet.  The bound keeps a caller that only
# posts from filling both socket buffers (a peer blocked writing replies stops reading).
MAX_OWED = 64


#: How long a call polls for its reply before sleeping in the kernel (µs); see
#: :meth:`Channel._spin_for`.  ``KVPOOL_RPC_SPIN_US`` sets it, 0 switches it off.
DEFAULT_SPIN_US = 100
MAX_SPIN_US = 10_000


def reply_spin_us(env: Mapping[str, str] | None = None) -> int:
    """The reply spin of this process's calls: ``KVPOOL_RPC_SPIN_US``, else the default.

    ConfigError (naming the variable and what it takes) for anything but a whole number
    from 0 to :data:`MAX_SPIN_US`."""
    raw = (os.environ if env is None else env).get("KVPOOL_RPC_SPIN_US", "").strip()
    if not raw:
        return DEFAULT_SPIN_US
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SPIN_US:
        raise ConfigError(
            f"KVPOOL_RPC_SPIN_US={raw!r}: want a whole number of microseconds from 0 (no "
            f"spin) to {MAX_SPIN_US}; unset it for the default {DEFAULT_SPIN_US}"
        )
    return value


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, 0.001)  # 0 would mean "no timeout" to the kernel
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))


# Why it looks like this (CPython on loopback spends its time in syscalls, not copies):
#
# - The socket stays in blocking mode and timeouts are the kernel's ``SO_RCVTIMEO`` /
#   ``SO_SNDTIMEO``: no ``poll()`` before every ``recv`` as Python's own socket timeout
#   would do.  A deadline per exchange is checked after every call; a silent peer is
#   :class:`~kvpool.errors.PeerTimeout` after ``timeout_s``, and a peer trickling bytes
#   is cut off within twice that.  A closed or reset connection is
#   :class:`~kvpool.errors.TransferError`.
# - A frame is sent with one ``sendmsg`` gathering header, body and payload.
# - Header and body are read through a small staging buffer, usually in one ``recv``;
#   whatever payload bytes came along with them (at most :data:`STAGE_SIZE`) are copied
#   out of it, and the rest of the payload is ``recv_into`` the caller's buffer directly.
# - A request whose answer the caller does not need (a lease release) can be *posted*:
#   sent at once, its reply read later, just before the next :meth:`Channel.call`'s reply
#   or by :meth:`Channel.settle`.  That takes a round trip off the caller's path and
#   relies on one thing of the peer: it answers a connection's requests in order, one
#   reply each (the master and the storage nodes do).  The count of replies owed lives
#   in the channel, so it is forgotten with it.
# - A call polls for its reply for a few tens of µs before it sleeps (``spin_us``,
#   :func:`reply_spin_us`): on a VM the wake-up of a sleeping reader is most of a small
#   call's round trip.
class Channel(Generic[S, R]):
    """One end of a framed connection: sends ``S`` messages, receives ``R`` messages.

    Not thread-safe; one exchange at a time.  After any exception other than an
    error *reply* or :class:`BadRequest`, the stream may be mid-frame: close it.
    """

    def __init__(
        self,
        sock: socket.socket,
        send_codec: Codec[S],
        recv_codec: Codec[R],
        timeout_s: float,
        on_owed_reply: Callable[[R], None] | None = None,
        spin_us: int = 0,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.sock = sock
        self.timeout_s = timeout_s
        self._send_codec = send_codec
        self._recv_codec = recv_codec
        # On TLS the kernel's timeouts do not bound a read: CPython's SSL read on a
        # blocking socket retries a timed-out read forever, so a dead peer would hang it.
        # There Python's own timeout (a poll per call) bounds each read and write.
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._set_timeout(timeout_s, send=True)
        self._stage = memoryview(bytearray(STAGE_SIZE))
        self._start = 0  # staged bytes not consumed yet: [_start, _end)
        self._end = 0
        self.owed = 0  # replies of posted requests not read yet
        self._on_owed_reply = on_owed_reply
        self._spinning = False  # inside a call: reads poll before they block
        # TLS reads go through the SSL object's buffer, which a non-blocking peek at the
        # socket does not see: no spin there.
        self.spin_ns = 0 if self._tls else spin_us * 1000

    def _set_timeout(self, timeout_s: float, *, send: bool = False) -> None:
        if self._tls:
            self.sock.settimeout(timeout_s)
            return
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout_s))
        if send:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))

    def close(self) -> None:
        self.sock.close()

    # -- sending ------------------------------------------------------------------

    def send(self, message: S, payload: memoryview | None = None) -> None:
        """Send one frame (``payload`` must be a flat byte view) within ``timeout_s``."""
        self.send_parts(message, () if payload is None or not len(payload) else (payload,))

    def send_parts(self, message: S, parts: Sequence[memoryview]) -> None:
        """Send one frame whose payload is ``parts`` (flat byte views) back to back, in
        one ``sendmsg`` gathering them (a batch of values without joining them)."""
        length = sum(len(p) for p in parts) if parts else 0
        head = self._send_codec.encode(message, length)
        buffers: list[bytes | memoryview] = [head, *parts]
        if self._tls:
            self._send_tls(buffers)
            return
        sent = self._sendmsg(buffers)
        if sent < len(head) + length:  # interrupted or timed out part-way: finish it
            self._send_rest([memoryview(b) for b in buffers], sent)

    def _send_tls(self, buffers: list[bytes | memoryview]) -> None:
        """An SSLSocket has no ``sendmsg``: a small frame is joined into one TLS record,
        a large payload follows its header (``sendall`` splits it into records)."""
        if len(buffers) > 1 and sum(len(b) for b in buffers[1:]) <= SMALL_PAYLOAD:
            buffers = [b"".join(bytes(b) for b in buffers)]
        try:
            for buffer in buffers:
                self.sock.sendall(buffer)
        except (BlockingIOError, TimeoutError):
            raise PeerTimeout("timed out sending: the peer stopped reading") from None
        except OSError as exc:  # SSLError included
            raise self._why_send_failed(exc) from None

    def _why_send_failed(self, exc: OSError) -> KVPoolError:
        return why_send_failed(self.sock, exc)

    def _send_rest(self, buffers: list[memoryview], sent: int) -> None:
        deadline = deadline_after(self.timeout_s)
        while True:
            while sent and buffers:
                first = buffers[0]
                if sent >= len(first):
                    sent -= len(first)
                    buffers.pop(0)
                else:
                    buffers[0] = first[sent:]
                    sent = 0
            if not buffers:
                return
            if time.monotonic() > deadline:
                raise PeerTimeout("timed out sending: the peer reads too slowly")
            sent = self._sendmsg(buffers)

    def _sendmsg(self, buffers: Sequence[bytes | memoryview]) -> int:
        """One ``sendmsg`` of ``buffers``: the bytes sent, a failure as the data plane's
        error (a send timeout is the peer's: it stopped reading)."""
        try:
            return self.sock.sendmsg(buffers)
        except BlockingIOError:
            raise PeerTimeout("timed out sending: the peer stopped reading") from None
        except OSError as exc:
            raise TransferError(f"connection failed while sending: {exc}") from None

    # -- receiving ----------------------------------------------------------------

    def _recv_some(self, view: memoryview, deadline: float | None, what: str) -> int:
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO (TLS: the timeout) ran out
            raise PeerTimeout(f"timed out waiting for {what}") from None
        except ssl.SSLError as exc:
            raise peer_alert(exc, f"receiving {what}") from None
        except OSError as exc:
            raise TransferError(f"connection failed while receiving {what}: {exc}") from None
        if n and deadline is not None and time.monotonic() > deadline:
            raise PeerTimeout(f"timed out receiving {what}: the peer sends too slowly")
        return n

    def _fill(self, need: int, deadline: float, what: str) -> None:
        """Make at least ``need`` bytes (≤ STAGE_SIZE) available in the stage."""
        if self._end - self._start >= need:
            return
        if self._start:
            kept = self._end - self._start
            self._stage[:kept] = self._stage[self._start : self._end]
            self._start, self._end = 0, kept
        if self._spinning:
            self._spin_for(need)
        while self._end < need:
            n = self._recv_some(self._stage[self._end :], deadline, what)
            if n == 0:
                raise TransferError(
                    f"peer closed the connection after {self._end} of {need} bytes of {what}"
                )
            self._end += n

    def _take(self, length: int) -> memoryview:
        view = self._stage[self._start : self._start + length]
        self._start += length
        return view

    def _recv_frame(self, deadline: float) -> tuple[R, int] | BadRequest:
        if self._end - self._start < HEADER_SIZE:
            self._fill(HEADER_SIZE, deadline, "a frame header")
        body_length, payload_length = self._recv_codec.parse_header(self._take(HEADER_SIZE))
        if body_length <= len(self._stage):
            if self._end - self._start < body_length:
                self._fill(body_length, deadline, "a frame body")
            body: memoryview = self._take(body_length)
        else:  # a large metadata body: assemble it outside the stage
            body = memoryview(bytearray(body_length))
            self.recv_payload_into(body, deadline)
        try:
            message = self._recv_codec.decode_body(body)
        except ProtocolError as exc:
            # The payload is still in the stream; drop it so the stream stays in sync.
            self.discard_payload(payload_length, deadline)
            return BadRequest(exc)
        return message, payload_length

    def recv(self, deadline: float | None = None, *, reply: bool = False) -> tuple[R, int]:
        """Receive one frame's message; returns ``(message, payload_length)``.

        The caller then consumes exactly ``payload_length`` bytes with
        :meth:`recv_payload_into` or :meth:`discard_payload`.  Any malformed frame
        raises :class:`~kvpool.errors.ProtocolError`.  ``reply``: the frame answers a
        request just sent, so it is polled for before the read sleeps (``spin_us``), as
        :meth:`call` does.
        """
        if reply and self.spin_ns:
            self._spinning = True
            try:
                return self.recv(deadline)
            finally:
                self._spinning = False
        got = self._recv_frame(deadline_after(self.timeout_s) if deadline is None else deadline)
        if isinstance(got, BadRequest):
            raise got.error
        return got

    def recv_request(self, idle_timeout: float | None) -> tuple[R, int] | BadRequest | None:
        """A server's receive: wait up to ``idle_timeout`` (``None``: forever) for a
        request to start, then ``timeout_s`` for its header and body.

        Returns ``None`` when the peer closed cleanly between requests, and
        :class:`BadRequest` for a consumed frame with an undecodable body.  A bad header
        (magic, limits) raises :class:`~kvpool.errors.ProtocolError`: the stream cannot
        be resynchronised, so reply if you like and close.
        """
        if self._end == self._start:
            self._start = self._end = 0
            idle_deadline = None if idle_timeout is None else deadline_after(idle_timeout)
            while True:
                try:
                    n = self._recv_some(self._stage, None, "the next request")
                except PeerTimeout:
                    # SO_RCVTIMEO fired while idle: only the idle timeout ends a quiet
                    # connection.
                    if idle_deadline is not None and time.monotonic() >= idle_deadline:
                        raise
                    continue
                if n == 0:
                    return None
                self._end = n
                break
        return self._recv_frame(deadline_after(self.timeout_s))

    def recv_payload_into(
        self,
        view: memoryview,
        deadline: float | None = None,
        on_bytes: Callable[[memoryview], object] | None = None,
    ) -> None:
        """Fill ``view`` with the next payload bytes: staged ones first, then straight
        from the socket into ``view``.  ``on_bytes`` sees every byte once, in order, in
        pieces of at least :data:`ON_BYTES_MIN` (the last may be shorter) as they land:
        work on them (a checksum) overlaps the rest still on the wire."""
        if deadline is None:
            deadline = deadline_after(self.timeout_s)
        staged = min(self._end - self._start, len(view))
        if staged:
            view[:staged] = self._take(staged)
        received, total, seen = staged, len(view), 0
        while received < total:
            n = self._recv_some(view[received:], deadline, "a payload")
            if n == 0:
                raise TransferError(
                    f"peer closed the connection after {received} of {total} payload bytes"
                )
            received += n
            if on_bytes is not None and received - seen >= ON_BYTES_MIN and received < total:
                on_bytes(view[seen:received])
                seen = received
        if on_bytes is not None and seen < total:
            on_bytes(view[seen:total])

    def discard_payload(self, length: int, deadline: float | None = None) -> None:
        """Receive and drop ``length`` payload bytes (e.g. a refused write's)."""
        scratch = memoryview(bytearray(min(length, _DISCARD_CHUNK)))
        while length > 0:
            chunk = min(length, len(scratch))
            self.recv_payload_into(scratch[:chunk], deadline)
            length -= chunk

    def call(
        self,
        message: S,
        payload: memoryview | None = None,
        meanwhile: Callable[[], object] | None = None,
    ) -> tuple[R, int]:
        """Send a request and receive its reply's message and payload length (after the
        replies owed to posted requests, which go to ``on_owed_reply``).

        ``meanwhile`` runs between sending and receiving: work the caller needs anyway
        (a checksum) done while the peer handles the request.  Its time counts against
        the exchange's deadline; if it raises, the reply is owed and read later.
        """
        deadline = deadline_after(self.timeout_s)
        self.send(message, payload)
        if meanwhile is not None:
            try:
                meanwhile()
            except BaseException:
                self.owed += 1
                raise
        self._spinning = self.spin_ns > 0
        try:
            if self.owed:
                self._settle(deadline)
            return self.recv(deadline)
        finally:
            self._spinning = False

    def _spin_for(self, need: int) -> None:
        """Poll until ``need`` bytes are staged, for up to ``spin_ns`` since the last
        bytes came, before the blocking read takes over.

        A blocking read that sleeps costs a wake-up when the reply lands, and on a VM an
        idle vCPU's wake-up is tens of µs (a halted vCPU waits for an interrupt through
        the hypervisor): most of a small call's round trip.  A reply usually comes
        within the window; a later one is read by the blocking path as before.  Each
        empty poll yields the CPU, so a server on this same core runs at once."""
        clock, budget = time.perf_counter_ns, self.spin_ns
        recv_into, yield_cpu, stage = self.sock.recv_into, os.sched_yield, self._stage
        give_up = clock() + budget
        while self._end < need:
            try:
                n = recv_into(stage[self._end :], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if clock() >= give_up:
                    return
                yield_cpu()
                continue
            except OSError:
                return  # the blocking read that follows reports it
            if n == 0:
                return  # closed: the blocking read that follows says so
            self._end += n
            give_up = clock() + budget

    # -- requests whose reply nobody waits for --------------------------------------

    def post(self, message: S) -> None:
        """Send a request without waiting for its reply; see the comment above the class."""
        if self.owed >= MAX_OWED:
            self.settle()
        self.send(message)
        self.owed += 1

    def settle(self, timeout_s: float | None = None) -> None:
        """Read every reply owed to posted requests, within ``timeout_s`` (default: the
        channel's; a shorter one, e.g. before closing, bounds the wait on a hung peer)."""
        if not self.owed:
            return
        if timeout_s is None or timeout_s >= self.timeout_s:
            self._settle(deadline_after(self.timeout_s))
            return
        self._set_timeout(timeout_s)
        try:
            self._settle(deadline_after(timeout_s))
        finally:
            self._set_timeout(self.timeout_s)

    def _settle(self, deadline: float) -> None:
        while self.owed:
            got = self._recv_frame(deadline)
            self.owed -= 1  # consumed, even when undecodable (its payload is dropped too)
            if isinstance(got, BadRequest):
                continue
            reply, payload_length = got
            if payload_length:
                self.discard_payload(payload_length, deadline)
            if self._on_owed_reply is not None:
                self._on_owed_reply(reply)
