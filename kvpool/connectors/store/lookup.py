"""The scheduler↔worker lookup channel of the embedded backend (vllm-ascend's ``lookup_rpc_port``).

With ``backend: embedded`` the pool lives in vLLM's worker process, but the scheduler runs
in another (EngineCore), so the worker answers its lookups, pins and releases on a Unix
socket.  With a master, both halves talk to the master and this channel is not used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvpool.closing import Closing
from kvpool.datapath import framing
from kvpool.datapath.server import RefusalThreads
from kvpool.engines import PoolLookups
from kvpool.errors import ConfigError, KVPoolError, PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.codec import Codec

__all__ = [
    "LOOKUP_CODEC",
    "REPLY_CODEC",
    "Failed",
    "Found",
    "Lookup",
    "LookupClient",
    "LookupServer",
    "PinKeys",
    "Present",
    "Probe",
    "ReleasePins",
    "channel_path",
    "private_dir",
]


# Wire format: kvpool's frames (kvpool.protocol.codec), one request per round trip on a
# persistent connection: a Lookup (the keys), a Probe, a PinKeys or a ReleasePins, answered
# by a Found (how many leading keys are present, pinned, or released), a Present (one flag
# per probed key) or a Failed (the worker's error message).
class Lookup(msgspec.Struct, frozen=True, tag=True):
    """How many leading ``keys`` does the pool hold?"""

    keys: list[str]


class Probe(msgspec.Struct, frozen=True, tag=True):
    """Which of ``keys`` does the pool hold?"""

    keys: list[str]


class PinKeys(msgspec.Struct, frozen=True, tag=True):
    """Pin ``keys`` for ``owner`` (a request) for ``ttl_ms``; how many are pinned?"""

    keys: list[str]
    owner: str
    ttl_ms: int


class ReleasePins(msgspec.Struct, frozen=True, tag=True):
    """End every pin of ``owner``; how many ended?"""

    owner: str


class Found(msgspec.Struct, frozen=True, tag=True):
    count: int


class Present(msgspec.Struct, frozen=True, tag=True):
    """One byte per probed key: 1 when the pool holds it."""

    flags: bytes


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The lookup raised in the worker (the scheduler counts it as a miss)."""

    message: str


# A lookup of a 1M-token prompt is ~300 KiB; anything over 64 MiB is junk.
_Request = Lookup | Probe | PinKeys | ReleasePins
LOOKUP_CODEC: Codec[_Request] = Codec(_Request, max_body=64 << 20, max_payload=0)
REPLY_CODEC: Codec[Found | Present | Failed] = Codec(Found | Present | Failed, max_payload=0)
# Once a request has started, the rest of it must arrive within this long.
_REQUEST_TIMEOUT_S = 30.0
#: connections served at once (the scheduler holds one; more are a bug or a flood)
MAX_CONNECTIONS = 32
#: refused connections answered at once (each in a short thread); past it, closed at once
_MAX_REFUSING = 8
_REFUSE_S = 1.0  # how long a refused connection may take to send its request
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid


# The socket's name is derived from what both halves share and no other instance has:
# vLLM's instance_id (a nanosecond timestamp taken when the config is made), the
# engine_id, the data-parallel rank and lookup_rpc_port.  So "lookup_rpc_port": "0" (or any
# value) never collides between two instances on one host — not even a P and a D that
# share an engine_id as the production guide pairs them — and no TCP port is taken.
def channel_path(
    *, instance_id: str, engine_id: str, dp_rank: int, lookup_rpc_port: int, root: str | None = None
) -> str:
    """The Unix socket of one vLLM instance's lookup channel (short: sun_path is 108 bytes)."""
    digest = hashlib.blake2b(
        f"{instance_id}|{engine_id}|{dp_rank}|{lookup_rpc_port}".encode(), digest_size=8
    ).hexdigest()
    base = Path(root or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return str(base / f"kvpool-{os.geteuid()}" / f"lookup-{digest}.sock")


# Who may ask: only this user's processes.  The channel is a Unix socket, never a TCP
# port, so no other host reaches it; on this host three things keep other users out (a
# lookup answers what the pool holds, and a pin holds its memory):
# - the socket lies in a directory only its owner may enter (kvpool-<uid>, mode 700, made
#   here, refusing one that is not this user's or that others may enter), so another user
#   cannot reach the socket nor put one of their own in its place (the scheduler checks
#   the directory too before it asks);
# - the socket itself is mode 600;
# - the server asks the kernel who connected (SO_PEERCRED) and refuses another user,
#   should the permissions above ever be loosened.
# No handshake: every process that may connect runs as the one user, who owns the secret
# file too, so a secret would add nothing the kernel does not already check.
def private_dir(path: str, *, create: bool) -> None:
    """Check (and with ``create``, make) the directory of socket ``path``: a directory
    of this user's that no one else may enter.  ConfigError naming the fix otherwise."""
    folder = os.path.dirname(path) or "."
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise ConfigError(f"lookup channel: cannot use {folder} ({exc.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"lookup channel: {folder} is not a directory; remove it")
    if info.st_uid != os.geteuid():
        raise ConfigError(
            f"lookup channel: {folder} belongs to user {info.st_uid}, not to this process's "
            f"user {os.geteuid()}; remove it (or set XDG_RUNTIME_DIR to a directory of yours)"
        )
    if info.st_mode & 0o077:
        raise ConfigError(
            f"lookup channel: other users may enter {folder} (mode "
            f"{stat.S_IMODE(info.st_mode):o}); run `chmod 700 {folder}`"
        )


def _peer_uid(conn: socket.socket) -> int:
    """The user of the process at the other end (the kernel's word, not the peer's)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(creds)[1])


def _answer(pool: PoolLookups, request: _Request) -> Found | Present:
    if isinstance(request, Lookup):
        return Found(int(pool.prefix_lookup(request.keys)))
    if isinstance(request, Probe):
        return Present(bytes(bytearray(map(bool, pool.batch_exists(request.keys)))))
    if isinstance(request, PinKeys):
        return Found(int(pool.pin(request.keys, request.owner, request.ttl_ms)))
    return Found(int(pool.release(request.owner)))


# At most max_connections are served at once (the scheduler needs one; each holds a
# thread); one more is answered Failed ("Overloaded") and closed.
class LookupServer:
    """Answers the scheduler's lookups, pins and releases on ``pool``, from a thread of the
    worker process."""

    def __init__(
        self,
        path: str,
        pool: PoolLookups,
        logger: logging.Logger,
        *,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        self.path = path
        self._pool = pool
        self._log = logger
        self.max_connections = max_connections
        self.refused = 0  # connections refused (another user, or over the cap), since start
        self._open = 0  # connections served now (under _lock)
        self._refusing = RefusalThreads(_MAX_REFUSING, "kvpool-lookup-refused")
        self._lock = threading.Lock()
        private_dir(path, create=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a leftover of this very instance (names are per instance)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)  # the directory already keeps others out; this says so too
        self._sock.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kvpool-lookup", daemon=True)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connections served now."""
        with self._lock:
            return self._open

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            reason = self._refusal(conn)
            if reason is not None:
                self._refuse(conn, reason)
                continue
            threading.Thread(
                target=self._serve, args=(conn,), name="kvpool-lookup-conn", daemon=True
            ).start()

    def _refusal(self, conn: socket.socket) -> str | None:
        """Why ``conn`` is not served (None: it is, and it counts toward the cap)."""
        try:
            uid = _peer_uid(conn)
        except OSError as exc:
            return f"AuthError: lookup channel: cannot tell who connected ({exc})"
        if uid != os.geteuid():
            return (
                f"AuthError: lookup channel {self.path} serves only user {os.geteuid()}'s "
                f"processes, not user {uid}'s"
            )
        with self._lock:
            if self._open >= self.max_connections:
                return (
                    f"Overloaded: lookup channel {self.path} is serving its limit of "
                    f"{self.max_connections} connections; close idle ones"
                )
            self._open += 1
        return None

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, ...: a flood logs little
            self._log.warning("refusing a lookup connection (%d so far): %s", self.refused, reason)
        self._refusing.start(conn, functools.partial(self._answer_refused, reason=reason))

    def _answer_refused(self, conn: socket.socket, reason: str) -> None:
        # Read the request first: closing a Unix socket before the peer has sent would
        # fail its send (EPIPE) before it could read why.
        with conn, contextlib.suppress(KVPoolError, OSError):
            framing.recv_request(conn, LOOKUP_CODEC, _REFUSE_S, _REFUSE_S)
            deadline = framing.deadline_after(_REFUSE_S)
            framing.send_frame(conn, REPLY_CODEC, Failed(reason), None, deadline)

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._conversation(conn)
        finally:
            with self._lock:
                self._open -= 1

    def _conversation(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    got = framing.recv_request(conn, LOOKUP_CODEC, _REQUEST_TIMEOUT_S, None)
                except KVPoolError:  # a bad header, a closed or stuck peer: drop it
                    return
                if got is None:
                    return
                reply: Found | Present | Failed
                if isinstance(got, framing.BadRequest):
                    reply = Failed(f"ProtocolError: {got.error}")
                else:
                    try:
                        reply = _answer(self._pool, got[0])
                    except Exception as exc:  # the scheduler treats any error as a miss
                        reply = Failed(f"{type(exc).__name__}: {exc}")
                try:
                    deadline = framing.deadline_after(_REQUEST_TIMEOUT_S)
                    framing.send_frame(conn, REPLY_CODEC, reply, None, deadline)
                except KVPoolError:
                    return

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=5)


class LookupClient(Closing):
    """The scheduler's view of the embedded pool over the channel: a
    :class:`~kvpool.engines.PoolLookups` that answers ``prefix_lookup``, ``batch_exists``,
    ``pin`` and ``release``."""

    engine = "embedded"

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self._path = path
        self._timeout_s = timeout_s
        try:
            private_dir(path, create=False)  # else the socket may be another user's
        except ConfigError as exc:
            raise TransferError(f"lookup channel {path} not reachable: {exc}") from None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise TransferError(f"lookup channel {path} not reachable: {exc}") from exc

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self._count(Lookup(list(keys)))

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        return self._count(PinKeys(list(keys), owner, ttl_ms)) if keys else 0

    def release(self, owner: str) -> int:
        return self._count(ReleasePins(owner))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        reply = self._ask(Probe(list(keys)))
        if not isinstance(reply, Present) or len(reply.flags) != len(keys):
            raise ProtocolError(f"lookup channel {self._path}: a probe's answer does not fit")
        return [bool(flag) for flag in reply.flags]

    def _count(self, request: _Request) -> int:
        reply = self._ask(request)
        if not isinstance(reply, Found):
            raise ProtocolError(f"lookup channel {self._path}: a count was expected")
        return reply.count

    def _ask(self, request: _Request) -> Found | Present:
        try:
            reply, _ = framing.call(self._sock, LOOKUP_CODEC, REPLY_CODEC, request, self._timeout_s)
        except PeerTimeout as exc:
            raise PeerTimeout(f"lookup channel {self._path}: no answer in time") from exc
        except (TransferError, ProtocolError) as exc:
            raise TransferError(f"lookup channel {self._path}: {exc}") from exc
        if isinstance(reply, Failed):
            raise TransferError(f"{type(request).__name__} failed in the worker: {reply.message}")
        return reply

    def health(self) -> dict[str, Any]:
        return {"lookup_channel": self._path}

    def close(self) -> None:
        self._sock.close()
