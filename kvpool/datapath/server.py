"""One listening socket, one thread per admitted connection, and a stop that is bounded.

The shape of both of kvpool's blocking TCP servers (segment data, P's pull port).  Threads
rather than an event loop because their work is ``recv_into``/``sendall`` of multi-megabyte
buffers, which CPython runs with the GIL released; an event loop would wake per chunk.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvpool.closing import Serving
from kvpool.datapath.waiting_room import HANDSHAKE_S, WaitingRoom
from kvpool.errors import AuthError, PeerTimeout, TransferError
from kvpool.security.admission import Admission
from kvpool.security.handshake import Identity
from kvpool.security.socket_auth import admit_with
from kvpool.security.socket_tls import accept_tls

__all__ = [
    "ACCEPT_POLL_S",
    "LINGER_S",
    "MAX_CONNECTIONS",
    "MAX_LINGERING",
    "RefusalThreads",
    "ServerStats",
    "ThreadedServer",
    "keepalive",
]

log = logging.getLogger(__name__)

#: how often the accept loop looks at the stop flag
ACCEPT_POLL_S = 0.2
#: connections served at once, unless the server is told otherwise
MAX_CONNECTIONS = 256
#: how long a refused connection is read (and dropped) before it is closed
LINGER_S = 1.0
#: refused connections lingering at once (each in a short-lived thread)
MAX_LINGERING = 16
_LINGER_READ = 1 << 16


class RefusalThreads:
    """Refused connections answered at most ``limit`` at once, each in a short-lived
    daemon thread; past that a refused connection is closed at once, so a flood of
    refusals costs no more threads."""

    def __init__(self, limit: int, name: str) -> None:
        self._limit = limit
        self._name = name
        self._lock = threading.Lock()
        self._running = 0

    def start(self, conn: socket.socket, answer: Callable[[socket.socket], None]) -> None:
        """``answer(conn)`` in a thread of its own, or ``conn`` closed at the limit."""
        with self._lock:
            room = self._running < self._limit
            self._running += room
        if not room:
            conn.close()
            return
        threading.Thread(
            target=self._run, args=(conn, answer), name=self._name, daemon=True
        ).start()

    def _run(self, conn: socket.socket, answer: Callable[[socket.socket], None]) -> None:
        try:
            answer(conn)
        finally:
            with self._lock:
                self._running -= 1


# Rules:
#
# - ``handle(conn, identity)`` runs in the connection's own thread and owns the
#   conversation after the handshake (``identity``: the peer ``admission`` proved, None on
#   a port without one); the server closes ``conn`` when it returns or raises (an
#   exception ends that connection only, and is logged).  A peer that fails or does not
#   finish the handshake in ``handshake_s`` never reaches it: ``on_refused`` is told why.
# - Between requests a handler should look at :attr:`ThreadedServer.stopping`; it need not
#   poll, because :meth:`ThreadedServer.close` shuts every open connection down, which
#   wakes a thread blocked in ``recv``.
# - :meth:`ThreadedServer.close` waits at most ``timeout_s`` for the accept thread and
#   again per connection thread: a stuck handler cannot hold up a shutdown for longer.
# - At most ``max_connections`` are served at once (each holds a thread and its buffers).
#   One more is refused: ``refuse(conn)`` says why in the protocol's own words, then the
#   close lingers (our side stops writing, and what the peer still sends is read and
#   dropped for at most :data:`LINGER_S`), because closing a socket with unread bytes
#   resets it and the peer would never read the refusal.  At most
#   :data:`MAX_LINGERING` refusals linger at once; past that they are closed at once.
class ThreadedServer(Serving):
    """Accepts TCP connections on ``(host, port)`` and serves each with ``handle`` in a
    thread of its own."""

    def __init__(
        self,
        host: str,
        port: int,
        handle: Callable[[socket.socket, Identity | None], None],
        *,
        name: str = "kvpool-server",
        backlog: int | None = 128,
        accept_poll_s: float = ACCEPT_POLL_S,
        on_connection: Callable[[], None] | None = None,
        max_connections: int = MAX_CONNECTIONS,
        refuse: Callable[[socket.socket], None] | None = None,
        tls: ssl.SSLContext | None = None,
        refuse_plain: Callable[[bytes], bytes] | None = None,
        tls_timeout_s: float = 10.0,
        admission: Callable[[], Admission] | None = None,
        on_refused: Callable[[str], None] | None = None,
        handshake_s: float = HANDSHAKE_S,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.host = host
        self.port = port
        self.name = name
        self._handle = handle
        self._backlog = backlog
        self._accept_poll_s = accept_poll_s
        self._on_connection = on_connection
        self.max_connections = max_connections
        self._refuse = refuse
        # TLS (None: plain TCP): the handshake runs in the connection's thread, so a
        # slow or silent peer never holds up the accept loop.
        self._tls = tls
        self._refuse_plain = refuse_plain or (lambda _head: b"")
        self._tls_timeout_s = tls_timeout_s
        self.tls_refused = 0  # connections whose TLS handshake failed, since start
        self.refused = 0  # connections refused at the cap, since start
        self._lingering = RefusalThreads(MAX_LINGERING, f"{name}-refused")
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._admission = admission
        self._on_refused = on_refused or (lambda _reason: None)
        self._handshake_s = handshake_s
        # with TLS the handshakes run in the connections' threads, after the TLS one
        self.waiting_room = WaitingRoom(
            name,
            self._admitted,
            make_admission=admission if tls is None else None,
            refused=self._on_refused,
            handshake_s=handshake_s,
        )

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` actually bound (the port is chosen when 0 was asked)."""
        return self.host, self.port

    @property
    def stopping(self) -> bool:
        """True once :meth:`close` began: handlers end their conversation."""
        return self._stopping.is_set()

    @property
    def connections(self) -> int:
        """Connections served now (admitted, each in its thread)."""
        with self._lock:
            return len(self._conns)

    @property
    def waiting(self) -> int:
        """Connections accepted and not yet admitted (no thread)."""
        return self.waiting_room.waiting

    def bind(self) -> tuple[str, int]:
        """Bind and listen (once), without accepting yet: a start-up that allocates
        memory binds first, so a busy port costs nothing.  ``OSError`` when the address
        cannot be bound (the caller says which setting chose it)."""
        if self._listener is None:
            listener = socket.create_server((self.host, self.port), backlog=self._backlog)
            listener.settimeout(self._accept_poll_s)
            self.port = listener.getsockname()[1]
            self._listener = listener
        return self.address

    def start(self) -> tuple[str, int]:
        """Bind (unless :meth:`bind` did), listen and start accepting; returns the bound
        address."""
        self.bind()
        self.waiting_room.start()
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"{self.name}-accept:{self.port}", daemon=True
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
        self.waiting_room.close(timeout_s)
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        for _, thread in conns:
            thread.join(timeout_s)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                raise
            self.waiting_room.add(conn, str(peer[0]) if isinstance(peer, tuple) else "")

    def _admitted(self, conn: socket.socket, identity: Identity | None) -> None:
        """From the waiting room: a proved peer (or, without a handshake, a readable one)
        gets its thread, or the refusal when every slot is taken."""
        thread = threading.Thread(
            target=self._serve, args=(conn, identity), name=f"{self.name}-conn", daemon=True
        )
        with self._lock:
            full = len(self._conns) >= self.max_connections
            if not full:
                self._conns[conn] = thread
        if full:
            self._refuse_connection(conn)
            return
        if self._on_connection is not None:
            self._on_connection()
        thread.start()

    def _serve(self, conn: socket.socket, identity: Identity | None) -> None:
        try:
            if self._tls is not None:
                conn = self._start_tls(conn)
                if self._admission is not None:
                    identity = self._handshake(conn)
                    if identity is None:
                        return
            self._handle(conn, identity)
        except (AuthError, PeerTimeout, TransferError) as exc:  # the TLS step's refusals
            self.tls_refused += 1
            log.info("%s: connection refused: %s", self.name, exc)
        except Exception:  # a handler's bug ends its own connection, never the server
            log.exception("%s: connection handler failed", self.name)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _handshake(self, conn: socket.socket) -> Identity | None:
        """The credential handshake inside TLS, in this connection's thread."""
        assert self._admission is not None
        try:
            return admit_with(conn, self._admission(), self._handshake_s)
        except (AuthError, PeerTimeout, TransferError) as exc:
            self._on_refused(str(exc))
            return None

    def _start_tls(self, conn: socket.socket) -> socket.socket:
        """Run the TLS handshake; the TLS socket replaces ``conn`` among the open
        connections (so :meth:`close` shuts the right one down)."""
        assert self._tls is not None
        tls = accept_tls(conn, self._tls, self._tls_timeout_s, self._refuse_plain)
        with self._lock:
            thread = self._conns.pop(conn, None)
            if thread is not None:
                self._conns[tls] = thread
        return tls

    def _refuse_connection(self, conn: socket.socket) -> None:
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            log.warning(
                "%s: refusing connections at the limit of %d open (%d refused so far)",
                self.name,
                self.max_connections,
                self.refused,
            )
        conn.settimeout(LINGER_S)  # a refusal is one small frame: it fits the send buffer
        try:
            if self._refuse is not None:
                self._refuse(conn)
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        self._lingering.start(conn, self._linger)

    def _linger(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + LINGER_S
        try:
            with contextlib.suppress(OSError):
                while (left := deadline - time.monotonic()) > 0:
                    conn.settimeout(left)
                    if not conn.recv(_LINGER_READ):
                        break  # the peer read the refusal and closed
        finally:
            conn.close()


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
    refused_auth: int = 0
    refused_grants: int = 0  # a tenant's requests without a valid grant
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)


def keepalive(conn: socket.socket) -> None:
    """Let the kernel find clients that vanished without a FIN (host down, partition):
    an idle connection waits without a timeout, so without this it would wait forever."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):  # Linux names; other systems keep their defaults
            conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
