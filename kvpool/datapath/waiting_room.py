"""Where a threaded server's new connections wait, threadless, until they earn a thread.

A connection gets a thread and a ``max_connections`` slot only once its peer has proved the
credential (or, on a port without one, sent its first bytes), so a flood of idle
connections without a credential costs a file descriptor each, never a thread or a slot.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.security.admission import Admission
from kvpool.security.handshake import Identity

__all__ = ["HANDSHAKE_S", "MAX_WAITING", "MAX_WAITING_PER_PEER", "WaitingRoom"]

log = logging.getLogger(__name__)

#: a connection must have proved its credential (or, on a port without one, sent its
#: first bytes) this long after it was accepted, or it is closed
HANDSHAKE_S = 5.0
#: connections waiting at once; one more closes the one that waited longest
MAX_WAITING = 4096
#: of them from one peer address; one more closes that peer's longest-waiting one
MAX_WAITING_PER_PEER = 1024
_POLL_S = 0.2


# Rules:
#
# - Full room, or full for that peer: the connection whose last byte came longest ago
#   goes, not the new one.  A real client proves itself within a round trip or two, so
#   what has gone quiet longest is what a flood left idle or stalled; a new client is
#   never shut out by it.
# - A port with a credential runs the whole handshake here (:class:`Admission`, fed what
#   arrives, its small replies sent without blocking) and hands on only a proved peer,
#   with its identity.  A port without one, or with TLS (the TLS handshake runs in the
#   connection's thread), hands a connection on as soon as it is readable, unread.
# - Every connection waits at most ``handshake_s``: on a port without a credential that
#   is an idle close before the first request, as the server closes one idle after a
#   request (kvpool's clients reconnect by themselves).
@dataclass
class _Waiting:
    conn: socket.socket
    peer: str
    deadline: float
    admission: Admission | None


class WaitingRoom:
    """Holds connections until ``admitted(conn, identity)`` may have them (in the room's
    thread: it must only start the connection's own thread).  ``make_admission``: the
    port's handshake (None: the first readable byte admits); ``refused(reason)`` is told
    of each connection closed here."""

    def __init__(
        self,
        name: str,
        admitted: Callable[[socket.socket, Identity | None], None],
        *,
        make_admission: Callable[[], Admission] | None = None,
        refused: Callable[[str], None] | None = None,
        handshake_s: float = HANDSHAKE_S,
        max_waiting: int = MAX_WAITING,
        max_per_peer: int = MAX_WAITING_PER_PEER,
    ) -> None:
        self.name = name
        self._admitted = admitted
        self._make_admission = make_admission
        self._refused = refused or (lambda _reason: None)
        self.handshake_s = handshake_s
        self.max_waiting = max_waiting
        self.max_per_peer = max_per_peer
        # least recent progress first (moved to the end by every byte that arrives)
        self._waiting: collections.OrderedDict[socket.socket, _Waiting] = collections.OrderedDict()
        # arrival order, so deadline order (entries gone since are skipped)
        self._deadlines: collections.deque[_Waiting] = collections.deque()
        self._per_peer: collections.Counter[str] = collections.Counter()
        self._arrivals: collections.deque[tuple[socket.socket, str]] = collections.deque()
        self._lock = threading.Lock()
        self._selector: selectors.BaseSelector | None = None  # made by start()
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{name}-waiting", daemon=True)
        self.closed_waiting = 0  # connections closed here: handshake late, failed, room full

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread.start()

    def add(self, conn: socket.socket, peer: str) -> None:
        """A connection just accepted (from any thread): the room's thread takes it."""
        with self._lock:
            self._arrivals.append((conn, peer))
        self._wake()

    def _wake(self) -> None:
        if self._wake_w is not None:
            with contextlib.suppress(OSError):
                self._wake_w.send(b"\0")

    def close(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        for entry in list(self._waiting.values()):
            entry.conn.close()
        self._waiting.clear()
        self._deadlines.clear()
        with self._lock:
            for conn, _ in self._arrivals:
                conn.close()
            self._arrivals.clear()
        for closable in (self._selector, self._wake_r, self._wake_w):
            if closable is not None:
                closable.close()

    # ------------------------------------------------------------------ the room's thread
    def _loop(self) -> None:
        assert self._selector is not None and self._wake_r is not None
        while not self._stopping.is_set():
            timeout = _POLL_S
            if self._deadlines:
                first = self._deadlines[0]
                timeout = max(0.0, min(timeout, first.deadline - time.monotonic()))
            for key, _ in self._selector.select(timeout):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                    continue
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                entry = self._waiting.get(conn)
                if entry is not None:
                    self._readable(entry)
            self._take_arrivals()
            self._expire(time.monotonic())

    def _take_arrivals(self) -> None:
        with self._lock:
            arrivals, self._arrivals = self._arrivals, collections.deque()
        now = time.monotonic()
        for conn, peer in arrivals:
            if len(self._waiting) >= self.max_waiting:
                self._drop(next(iter(self._waiting.values())), "the waiting room was full")
            if self._per_peer[peer] >= self.max_per_peer:
                oldest = next(e for e in self._waiting.values() if e.peer == peer)
                self._drop(oldest, f"{peer} had {self.max_per_peer} connections waiting")
            admission = self._make_admission() if self._make_admission else None
            conn.setblocking(False)
            entry = _Waiting(conn, peer, now + self.handshake_s, admission)
            self._waiting[conn] = entry
            self._deadlines.append(entry)
            self._per_peer[peer] += 1
            assert self._selector is not None
            self._selector.register(conn, selectors.EVENT_READ)

    def _expire(self, now: float) -> None:
        while self._deadlines:
            first = self._deadlines[0]
            if first.deadline > now:
                return
            self._deadlines.popleft()
            if self._waiting.get(first.conn) is not first:
                continue  # admitted or dropped already
            if _has_bytes(first.conn):  # arrived in time, only this thread was late
                self._readable(first)
                if first.conn not in self._waiting:
                    continue
            what = "handshake" if first.admission is not None else "request"
            self._drop(first, f"no {what} within {self.handshake_s:g} s")

    def _readable(self, entry: _Waiting) -> None:
        admission = entry.admission
        if admission is None:
            self._hand_on(entry, None)
            return
        try:
            data = entry.conn.recv(admission.need())
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(entry, f"the handshake broke: {exc}")
            return
        if not data:
            self._drop(entry, "the peer closed during the handshake")
            return
        self._waiting.move_to_end(entry.conn)
        reply = admission.feed(data)
        if reply:
            try:
                sent = entry.conn.send(reply)  # a handshake frame fits an empty send buffer
            except OSError:
                sent = -1
            if sent != len(reply) and admission.failure is None:
                self._drop(entry, "could not send the handshake reply")
                return
        if admission.failure is not None:
            with contextlib.suppress(OSError):
                entry.conn.shutdown(socket.SHUT_WR)  # the refusal first, then the close
            self._drop(entry, str(admission.failure))
        elif admission.identity is not None:
            self._hand_on(entry, admission.identity)

    def _forget(self, entry: _Waiting) -> None:
        self._waiting.pop(entry.conn, None)
        self._per_peer[entry.peer] -= 1
        if self._per_peer[entry.peer] <= 0:
            del self._per_peer[entry.peer]
        assert self._selector is not None  # only the started room's thread forgets
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(entry.conn)

    def _hand_on(self, entry: _Waiting, identity: Identity | None) -> None:
        self._forget(entry)
        entry.conn.setblocking(True)
        try:
            self._admitted(entry.conn, identity)
        except Exception:  # the server's bug: this connection only, never the room
            log.exception("%s: handing on a connection failed", self.name)
            entry.conn.close()

    def _drop(self, entry: _Waiting, reason: str) -> None:
        self._forget(entry)
        entry.conn.close()
        self.closed_waiting += 1
        self._refused(reason)


def _has_bytes(conn: socket.socket) -> bool:
    try:
        return bool(conn.recv(1, socket.MSG_PEEK))
    except OSError:  # nothing yet (BlockingIOError), or the connection broke
        return False
