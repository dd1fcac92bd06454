"""``kvpool.Client``: the synchronous pool client (put, get, batches, exists, stats)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import ssl
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.client.leader_link import master_link
from kvpool.client.master_link import CLOSE_SETTLE_S, MasterLink
from kvpool.closing import Closing
from kvpool.datapath.data_ops import DataOp, OpResult, ReadOp, SsdReadOp, WriteOp, sole_result
from kvpool.datapath.transport import DataPath, Transport, transport_named
from kvpool.errors import (
    ChecksumMismatch,
    KVPoolError,
    ObjectNotFound,
    PeerTimeout,
    PoolError,
    StaleWrite,
    TransferError,
    error_from_code,
)
from kvpool.net import DEFAULT_MASTER_PORT
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.security.secret import load_credential
from kvpool.security.tls import TLSConfig
from kvpool.storage.buffers import byte_view, writable_byte_view
from kvpool.storage.checksum import Hasher, checksum, hasher
from kvpool.tenancy.data_path import TenantTransport

__all__ = ["CLOSE_SETTLE_S", "OVERLAP_CHECKSUM_MAX", "Client"]

log = logging.getLogger("kvpool.client")

_T = TypeVar("_T")  # what a batch read fills per key: a buffer, or a list of parts

# A put hashes its value while PutStart is in flight (the round trip is spent waiting
# anyway), under the metadata lock; beyond this size hashing outlasts a round trip and
# would hold up other threads' calls, so it waits until after.
OVERLAP_CHECKSUM_MAX = 4 << 20


def _empty(key: str) -> PoolError:
    return PoolError(f"{key}: the value is empty (an object needs at least one byte)")


class Client(Closing):
    """A connection to a kvpool master and direct data paths to its nodes.

    ``transport`` chooses how bytes reach the segments: a
    :class:`~kvpool.datapath.transport.Transport`, or its name in config (``"shm"``:
    shared memory on this host and TCP for the rest; ``"tcp"``: TCP only).  Without it,
    ``allow_shm`` picks between those two.  ``link`` replaces the TCP connection to the
    master (the embedded pool's in-process handler); ``master`` is then only a label.

    Put path: ``PutStart`` (the master reserves space) → the bytes go straight to the owning
    node's segment through the client's transport (:mod:`kvpool.datapath.transport`: shared
    memory on the same host, TCP otherwise) → ``PutEnd`` with the xxh3 checksum makes the
    object visible.  Get path: ``Get`` (grants a read lease) →
    direct read → checksum verified → ``Release``.

    Requests whose answer the caller does not need — a lease release, a put's revoke, a
    failure report — are *posted* (:meth:`MasterLink.post
    <kvpool.client.master_link.MasterLink.post>`): sent at once, their replies read just
    before the next call's own reply.  So a get costs one metadata round trip, and the
    master has dropped its lease by the time this client's next call returns (requests of
    one connection are handled in order; other connections may still see the lease for the
    moment the release is in flight).

    A read that fails in any way — missing, corrupt, node unreachable — is a miss
    (:class:`~kvpool.errors.ObjectNotFound`), never wrong bytes; a node that failed a transfer
    is reported to the master, which drops its objects at once, and a copy that failed its
    checksum is reported too, so the master drops that copy and the next put stores the key
    again.  A put is acknowledged only once its bytes are in a segment whose owner is alive:
    the same-host path checks the owner's lock after copying (:mod:`kvpool.datapath.shm`).

    Values have at least one byte: an empty one is refused here, before any round trip,
    with :class:`~kvpool.errors.PoolError` (Mooncake refuses them too).

    Two seams, both set in the constructor: the *transport* (how bytes move) and the *link*
    to the master's request handler (TCP, or in-process for the embedded pool).

    Credentials: ``credential`` (a :class:`~kvpool.security.credentials.Credential`, or the
    secret's text), else the environment's (``KVPOOL_SECRET_FILE``, ``KVPOOL_SECRET``), else
    none.  With one, every connection -- to the master and to each node's data port -- opens
    with the handshake of :mod:`kvpool.security.handshake`; without one, none does (a pool on
    loopback with no secret).  A tenant's credential (``kvpool-tenant:...``) makes this a
    client of that tenant only: the master keeps its keys in the tenant's namespace, and its
    bytes move over TCP with the master's grants (:mod:`kvpool.tenancy.data_path`).

    Thread-safe: metadata calls are serialised on one connection; data paths are per node.
    """

    #: values up to this size are hashed while their PutStart is in flight
    overlap_checksum_max = OVERLAP_CHECKSUM_MAX

    def __init__(
        self,
        master: str = f"127.0.0.1:{DEFAULT_MASTER_PORT}",
        *,
        timeout_s: float = 10.0,
        client_id: str | None = None,
        allow_shm: bool = True,
        transport: Transport | str | None = None,
        link: MasterLink | None = None,
        credential: Credential | str | None = None,
        role: str = "client",
        tls: TLSConfig | ssl.SSLContext | None = None,
        replica_num: int = 0,
    ) -> None:
        self.master = master
        #: copies each put asks for, each on another node (0: the master's default)
        self.replica_num = replica_num
        self.client_id = client_id or f"client-{uuid.uuid4().hex[:12]}"
        self.allow_shm = allow_shm
        if isinstance(credential, str):
            credential = Credential.parse(credential, "credential")
        elif credential is None and link is None:
            credential = load_credential("", os.environ, key="secret_file")
        if tls is None and link is None:
            tls = TLSConfig.from_env()
        if isinstance(tls, TLSConfig):
            tls = tls.client_context()
        #: how every connection of this client is dialled: the master's and each node's
        self.peer = PeerSettings(timeout_s, credential, self.client_id, tls)
        if transport is None:
            transport = "shm" if allow_shm else "tcp"
        self.transport: Transport
        if credential is not None and credential.is_tenant and isinstance(transport, str):
            # a tenant's bytes move with the master's grants, over TCP only
            self.transport = TenantTransport(self.peer)
        elif isinstance(transport, str):
            self.transport = transport_named(transport, self.peer)
        else:
            self.transport = transport
        self.link: MasterLink = (
            link if link is not None else master_link(master, self.peer, role=role)
        )
        self._paths: dict[str, DataPath] = {}  # data address -> open data path
        self._paths_lock = threading.Lock()
        self._reads = itertools.count()
        self.corrupt_reads = 0

    # ---------------------------------------------------------------------------- plumbing
    def call(self, request: m.MasterRequest) -> m.MasterReply:
        """One metadata round trip; raises the master's error as its own class."""
        reply = self.link.call(request)
        if isinstance(reply, Error):
            raise reply.to_exception()
        return reply

    def _post(self, request: m.MasterRequest) -> None:
        """Send a request whose answer nobody needs, without waiting for it when the link
        pipelines.  Failing is not the caller's problem: what it undoes expires anyway."""
        if self.link.pipelined:
            self.link.post(request)
            return
        with contextlib.suppress(KVPoolError):
            self.call(request)

    def _path(self, placement: m.Placement) -> DataPath:
        return self._path_to(placement.data_address)

    def _path_to(self, address: str) -> DataPath:
        with self._paths_lock:
            path = self._paths.get(address)
            if path is None:
                path = self._paths[address] = self.transport.connect(address)
            return path

    def _report(self, placement: m.Placement, exc: BaseException) -> None:
        """A transfer to this placement's owner failed: tell the master (it drops the
        owner's objects at once) and open a fresh path next time."""
        self._post(m.ReportFailure(placement.segment_id, f"{type(exc).__name__}: {exc}"))
        with self._paths_lock:
            path = self._paths.pop(placement.data_address, None)
        if path is not None:
            path.close()

    # ------------------------------------------------------------------------------ writes
    def put_from(
        self, key: str, buffer: Any, *, parent: str | None = None, replica_num: int | None = None
    ) -> None:
        """Store ``buffer`` (bytes-like, NumPy array, CPU tensor) under ``key``, in
        ``replica_num`` copies on different nodes (None: the client's ``replica_num``).

        A key that is already stored is left as is (same key, same content).  An empty
        value is refused (PoolError).  With several copies the put is acknowledged once
        one is written; a copy that could not be written is left out.
        """
        view = byte_view(buffer)
        if not len(view):
            raise _empty(key)
        copies = self.replica_num if replica_num is None else replica_num
        # a new leader that took over between the put's start and its end never saw the
        # reservation: the put is done again there, once (a failover is a delay)
        if self._put_once(key, view, parent, copies) and self._put_once(key, view, parent, copies):
            raise StaleWrite(f"{key}: the master's leader changed twice during the put")

    put = put_from

    def _leader_epoch(self) -> int:
        """The highest leader epoch this client's link has seen (0 without HA masters)."""
        return int(getattr(self.link, "epoch", 0))

    def _put_once(self, key: str, view: memoryview, parent: str | None, copies: int) -> bool:
        """One put's start, writes and end.  True when its end met a newer leader than
        its start, which did not know the reservation; StaleWrite when the reservation
        is gone under the same leader (it expired or was revoked)."""
        digest = 0

        def hash_value() -> None:
            nonlocal digest
            digest = checksum(view)

        start = m.PutStart(self.client_id, key, len(view), parent, copies)
        overlap = self.link.pipelined and len(view) <= self.overlap_checksum_max
        placement = self.link.call(start, hash_value if overlap else None)
        if isinstance(placement, Error):
            raise placement.to_exception()
        assert isinstance(placement, m.Placement)
        if not placement.placed:
            return False  # already stored: same key, same content
        epoch = self._leader_epoch()  # of the leader that granted the reservation
        if not overlap:
            hash_value()
        noted = True
        unwritten: list[str] = []  # segments of the copies not written
        failure: KVPoolError | None = None
        every = [placement, *placement.replicas]
        for p in every:
            write = WriteOp(
                p.segment_id, p.offset, view, shm_name=p.shm_name, key=key, checksum=digest
            )
            try:
                # a noted write's result is the checksum its owner noted (None: not noted)
                noted = sole_result(self._path(p).run([write])) is not None and noted
            except (TransferError, PeerTimeout) as exc:
                self._report(p, exc)
                unwritten.append(p.segment_id)
                failure = exc
            except KVPoolError as exc:
                unwritten.append(p.segment_id)
                failure = exc
            except BaseException:
                self._revoke(key)
                raise
        if failure is not None and len(unwritten) == len(every):
            self._revoke(key)
            raise failure
        try:
            self.call(m.PutEnd(self.client_id, key, digest, noted, unwritten))
        except StaleWrite:
            if self._leader_epoch() == epoch:
                raise
            return True
        return False

    def _report_corrupt(self, placement: m.Placement) -> None:
        """This copy failed its checksum: the master drops it (the owner is fine)."""
        self.corrupt_reads += 1
        self._post(self._corrupt_report(placement))

    @staticmethod
    def _corrupt_report(placement: m.Placement) -> m.ReportCorrupt:
        p = placement
        return m.ReportCorrupt(p.key, p.segment_id, p.offset, p.checksum)

    def _revoke(self, key: str) -> None:
        self._post(m.PutRevoke(self.client_id, key))  # the writer lease expires anyway

    def batch_put(
        self,
        keys: Sequence[str],
        values: Sequence[Any],
        *,
        parents: Sequence[str | None] | None = None,
        replica_num: int | None = None,
    ) -> list[KVPoolError | None]:
        """Put several objects in two metadata round trips; one result per key (None for
        success, or for a key that was already stored).  ``parents`` names each key's
        parent block, as :meth:`put_from`'s ``parent`` does, and ``replica_num`` the
        copies of each, as there.  An empty value is that key's PoolError; a key given
        twice is stored once, and the second has the first's result."""
        views = [byte_view(v) for v in values]
        if len(views) != len(keys) or (parents is not None and len(parents) != len(keys)):
            raise ValueError("keys, values and parents differ in length")
        results: list[KVPoolError | None] = [None] * len(keys)
        first: dict[str, int] = {}  # key -> index of its first occurrence
        sent: list[int] = []  # indices asked for: non-empty, first of their key
        for i, key in enumerate(keys):
            if not len(views[i]):
                results[i] = _empty(key)
            elif first.setdefault(key, i) == i:
                sent.append(i)
        if sent:
            copies = self.replica_num if replica_num is None else replica_num
            epoch = self._batch_put(keys, views, parents, sent, results, copies)
            stale = [i for i in sent if isinstance(results[i], StaleWrite)]
            if stale and self._leader_epoch() != epoch:
                # as put_from: a new leader never saw these reservations; once more there
                for i in stale:
                    results[i] = None
                self._batch_put(keys, views, parents, stale, results, copies)
        for i, key in enumerate(keys):
            j = first.get(key, i)
            if j != i and len(views[i]):
                results[i] = results[j]
        return results

    def _batch_put(
        self,
        keys: Sequence[str],
        views: list[memoryview],
        parents: Sequence[str | None] | None,
        sent: list[int],
        results: list[KVPoolError | None],
        copies: int = 0,
    ) -> int:
        """The two round trips of :meth:`batch_put` for ``keys[i] for i in sent``; the
        epoch of the leader that granted the reservations."""
        chained = [parents[i] for i in sent] if parents is not None and any(parents) else []
        digests: dict[int, int] = {}

        def hash_values() -> None:
            for i in sent:
                digests[i] = checksum(views[i])

        # as put_from does: the values are hashed while BatchPutStart is in flight
        total = sum(len(views[i]) for i in sent)
        overlap = self.link.pipelined and total <= self.overlap_checksum_max
        start = m.BatchPutStart(
            self.client_id, [keys[i] for i in sent], [len(views[i]) for i in sent], chained, copies
        )
        reply = self.link.call(start, hash_values if overlap else None)
        if isinstance(reply, Error):
            raise reply.to_exception()
        assert isinstance(reply, m.Placements)
        epoch = self._leader_epoch()
        # each node's writes: (key's index, the copy of it that node is to hold)
        by_node: dict[str, list[tuple[int, m.Placement]]] = {}
        copies_of: dict[int, int] = {}  # key's index -> its copies to write
        for i, placement in zip(sent, reply.items, strict=True):
            if placement.error:
                results[i] = error_from_code(
                    placement.error, f"{keys[i]}: refused by the master ({placement.error})"
                )
            elif placement.placed:
                copies_of[i] = 1 + len(placement.replicas)
                for p in (placement, *placement.replicas):
                    by_node.setdefault(p.data_address, []).append((i, p))
        if not overlap:
            hash_values()  # before the writes: each carries its checksum to the node
        noted = True  # every value written went where its node noted it
        unwritten: dict[int, list[str]] = {}  # key's index -> segments of copies not written
        failures: dict[int, KVPoolError] = {}
        for entries in by_node.values():
            first = entries[0][1]
            path = self._path(first)
            writes = [
                WriteOp(
                    p.segment_id,
                    p.offset,
                    views[i],
                    shm_name=p.shm_name,
                    key=keys[i],
                    checksum=digests[i],
                )
                for i, p in entries
            ]
            done: Sequence[OpResult]
            try:
                done = path.run(writes)
            except (TransferError, PeerTimeout) as exc:
                self._report(first, exc)
                done = [exc] * len(entries)
            for (i, p), outcome in zip(entries, done, strict=True):
                if isinstance(outcome, KVPoolError):
                    failures[i] = outcome
                    unwritten.setdefault(i, []).append(p.segment_id)
                else:
                    noted = noted and outcome is not None  # its node noted it
        written: list[int] = []
        for i, count in copies_of.items():
            if len(unwritten.get(i, ())) == count:  # no copy of it was written
                results[i] = failures[i]
                self._revoke(keys[i])
            else:
                written.append(i)
        if written:
            lost = [unwritten.get(i, []) for i in written] if unwritten else []
            ended = self.call(
                m.BatchPutEnd(
                    self.client_id,
                    [keys[i] for i in written],
                    [digests[i] for i in written],
                    noted,
                    lost,
                )
            )
            assert isinstance(ended, m.Bools)
            for i, ok in zip(written, ended.values, strict=True):
                if not ok:
                    results[i] = StaleWrite(f"{keys[i]}: the reservation expired")
        return epoch

    # ------------------------------------------------------------------------------- reads
    # Every read is leased: Get (BatchGet for several keys) grants read leases to an owner
    # of the call's own, the bytes come straight from a segment and are checked against
    # the placement's checksum (each copy's verdict: _verdict), a key whose copy failed
    # and that has other copies is asked for again, and the leases are released (posted).
    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound on a miss."""
        return bytes(self._leased_read(key, lambda size: memoryview(bytearray(size))))

    def get_into(self, key: str, buffer: Any) -> int:
        """Fill the front of ``buffer`` with the object; returns its size.

        Raises ObjectNotFound on a miss, including a corrupt or unreachable copy.
        """
        return len(self._leased_read(key, lambda _size: writable_byte_view(buffer)))

    def _read_owner(self) -> str:
        """A fresh owner for one call's read leases."""
        return f"{self.client_id}#{next(self._reads)}"

    def _leased_read(self, key: str, target: Callable[[int], memoryview]) -> memoryview:
        """One key under a read lease: ``Get``, a copy read into ``target(size)``
        (:meth:`_read_a_copy`), the lease released; the view of the bytes read."""
        owner = self._read_owner()
        placement = self.call(m.Get(owner, key))
        assert isinstance(placement, m.Placement)
        if not placement.placed:
            raise ObjectNotFound(key)
        try:
            dst = target(placement.size)
            return dst[: self._read_a_copy(owner, placement, dst)]
        finally:
            self._finish_read(owner, key)

    def _read_a_copy(self, owner: str, placement: m.Placement, dst: memoryview) -> int:
        """:meth:`_read`, and where the copy failed and the object has others, ask again
        (the failed copy was reported, so the master grants another) and read that."""
        for _ in range(placement.copies - 1):
            try:
                return self._read(placement, dst)
            except ObjectNotFound:
                again = self.call(m.Get(owner, placement.key))
                assert isinstance(again, m.Placement)
                if not again.placed:
                    raise
                placement = again
        return self._read(placement, dst)

    def _finish_read(self, owner: str, key: str) -> None:
        """Release the read lease (a copy that failed its checksum was reported already,
        so the master has dropped it)."""
        self._post(m.Release(owner, [key]))

    def _read(self, placement: m.Placement, dst: memoryview) -> int:
        """One copy into the front of ``dst``: its size, or ObjectNotFound (the copy's
        :meth:`_verdict` was given)."""
        size = placement.size
        if len(dst) < size:
            raise ValueError(f"buffer of {len(dst)} bytes is too small for {size}")
        target = dst[:size]
        path = self._path(placement)
        p = placement
        op: DataOp = (
            SsdReadOp(p.key, target, p.segment_id)
            if p.tier == "ssd"
            else ReadOp(p.segment_id, p.offset, target, shm_name=p.shm_name, checked=True)
        )
        outcome: OpResult
        try:
            outcome = sole_result(path.run([op]))
            if outcome is None:  # an SSD read: hashed once it is in
                outcome = checksum(target)
        except KVPoolError as exc:
            outcome = exc  # this copy's, whether the op or the whole list failed
        if self._verdict(placement, outcome):
            return size
        if isinstance(outcome, ObjectNotFound):
            raise outcome
        if not isinstance(outcome, KVPoolError):
            raise ObjectNotFound(f"{p.key}: checksum mismatch")
        why = str(outcome) if isinstance(outcome, ChecksumMismatch) else f"read failed ({outcome})"
        raise ObjectNotFound(f"{p.key}: {why}") from outcome

    def _verdict(self, placement: m.Placement, outcome: OpResult, *, report: bool = True) -> bool:
        """Whether one copy's read is good: ``outcome`` is the checksum of what landed,
        or the error the read met.  A bad read is a miss, never wrong bytes.  A copy that
        failed its checksum, or that its owner answered it does not have (an SSD file
        gone behind the pool's back), is reported: the master drops that copy, and the
        owner, which answered, is fine.  A failed transfer reports the owner (unless
        ``report`` is False: done already), and the master drops every object it holds."""
        if isinstance(outcome, int):
            if outcome == placement.checksum:
                return True
            self._report_corrupt(placement)
            log.warning("%s failed its checksum: treated as a miss", placement.key)
        elif isinstance(outcome, ChecksumMismatch):
            self._report_corrupt(placement)
        elif isinstance(outcome, TransferError | PeerTimeout):
            if report:
                self._report(placement, outcome)
        elif isinstance(outcome, ObjectNotFound):
            self._post(self._corrupt_report(placement))
        return False

    def batch_get_into(self, keys: Sequence[str], buffers: Sequence[Any]) -> list[int]:
        """Read several objects; the size read per key, or -1 for a miss.

        One metadata round trip (BatchGet), then each owner's values in one pipelined
        batch on its data path (one round trip per owner, not per value), each checked
        against its checksum as it is read; the read leases go in one posted
        ReleaseOwner.  A buffer too small for its object raises ValueError before any
        byte moves.
        """
        return self._leased_batch(keys, buffers, self._read_batch)

    def batch_get_into_parts(
        self, keys: Sequence[str], parts: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        """Read each object straight into its parts (writable byte views, end to end):
        the object's size, or -1 for a miss (missing, corrupt, unreachable, or not
        exactly the parts' total size).

        Each part is its own read at its offset within the object, so the bytes go from
        the segment into the parts with no staging buffer (one copy over shared memory;
        over TCP they are received into the parts).  The object's checksum is computed
        over the parts in order as they land (the reads share one running xxh3, which
        equals the whole object's, see :class:`~kvpool.datapath.data_ops.ReadOp`): on
        a mismatch the key is a miss and the parts hold unspecified bytes, which the
        caller treats as unwritten.  An SSD copy is read whole, then copied into the
        parts.  One metadata round trip, one pipelined transfer per owner.
        """
        return self._leased_batch(keys, parts, self._read_parts_batch)

    def _leased_batch(
        self,
        keys: Sequence[str],
        targets: Sequence[_T],
        read: Callable[[Sequence[m.Placement], Sequence[_T]], list[int]],
    ) -> list[int]:
        """Several keys under one owner's read leases: ``BatchGet``, ``read(placements,
        targets)`` (the size per key, -1 for a miss), the keys whose copy failed and
        that have others asked for again and read the same way (at most one round per
        further copy; the failed copies were reported, so the master grants others),
        the leases released in one posted ReleaseOwner."""
        owner = self._read_owner()
        reply = self.call(m.BatchGet(owner, list(keys)))
        assert isinstance(reply, m.Placements)
        try:
            sizes = read(reply.items, targets)
            self._other_copies(owner, keys, reply.items, sizes, targets, read)
            return sizes
        finally:
            self._post(m.ReleaseOwner(owner))

    def _other_copies(
        self,
        owner: str,
        keys: Sequence[str],
        placements: Sequence[m.Placement],
        sizes: list[int],
        targets: Sequence[_T],
        read: Callable[[Sequence[m.Placement], Sequence[_T]], list[int]],
    ) -> None:
        """The keys of a batch whose copy failed and that have another: asked for again
        (the failed copies were reported, so the master grants others) and read with
        ``read``; at most one round per further copy."""
        again = [i for i, p in enumerate(placements) if sizes[i] < 0 and p.placed and p.copies > 1]
        rounds = max((placements[i].copies for i in again), default=1) - 1
        for _ in range(rounds):
            if not again:
                return
            reply = self.call(m.BatchGet(owner, [keys[i] for i in again]))
            assert isinstance(reply, m.Placements)
            got = read(reply.items, [targets[i] for i in again])
            for i, size in zip(again, got, strict=True):
                sizes[i] = size
            again = [
                i
                for i, p, size in zip(again, reply.items, got, strict=True)
                if size < 0 and p.placed and p.copies > 1
            ]

    def _read_batch(self, placements: Sequence[m.Placement], buffers: Sequence[Any]) -> list[int]:
        sizes = [-1] * len(placements)
        targets: dict[int, memoryview] = {}
        by_node: dict[str, list[int]] = {}
        ssd: list[int] = []
        for i, (placement, buffer) in enumerate(zip(placements, buffers, strict=True)):
            if not placement.placed:
                continue
            dst = writable_byte_view(buffer)
            if len(dst) < placement.size:
                raise ValueError(
                    f"{placement.key}: buffer of {len(dst)} bytes is too small for {placement.size}"
                )
            targets[i] = dst[: placement.size]
            if placement.tier == "ssd":
                ssd.append(i)
            else:
                by_node.setdefault(placement.data_address, []).append(i)
        for indices in by_node.values():
            self._read_many(placements, targets, indices, sizes)
        for i in ssd:
            with contextlib.suppress(ObjectNotFound):
                sizes[i] = self._read(placements[i], targets[i])
        return sizes

    def _read_many(
        self,
        placements: Sequence[m.Placement],
        targets: dict[int, memoryview],
        indices: list[int],
        sizes: list[int],
    ) -> None:
        """One owner's share of a batch read: one pipelined transfer, then each value's
        :meth:`_verdict`."""
        reads: list[DataOp] = [
            ReadOp(
                placements[i].segment_id,
                placements[i].offset,
                targets[i],
                shm_name=placements[i].shm_name,
                checked=True,
            )
            for i in indices
        ]
        done = self._run_reads(placements[indices[0]], reads)
        if done is not None:
            self._judge(placements, indices, done, sizes)

    def _run_reads(self, first: m.Placement, reads: list[DataOp]) -> list[OpResult] | None:
        """One owner's list of reads (``first``: a placement on that owner); None when
        the whole list failed (each of its keys a miss; a failed transfer reported)."""
        path = self._path(first)
        try:
            return path.run(reads)
        except (TransferError, PeerTimeout) as exc:
            self._report(first, exc)
        except KVPoolError:
            pass
        return None

    def _judge(
        self,
        placements: Sequence[m.Placement],
        indices: list[int],
        outcomes: Sequence[OpResult],
        sizes: list[int],
    ) -> None:
        """Each read object's :meth:`_verdict`; its size in ``sizes`` when good."""
        reported = False  # one report per owner is enough: it drops the node
        for i, outcome in zip(indices, outcomes, strict=True):
            if self._verdict(placements[i], outcome, report=not reported):
                sizes[i] = placements[i].size
            reported = reported or _owner_failed(outcome)

    def _read_parts_batch(
        self, placements: Sequence[m.Placement], parts: Sequence[Sequence[memoryview]]
    ) -> list[int]:
        sizes = [-1] * len(placements)
        by_node: dict[str, list[int]] = {}
        for i, (placement, views) in enumerate(zip(placements, parts, strict=True)):
            if not placement.placed or placement.size != sum(len(v) for v in views):
                continue  # another size: a miss, and nothing moves
            if placement.tier == "ssd":
                whole = bytearray(placement.size)
                with contextlib.suppress(ObjectNotFound):
                    sizes[i] = self._read(placement, memoryview(whole))
                    _scatter_into(whole, views)
            else:
                by_node.setdefault(placement.data_address, []).append(i)
        for indices in by_node.values():
            self._read_parts(placements, parts, indices, sizes)
        return sizes

    def _read_parts(
        self,
        placements: Sequence[m.Placement],
        parts: Sequence[Sequence[memoryview]],
        indices: list[int],
        sizes: list[int],
    ) -> None:
        """One owner's share of :meth:`batch_get_into_parts`: one list of reads (one per
        part), then per object the verdicts of :meth:`_judge`."""
        reads: list[DataOp] = []
        spans: list[tuple[int, int, Hasher]] = []  # each object's ops, reads[start:end]
        for i in indices:
            p = placements[i]
            start, at, running = len(reads), p.offset, hasher()
            for view in parts[i]:
                if len(view):  # an empty part has nothing to read
                    reads.append(ReadOp(p.segment_id, at, view, p.shm_name, running=running))
                at += len(view)
            spans.append((start, len(reads), running))
        done = self._run_reads(placements[indices[0]], reads)
        if done is None:
            return
        outcomes: list[OpResult] = []
        for start, end, running in spans:
            failure = next((r for r in done[start:end] if isinstance(r, KVPoolError)), None)
            outcomes.append(running.intdigest() if failure is None else failure)
        self._judge(placements, indices, outcomes, sizes)

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

    def warm(self) -> int:
        """Set up now what a first read of each memory segment would: the data connection
        to its owner and, on the same host, its shared memory mapped (its pages populated
        in the background).  A fresh worker then loads its first hit as fast as its later
        ones.  Returns how many segments are ready; one that fails is left to the read."""
        ready = 0
        for seg in self.stats().get("segments", []):
            address, segment_id = seg.get("data_address"), seg.get("segment_id")
            if not address or not segment_id:
                continue
            # a path that has set-up to do says so (NodeDataPath); others have none
            prepare = getattr(self._path_to(address), "prepare", None)
            try:
                if prepare is not None:
                    prepare(segment_id, seg.get("shm_name", ""))
            except (KVPoolError, OSError) as exc:
                log.info("warming segment %s failed (its first read sets it up): %s",
                         segment_id, exc)  # fmt: skip
                continue
            ready += 1
        return ready

    # ---------------------------------------------------------------------------- lifetime
    def close(self) -> None:
        self.link.close()
        with self._paths_lock:
            paths = list(self._paths.values())
            self._paths.clear()
        for path in paths:
            path.close()


def _owner_failed(outcome: OpResult) -> bool:
    """Whether a read met its owner's failure (unreachable, timed out), not its copy's."""
    return isinstance(outcome, TransferError | PeerTimeout) and not isinstance(
        outcome, ChecksumMismatch
    )


def _scatter_into(whole: Any, views: Sequence[memoryview]) -> None:
    """``whole`` copied into ``views``, end to end."""
    src, at = memoryview(whole), 0
    for view in views:
        view[:] = src[at : at + len(view)]
        at += len(view)
