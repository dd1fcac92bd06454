"""The scheduler↔worker lookup channel of the embedded backend (vllm-ascend's ``lookup_rpc_port``).

With ``backend: embedded`` the pool lives inside vLLM's worker process, but lookups come
from the scheduler, which ``vllm serve`` runs in another process (EngineCore).  The worker
therefore answers ``prefix_lookup`` on a Unix socket, and the scheduler half asks there;
it also takes and ends the pins of a request's hit there (``pin``, ``release``), since the
scheduler pins what its lookup found.  (With a master, both halves talk to the master and
this channel is not used.)

The socket's name is derived from what both halves share and no other instance has: vLLM's
``instance_id`` (a nanosecond timestamp taken when the config is made), the ``engine_id``,
the data-parallel rank and ``lookup_rpc_port``.  So ``"lookup_rpc_port": "0"`` (or any
value) never collides between two instances on one host — not even a P and a D that share
an ``engine_id`` as the production guide pairs them — and no TCP port is taken.

Wire format: kvpool's frames (:mod:`kvpool.protocol.codec`), one request per round trip
on a persistent connection: a :class:`Lookup` (the keys), a :class:`PinKeys` or a
:class:`ReleasePins`, answered by a :class:`Found` (how many leading keys are present,
pinned, or released) or a :class:`Failed` (the worker's error message).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvpool.engines import PoolEngine
from kvpool.errors import KVPoolError, PeerTimeout, ProtocolError, TransferError
from kvpool.protocol.codec import Codec
from kvpool.transfer import framing

__all__ = [
    "LOOKUP_CODEC",
    "REPLY_CODEC",
    "Failed",
    "Found",
    "Lookup",
    "LookupClient",
    "LookupServer",
    "PinKeys",
    "ReleasePins",
    "channel_path",
]


class Lookup(msgspec.Struct, frozen=True, tag=True):
    """How many leading ``keys`` does the pool hold?"""

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


class Failed(msgspec.Struct, frozen=True, tag=True):
    """The lookup raised in the worker (the scheduler counts it as a miss)."""

    message: str


# A lookup of a 1M-token prompt is ~300 KiB; anything over 64 MiB is junk.
LOOKUP_CODEC: Codec[Lookup | PinKeys | ReleasePins] = Codec(
    Lookup | PinKeys | ReleasePins, max_body=64 << 20, max_payload=0
)
REPLY_CODEC: Codec[Found | Failed] = Codec(Found | Failed, max_payload=0)
# Once a request has started, the rest of it must arrive within this long.
_REQUEST_TIMEOUT_S = 30.0


def channel_path(
    *, instance_id: str, engine_id: str, dp_rank: int, lookup_rpc_port: int, root: str | None = None
) -> str:
    """The Unix socket of one vLLM instance's lookup channel (short: sun_path is 108 bytes)."""
    digest = hashlib.blake2b(
        f"{instance_id}|{engine_id}|{dp_rank}|{lookup_rpc_port}".encode(), digest_size=8
    ).hexdigest()
    base = Path(root or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    return str(base / f"kvpool-lookup-{digest}.sock")


def _answer(pool: PoolEngine, request: Lookup | PinKeys | ReleasePins) -> int:
    if isinstance(request, Lookup):
        return pool.prefix_lookup(request.keys)
    if isinstance(request, PinKeys):
        return pool.pin(request.keys, request.owner, request.ttl_ms)
    return pool.release(request.owner)


class LookupServer:
    """Answers the scheduler's lookups, pins and releases on ``pool``, from a thread of the
    worker process."""

    def __init__(self, path: str, pool: PoolEngine, logger: logging.Logger) -> None:
        self.path = path
        self._pool = pool
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
                    got = framing.recv_request(conn, LOOKUP_CODEC, _REQUEST_TIMEOUT_S, None)
                except KVPoolError:  # a bad header, a closed or stuck peer: drop it
                    return
                if got is None:
                    return
                reply: Found | Failed
                if isinstance(got, framing.BadRequest):
                    reply = Failed(f"ProtocolError: {got.error}")
                else:
                    try:
                        reply = Found(int(_answer(self._pool, got[0])))
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


class LookupClient:
    """The scheduler's view of the embedded pool over the channel: ``prefix_lookup``,
    ``pin`` and ``release``."""

    engine = "embedded"

    def __init__(self, path: str, *, timeout_s: float) -> None:
        self._path = path
        self._timeout_s = timeout_s
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise TransferError(f"lookup channel {path} not reachable: {exc}") from exc

    def prefix_lookup(self, keys: Sequence[str]) -> int:
        return self._ask(Lookup(list(keys)))

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        return self._ask(PinKeys(list(keys), owner, ttl_ms)) if keys else 0

    def release(self, owner: str) -> int:
        return self._ask(ReleasePins(owner))

    def _ask(self, request: Lookup | PinKeys | ReleasePins) -> int:
        try:
            reply, _ = framing.call(self._sock, LOOKUP_CODEC, REPLY_CODEC, request, self._timeout_s)
        except PeerTimeout as exc:
            raise PeerTimeout(f"lookup channel {self._path}: no answer in time") from exc
        except (TransferError, ProtocolError) as exc:
            raise TransferError(f"lookup channel {self._path}: {exc}") from exc
        if isinstance(reply, Failed):
            raise TransferError(f"{type(request).__name__} failed in the worker: {reply.message}")
        return reply.count

    # The rest of PoolEngine: the scheduler half only looks up and pins.
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        raise NotImplementedError("the lookup channel only answers lookups")

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffers: Sequence[Any],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        raise NotImplementedError("the lookup channel only answers lookups")

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        raise NotImplementedError("the lookup channel only answers lookups")

    def batch_put_from_parts(
        self,
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        *,
        parents: Sequence[str | None] | None = None,
    ) -> list[KVPoolError | None]:
        raise NotImplementedError("the lookup channel only answers lookups")

    def batch_get_into_parts(
        self, keys: Sequence[str], parts: Sequence[Sequence[Any]]
    ) -> list[int]:
        raise NotImplementedError("the lookup channel only answers lookups")

    def remove(self, key: str) -> bool:
        raise NotImplementedError("the lookup channel only answers lookups")

    def health(self) -> dict[str, Any]:
        return {"lookup_channel": self._path}

    def close(self) -> None:
        self._sock.close()
