"""What the tests run on the client host, inside its namespace (through an
:class:`~kvpool.testing.agent.Agent`): a kvpool.Client, reads that check their own bytes,
and a traffic loop that records every operation.

Values are derived from their key (:func:`value_of`), so a read is checked where it
happens and only its outcome crosses the pipe: ``"hit"`` (bytes equal), ``"wrong"``
(bytes differ: the one outcome no scenario allows), ``"miss"``, or ``"error:<class>"``.
Times are ``time.monotonic()``, one clock for every namespace of the machine, so the
test compares them with the moment it cut a link.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from dataclasses import dataclass

from kvpool import Client
from kvpool.errors import KVPoolError, ObjectNotFound
from kvpool.protocol import messages as m


def value_of(key: str, size: int) -> bytes:
    """``size`` bytes that only ``key`` gives (repeated blake2b blocks of the key)."""
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (block * (size // len(block) + 1))[:size]


def open_client(master: str, timeout_s: float, replica_num: int = 0) -> Client:
    # TCP only: a test host shares /dev/shm with every other one, a real host does not
    return Client(master, timeout_s=timeout_s, allow_shm=False, replica_num=replica_num)


@dataclass(frozen=True)
class Op:
    """One operation: what, on which key, when it started and how long it took."""

    op: str  # "put" or "get"
    key: str
    started: float
    seconds: float
    outcome: str  # "ok", "hit", "wrong", "miss", "error:<class>"


def put(client: Client, key: str, size: int) -> Op:
    started = time.monotonic()
    try:
        client.put(key, value_of(key, size))
        outcome = "ok"
    except KVPoolError as exc:
        outcome = f"error:{type(exc).__name__}"
    return Op("put", key, started, time.monotonic() - started, outcome)


def get(client: Client, key: str, size: int) -> Op:
    started = time.monotonic()
    try:
        data = client.get(key)
        outcome = "hit" if data == value_of(key, size) else "wrong"
    except ObjectNotFound:
        outcome = "miss"
    except KVPoolError as exc:
        outcome = f"error:{type(exc).__name__}"
    return Op("get", key, started, time.monotonic() - started, outcome)


def owner(client: Client, key: str) -> str:
    """The data address of the node holding ``key`` ("" when nobody does)."""
    placement = client.call(m.Get(f"{client.client_id}#where", key))
    assert isinstance(placement, m.Placement)
    client.call(m.Release(f"{client.client_id}#where", [key]))
    return placement.data_address if placement.placed else ""


def nodes(client: Client) -> list[str]:
    """Data addresses of the storage nodes the master lists now."""
    return sorted(c["address"] for c in client.stats()["clients"] if c["address"])


class Traffic:
    """A thread that reads ``keys`` round-robin and puts a fresh key between reads,
    ``pause_s`` apart, until :meth:`stop`; every operation is recorded (at most
    ``max_ops``, so a long run stays bounded)."""

    def __init__(
        self,
        client: Client,
        keys: list[str],
        size: int,
        pause_s: float,
        max_ops: int = 5000,
        prefix: str = "traffic",
    ) -> None:
        self.client, self.keys, self.size, self.pause_s = client, keys, size, pause_s
        self.prefix = prefix  # of the fresh keys it puts
        self.ops: list[Op] = []
        self.max_ops = max_ops
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set() and len(self.ops) < self.max_ops:
            self.ops.append(get(self.client, self.keys[n % len(self.keys)], self.size))
            self.ops.append(put(self.client, f"{self.prefix}-{n}", self.size))
            n += 1
            self._stop.wait(self.pause_s)

    def since(self, t: float) -> list[Op]:
        """The operations recorded so far that started at or after ``t``."""
        return [op for op in list(self.ops) if op.started >= t]

    def stop(self, timeout_s: float = 30.0) -> list[Op]:
        self._stop.set()
        self._thread.join(timeout_s)
        return list(self.ops)

    def close(self) -> None:
        self.stop()


def refusals(master: str, data_addresses: list[str], credential: str | None) -> dict[str, str]:
    """What each port of the pool answers a peer on this host holding ``credential``
    (``None``: none at all, whatever the environment says): ``"refused"`` when it says
    no in its own protocol's words, else what it did instead."""
    from kvpool.errors import AuthError
    from kvpool.net import http_get, split_address
    from kvpool.protocol.codec import HEADER_SIZE
    from kvpool.protocol.data import DATA_REPLY_CODEC, DATA_REQUEST_CODEC, Error, SegmentRead

    outcomes: dict[str, str] = {}
    saved = os.environ.pop("KVPOOL_SECRET_FILE", None)  # this call's credential only
    try:
        try:
            with Client(master, credential=credential, timeout_s=5, allow_shm=False) as c:
                c.exists("victim")
            outcomes["master rpc"] = "answered"
        except AuthError:
            outcomes["master rpc"] = "refused"
        for path in ("/api/status", "/metrics"):
            status = http_get(f"http://{master}{path}", timeout_s=5).status
            outcomes[f"master http {path}"] = "refused" if status == 401 else f"http {status}"
        for address in data_addresses:
            with socket.create_connection(split_address(address), timeout=5) as s:
                s.sendall(DATA_REQUEST_CODEC.encode(SegmentRead("any", 0, 1 << 20)))
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            header = DATA_REPLY_CODEC.decode_header(data[:HEADER_SIZE])
            body = data[HEADER_SIZE : HEADER_SIZE + header.body_length]
            reply = DATA_REPLY_CODEC.decode_body(body)
            refused = isinstance(reply, Error) and reply.code == AuthError.code
            refused = refused and header.payload_length == 0
            outcomes[f"data {address}"] = "refused" if refused else repr(reply)
    finally:
        if saved is not None:
            os.environ["KVPOOL_SECRET_FILE"] = saved
    return outcomes
