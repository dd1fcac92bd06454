"""``kvpool.Client``: the synchronous pool client.

Put path: ``PutStart`` (the master reserves space) → the bytes go straight to the owning
node's segment (shared memory on the same host, TCP otherwise) → ``PutEnd`` with the
xxh3 checksum makes the object visible.  Get path: ``Get`` (grants a read lease) →
direct read → checksum verified → ``Release``.

Requests whose answer the caller does not need — a lease release, a put's revoke, a
failure report — are *posted* (:meth:`Channel.post <kvpool.transfer.channel.Channel.post>`):
sent at once, their replies read just before the next call's own reply.  So a get costs
one metadata round trip, and the master has dropped its lease by the time this client's
next call returns (requests of one connection are handled in order; other connections
may still see the lease for the moment the release is in flight).

A read that fails in any way — missing, corrupt, node unreachable — is a miss
(:class:`~kvpool.errors.ObjectNotFound`), never wrong bytes; a node that failed a transfer
is reported to the master, which drops its objects at once.

Thread-safe: metadata calls are serialised on one connection; data paths are per node.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, ClassVar

from kvpool.errors import (
    ChecksumMismatch,
    KVPoolError,
    ObjectNotFound,
    PeerTimeout,
    StaleWrite,
    TransferError,
    error_from_code,
)
from kvpool.net import DEFAULT_MASTER_PORT, split_address
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error
from kvpool.service.local_storage import checksum
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.transfer import framing
from kvpool.transfer.channel import Channel
from kvpool.transfer.path import NodeDataPath

__all__ = ["Client"]

log = logging.getLogger("kvpool.client")

CLOSE_SETTLE_S = 1.0
# A put hashes its value while PutStart is in flight (the round trip is spent waiting
# anyway), under the metadata lock; beyond this size hashing outlasts a round trip and
# would hold up other threads' calls, so it waits until after.
OVERLAP_CHECKSUM_MAX = 4 << 20


def _owed_reply(reply: m.MasterReply) -> None:
    """The reply to a posted request: only an error is worth a word, and not a loud one
    (a release of a lease that already expired is no one's problem)."""
    if isinstance(reply, Error):
        log.debug("a request sent without waiting failed: %s: %s", reply.code, reply.message)



class Client:
    """A connection to a kvpool master and direct data paths to its nodes."""

    #: values up to this size are hashed while their PutStart is in flight
    overlap_checksum_max = OVERLAP_CHECKSUM_MAX
    #: False for a subclass with a ``call`` of its own (the embedded pool runs the
    #: master's handler in-process): it has no channel to post on or to overlap with
    _pipelined: ClassVar[bool] = True

    def __init__(
        self,
        master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}",
        *,
        timeout_s: float = 10.0,
        client_id: str | None = None,
        allow_shm: bool = True,
    ) -> None:
        self.master = master
        self.timeout_s = timeout_s
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.allow_shm = allow_shm
        self._channel: Channel[m.MasterRequest, m.MasterReply] | None = None
        self._lock = threading.Lock()
        self._paths: dict[str, NodeDataPath] = {}
        self._paths_lock = threading.Lock()
        self._reads = itertools.count()
        self.corrupt_reads = 0

    # ---------------------------------------------------------------------------- plumbing
    def call(self, request: m.MasterRequest) -> m.MasterReply:
        """One metadata round trip; raises the master's error as its own class."""
        return self._call(request, None)

    def _call(
        self, request: m.MasterRequest, meanwhile: Callable[[], object] | None
    ) -> m.MasterReply:
        """:meth:`call`, running ``meanwhile`` while the master handles the request."""
        with self._lock:
            channel = self._connected()
            try:
                reply, payload = channel.call(request, meanwhile=meanwhile)
                if payload:
                    channel.discard_payload(payload)
            except KVPoolError:
                self._drop()
                raise
        if isinstance(reply, Error):
            raise reply.to_exception()
        return reply

    def _connected(self) -> Channel[m.MasterRequest, m.MasterReply]:
        if self._channel is None:
            host, port = split_address(self.master)
            try:
                sock = socket.create_connection((host, port), timeout=self.timeout_s)
            except TimeoutError:
                raise PeerTimeout(f"connecting to the master at {self.master} timed out") from None
            except OSError as exc:
                raise TransferError(f"cannot reach the master at {self.master}: {exc}") from None
            framing.tune_socket(sock)
            self._channel = Channel(
                sock, m.MASTER_REQUEST_CODEC, m.MASTER_REPLY_CODEC, self.timeout_s, _owed_reply
            )
        return self._channel

    def _post(self, request: m.MasterRequest) -> None:
        """Send a request whose answer nobody needs, without waiting for it.  Failing to
        send is not the caller's problem either: what it undoes expires on the master."""
        if not self._pipelined:
            with contextlib.suppress(KVPoolError):
                self.call(request)
            return
        with self._lock:
            try:
                self._connected().post(request)
            except KVPoolError as exc:
                self._drop()
                log.debug("%s not sent: %s", type(request).__name__, exc)

    def _drop(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _path(self, placement: m.Placement) -> NodeDataPath:
        address = placement.data_address
        with self._paths_lock:
            path = self._paths.get(address)
            if path is None:
                host, port = split_address(address)
                path = NodeDataPath(host, port, timeout_s=self.timeout_s, allow_shm=self.allow_shm)
                self._paths[address] = path
            return path

    def _report(self, placement: m.Placement, exc: BaseException) -> None:
        self._post(m.ReportFailure(placement.segment_id, f"{type(exc).__name__}: {exc}"))
        with self._paths_lock:
            path = self._paths.pop(placement.data_address, None)
        if path is not None:
            path.close()

    # ------------------------------------------------------------------------------ writes
    def put_from(self, key: str, buffer: Any, *, parent: str | None = None) -> None:
        """Store ``buffer`` (bytes-like, NumPy array, CPU tensor) under ``key``.

        A key that is already stored is left as is (same key, same content).
        """
        view = byte_view(buffer)
        digest = 0

        def hash_value() -> None:
            nonlocal digest
            digest = checksum(view)

        start = m.PutStart(self.client_id, key, len(view), parent)
        overlap = self._pipelined and len(view) <= self.overlap_checksum_max
        placement = self._call(start, hash_value) if overlap else self.call(start)
        assert isinstance(placement, m.Placement)
        if not placement.placed:
            return  # already stored: same key, same content
        if not overlap:
            hash_value()
        try:
            self._path(placement).write(
                placement.segment_id, placement.offset, view, shm_name=placement.shm_name
            )
        except (TransferError, PeerTimeout) as exc:
            self._report(placement, exc)
            self._revoke(key)
            raise
        except BaseException:
            self._revoke(key)
            raise
        self.call(m.PutEnd(self.client_id, key, digest))

    put = put_from

    def _revoke(self, key: str) -> None:
        self._post(m.PutRevoke(self.client_id, key))  # the writer lease expires anyway

    def batch_put(self, keys: Sequence[str], values: Sequence[Any]) -> list[KVPoolError | None]:
        """Put several objects in two metadata round trips; one result per key (None for
        success, or for a key that was already stored)."""
        views = [byte_view(v) for v in values]
        if len(views) != len(keys):
            raise ValueError("keys and values differ in length")
        reply = self.call(m.BatchPutStart(self.client_id, list(keys), [len(v) for v in views]))
        assert isinstance(reply, m.Placements)
        results: list[KVPoolError | None] = [None] * len(keys)
        by_node: dict[str, list[int]] = {}
        for i, placement in enumerate(reply.items):
            if placement.error:
                results[i] = error_from_code(placement.error, f"{keys[i]}: refused")
            elif placement.placed:
                by_node.setdefault(placement.data_address, []).append(i)
        written: list[int] = []
        for indices in by_node.values():
            first = reply.items[indices[0]]
            items = [(reply.items[i].segment_id, reply.items[i].offset, views[i]) for i in indices]
            try:
                done = self._path(first).write_many(items)
            except (TransferError, PeerTimeout) as exc:
                self._report(first, exc)
                done = [exc] * len(indices)
            for i, failure in zip(indices, done, strict=True):
                if failure is None:
                    written.append(i)
                else:
                    results[i] = failure
                    self._revoke(keys[i])
        if written:
            ended = self.call(
                m.BatchPutEnd(
                    self.client_id,
                    [keys[i] for i in written],
                    [checksum(views[i]) for i in written],
                )
            )
            assert isinstance(ended, m.Bools)
            for i, ok in zip(written, ended.values, strict=True):
                if not ok:
                    results[i] = StaleWrite(f"{keys[i]}: the reservation expired")
        return results

    # ------------------------------------------------------------------------------- reads
    def get_into(self, key: str, buffer: Any) -> int:
        """Fill the front of ``buffer`` with the object; returns its size.

        Raises ObjectNotFound on a miss, including a corrupt or unreachable copy.
        """
        owner = f"{self.client_id}#{next(self._reads)}"
        placement = self.call(m.Get(owner, key))
        assert isinstance(placement, m.Placement)
        if not placement.placed:
            raise ObjectNotFound(key)
        try:
            return self._read(placement, writable_byte_view(buffer))
        finally:
            self._finish_read(owner, key)

    def _finish_read(self, owner: str, key: str) -> None:
        """Release the read lease.  A copy that failed its checksum stays where it is: the
        caller decides (the store connector removes it so its recomputed copy replaces it,
        and counts that in its own stats)."""
        self._post(m.Release(owner, [key]))

    def _read(self, placement: m.Placement, dst: memoryview) -> int:
        size = placement.size
        if len(dst) < size:
            raise ValueError(f"buffer of {len(dst)} bytes is too small for {size}")
        target = dst[:size]
        path = self._path(placement)
        try:
            if placement.tier == "ssd":
                path.tcp.ssd_read_into(placement.key, target)
            else:
                path.read_into(
                    placement.segment_id, placement.offset, target, shm_name=placement.shm_name
                )
        except ChecksumMismatch as exc:
            # the node answered: its copy is corrupt, the node itself is fine (reporting it
            # would drop every object it holds)
            self.corrupt_reads += 1
            raise ObjectNotFound(f"{placement.key}: {exc}") from exc
        except (TransferError, PeerTimeout) as exc:
            self._report(placement, exc)
            raise ObjectNotFound(f"{placement.key}: read failed ({exc})") from exc
        except ObjectNotFound:
            raise
        except KVPoolError as exc:
            raise ObjectNotFound(f"{placement.key}: read failed ({exc})") from exc
        if checksum(target) != placement.checksum:
            self.corrupt_reads += 1
            log.warning("%s failed its checksum: treated as a miss", placement.key)
            raise ObjectNotFound(f"{placement.key}: checksum mismatch")
        return size

    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound on a miss."""
        owner = f"{self.client_id}#{next(self._reads)}"
        placement = self.call(m.Get(owner, key))
        assert isinstance(placement, m.Placement)
        if not placement.placed:
            raise ObjectNotFound(key)
        try:
            buf = bytearray(placement.size)
            self._read(placement, memoryview(buf))
            return bytes(buf)
        finally:
            self._finish_read(owner, key)

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read several objects; the size read per key, or -1 for a miss."""
        owner = f"{self.client_id}#{next(self._reads)}"
        reply = self.call(m.BatchGet(owner, list(keys)))
        assert isinstance(reply, m.Placements)
        sizes: list[int] = []
        try:
            for placement, buffer in zip(reply.items, buffers, strict=True):
                if not placement.placed:
                    sizes.append(-1)
                    continue
                try:
                    sizes.append(self._read(placement, writable_byte_view(buffer)))
                except ObjectNotFound:
                    sizes.append(-1)
        finally:
            self._post(m.ReleaseOwner(owner))
        return sizes

    def batch_get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self.get(key))
            except ObjectNotFound:
                out.append(None)
        return out

    # ------------------------------------------------------------------------------ probes
    def exists(self, key: str) -> bool:
        """Whether a READY object is stored under ``key``; takes no lease."""
        reply = self.call(m.Exists(key))
        assert isinstance(reply, m.Bools)
        return reply.values[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        reply = self.call(m.BatchExists(list(keys)))
        assert isinstance(reply, m.Bools)
        return reply.values

    def prefix_lookup(self, keys: Sequence[str], tokens_per_key: int = 0) -> int:
        """How many leading keys are stored; takes no lease."""
        reply = self.call(m.PrefixLookup(list(keys), tokens_per_key))
        assert isinstance(reply, m.Count)
        return reply.value

    def remove(self, key: str) -> bool:
        """Remove an object; False when there was none.  Raises ObjectBusy if it is read now."""
        try:
            self.call(m.Remove(key))
        except ObjectNotFound:
            return False
        return True

    def pin(self, keys: Sequence[str], owner: str, ttl_ms: int) -> int:
        reply = self.call(m.Pin(owner, list(keys), ttl_ms))
        assert isinstance(reply, m.Count)
        return reply.value

    def release_owner(self, owner: str) -> int:
        reply = self.call(m.ReleaseOwner(owner))
        assert isinstance(reply, m.Count)
        return reply.value

    def stats(self) -> dict[str, Any]:
        reply = self.call(m.Stats())
        assert isinstance(reply, m.StatsReply)
        return reply.snapshot

    # ---------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        with self._lock:
            if self._channel is not None:
                # Read the owed replies first: closing a socket with unread bytes resets
                # the connection, and a reset can discard a release the master has not
                # read yet.  Bounded, so a hung master does not hold up the close.
                try:
                    self._channel.settle(min(self.timeout_s, CLOSE_SETTLE_S))
                except KVPoolError as exc:
                    log.debug("replies owed at close not read: %s", exc)
            self._drop()
        with self._paths_lock:
            paths = list(self._paths.values())
            self._paths.clear()
        for path in paths:
            path.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
