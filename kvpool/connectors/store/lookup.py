"""The scheduler↔worker lookup channel of the embedded backend (the seed's lookup_rpc_port).

With ``backend: embedded`` the pool lives inside vLLM's worker process, but lookups come
from the scheduler, which ``vllm serve`` runs in another process (EngineCore).  The worker
therefore answers ``prefix_lookup`` on a Unix socket, and the scheduler half asks there.
(With a master, both halves talk to the master and this channel is not used.)

The socket's name is derived from what both halves share and no other instance has: vLLM's
``instance_id`` (a nanosecond timestamp taken when the config is made), the ``engine_id``,
the data-parallel rank and ``lookup_rpc_port``.  So ``"lookup_rpc_port": "0"`` (or any
value) never collides between two instances on one host — not even a P and a D that share
an ``engine_id`` as the seed pairs them — and no TCP port is taken.

Wire format, one request per round trip on a persistent connection: a 4-byte little-endian
length, then msgpack ``[keys...]``; the reply is a 4-byte length and msgpack ``int``
(the number of leading keys present), or ``str`` (an error message).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvpool.errors import PeerTimeout, ProtocolError, TransferError

__all__ = ["LookupClient", "LookupServer", "channel_path"]

_LEN = struct.Struct("<I")
_MAX_FRAME = 64 << 20  # a lookup of a 1M-token prompt is ~300 KiB; anything bigger is junk


def channel_path(
    *, instance_id: str, engine_id: str, dp_rank: int, lookup_rpc_port: int, root: str | None = None
) -> str:
    """The Unix socket of one vLLM instance's lookup channel (short: sun_path is 108 bytes)."""
    digest = hashlib.blake2b(
        f"{instance_id}|{engine_id}|{dp_rank}|{lookup_rpc_port}".encode(), digest_size=8
    ).hexdigest()
    base = Path(root or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return str(base / f"kvpool-lookup-{digest}.sock")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("lookup channel closed")
        got += k
    return bytes(buf)


def _send(sock: socket.socket, payload: Any) -> None:
    data = msgspec.msgpack.encode(payload)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > _MAX_FRAME:
        raise ProtocolError(f"lookup frame of {n} bytes is over the {_MAX_FRAME}-byte limit")
    return msgspec.msgpack.decode(_recv_exact(sock, n))


class LookupServer:
    """Answers ``prefix_lookup`` for the scheduler, from a thread of the worker process."""

    def __init__(
        self, path: str, lookup: Callable[[list[str]], int], logger: logging.Logger
    ) -> None:
        self.path = path
        self._lookup = lookup
        self._log = logger
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a leftover of this very instance (names are per instance)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kvpool-lookup", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve, args=(conn,), name="kvpool-lookup-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    keys = _recv(conn)
                except (EOFError, OSError, ProtocolError, msgspec.DecodeError):
                    return
                try:
                    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
                        raise ProtocolError("a lookup is a list of key strings")
                    reply: int | str = int(self._lookup(keys))
                except Exception as exc:  # the scheduler treats any error as a miss
                    reply = f"{type(exc).__name__}: {exc}"
                try:
                    _send(conn, reply)
                except OSError:
                    return

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._thread.join(timeout=5)


class LookupClient:
    """The scheduler's view of the embedded pool: ``prefix_lookup`` only, over the channel."""

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self._path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise TransferError(f"lookup channel {path} not reachable: {exc}") from exc

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        try:
            _send(self._sock, list(keys))
            reply = _recv(self._sock)
        except TimeoutError as exc:
            raise PeerTimeout(f"lookup channel {self._path}: no answer in time") from exc
        except (OSError, EOFError) as exc:
            raise TransferError(f"lookup channel {self._path}: {exc}") from exc
        if isinstance(reply, str):
            raise TransferError(f"lookup failed in the worker: {reply}")
        return int(reply)

    def put_from(self, key: str, buffer: Any, *, parent: str | None = None) -> None:
        raise NotImplementedError("the lookup channel only answers lookups")

    def get_into(self, key: str, buffer: Any) -> int:
        raise NotImplementedError("the lookup channel only answers lookups")

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError("the lookup channel only answers lookups")

    def remove(self, key: str) -> bool:
        raise NotImplementedError("the lookup channel only answers lookups")

    def close(self) -> None:
        self._sock.close()
