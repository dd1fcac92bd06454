"""The master's request handler: the core index plus a clock, endpoints and metrics.

The one place where wire requests meet the index and errors become replies.  Synchronous,
on the server's event loop thread only, so the index is never touched concurrently.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvpool.core.index import ObjectIndex
from kvpool.core.objects import CopyLost, Demote, Dropped, Event, IndexConfig, Location, NoRoom
from kvpool.core.registry import Tier
from kvpool.errors import (
    KVPoolError,
    NoSpace,
    ObjectNotFound,
    PoolError,
    UnknownSegment,
)
from kvpool.ha.leadership import Leadership
from kvpool.master.clients import Endpoint, MasterClients
from kvpool.master.copies import Later
from kvpool.master.metrics import MasterMetrics
from kvpool.master.node_copies import Handler, NodeCopies
from kvpool.master.snapshot import pool_snapshot
from kvpool.node.catalog import Outbox
from kvpool.node.storage import LocalStorage
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error, Ok, error_reply

if TYPE_CHECKING:
    from kvpool.master.kv_events import PoolEventPublisher

__all__ = ["Endpoint", "Later", "MasterService", "PutKey", "monotonic_ms"]

log = logging.getLogger("kvpool.master")

# handler, op name (metric label), that op's latency histogram child
_Route = tuple[Callable[[Any, int], Any], str, Any]
_TIER_NAMES = {tier: tier.value for tier in Tier}  # an Enum .value is a descriptor call

#: One key's reservation: ``(client_id, key, size, parent, now, may_wait, replica_num)``
#: -> its placement, or None where it waits for room (:meth:`MasterService.put_key`, or
#: a layer's over it).
PutKey = Callable[[str, str, int, str | None, int, bool, int], m.Placement | None]
_PutHandler = Callable[[Any, int], m.Placement | m.Placements | None]


# Drops of a whole storage owner.  Its SSD files are left alone: they outlive the
# owner's registration, and it re-announces them when it registers again (what the
# index then refuses, it deletes itself).
_OWNER_GONE = frozenset({"expired_client", "transfer_failed", "restarted"})


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class MasterService:
    """Handles :mod:`kvpool.protocol.messages` requests against one ObjectIndex."""

    def __init__(
        self,
        config: IndexConfig,
        *,
        metrics: MasterMetrics | None = None,
        clock: Callable[[], int] = monotonic_ms,
        heartbeat_interval_ms: int = 1000,
    ) -> None:
        self.index = ObjectIndex(config)
        self.metrics = metrics or MasterMetrics()
        self.clock = clock
        self.heartbeat_interval_ms = heartbeat_interval_ms
        # per remote storage owner: catalog changes not yet sent with a heartbeat reply
        self.outbox = Outbox()
        self.clients = MasterClients(self.index, self.outbox, self._apply, heartbeat_interval_ms)
        self.node_copies = NodeCopies(
            self.index,
            self.outbox,
            self.metrics,
            clock,
            self._apply,
            self.clients.address_of,
            heartbeat_interval_ms,
        )
        # the same objects, one attribute load away on the hot paths
        self._endpoints = self.clients.endpoints
        self._local = self.clients.local
        self._copies = self.node_copies.copies
        self.recent_errors: deque[str] = deque(maxlen=20)
        self.started_ms = clock()
        self.rpc_connections = 0  # open client connections (kept by the server)
        self.config_view: dict[str, Any] = {}  # the flags it runs with, for doctor and status
        #: this master's place among its peers (kvpool.ha): the server's, when it has one
        self.leadership = Leadership(address="")
        #: told of each storage node that registers (an HA leader records it in etcd)
        self.on_node_joined: Callable[[str, str], None] | None = None
        #: called with the key of each object the index drops (a layer's accounting)
        self.drop_watchers: list[Callable[[str], None]] = []
        #: the pool's KV events (kvpool.master.kv_events), when the server publishes them
        self.kv_events: PoolEventPublisher | None = None
        clients = self.clients
        self._put = self.puts(self.put_key, may_wait=False)
        self._put_or_wait = self.puts(self.put_key, may_wait=True)
        self._handlers: dict[type, Callable[[Any, int], Any]] = {
            m.Register: clients.register,
            m.AddSegment: clients.add_segment,
            m.Heartbeat: clients.heartbeat,
            m.Restore: clients.restore,
            m.PutStart: self._put,
            m.BatchPutStart: self._put,
            m.PutEnd: self._put_end,
            m.BatchPutEnd: self._batch_put_end,
            m.PutRevoke: self._put_revoke,
            m.Get: self._get,
            m.BatchGet: self._batch_get,
            m.Release: self._release,
            m.ReleaseOwner: self._release_owner,
            m.Pin: self._pin,
            m.Exists: self._exists,
            m.BatchExists: self._batch_exists,
            m.PrefixLookup: self._prefix_lookup,
            m.Remove: self._remove,
            m.ReportFailure: clients.report_failure,
            m.ReportCorrupt: self._report_corrupt,
            m.Stats: self._stats,
            m.SetQuota: self._no_quotas,  # the tenant layer's, where it is installed
            # the server's gate answers it first; this serves the in-process link
            m.WhoLeads: lambda _req, _now: self.leadership.who(time.monotonic()),
        }
        self._routes: dict[type, _Route] = {}  # filled by _route

    # ----------------------------------------------------------------------------- entry
    def handle(
        self, request: m.MasterRequest, handler: Callable[[Any, int], Any] | None = None
    ) -> m.MasterReply:
        """One request in, one reply out; never raises.  ``handler``: a layer's in place
        of this service's own (its reply passes through, None included), with the same
        error replies and metrics."""
        route = self._routes.get(type(request))
        if route is None:
            route = self._route(type(request))
        own, op, latency = route
        if self._copies.has_reports():
            self.node_copies.settle_copies()
        started = time.perf_counter()
        reply: m.MasterReply  # None from a layer's put that waits (see try_put)
        try:
            reply = (handler or own)(request, self.clock())
        except Exception as exc:  # a bug must cost one reply, not the master
            reply = self._failed(op, exc)
        latency.observe(time.perf_counter() - started)
        return reply

    def try_put(self, request: m.PutStart | m.BatchPutStart) -> m.MasterReply | None:
        """As :meth:`handle`, but None where the put must wait for room a node's copy in
        flight is making (:meth:`submit` holds it)."""
        reply: m.MasterReply | None = self.handle(request, self._put_or_wait)
        return reply

    def submit(self, request: m.MasterRequest) -> m.MasterReply | Later:
        """As :meth:`handle`, but some replies wait (:meth:`NodeCopies.submit
        <kvpool.master.node_copies.NodeCopies.submit>`)."""
        return self.node_copies.submit(request, self)

    def submit_via(
        self, request: m.MasterRequest, via: Handler, out: Callable[[m.MasterReply], m.MasterReply]
    ) -> m.MasterReply | Later:
        """As :meth:`submit`, answered by a layer over this service (``via``, a
        tenant's), whose ``out`` gives each reply back, a held one's too."""
        reply = self.node_copies.submit(request, via)
        if isinstance(reply, Later):
            reply.then(out)
            return reply
        return out(reply)

    def serve(self, kind: type, handler: Callable[[Any, int], Any]) -> None:
        """Answer requests of ``kind`` with a layer's ``handler`` from now on (the tenant
        layer's ``SetQuota``: kvpool.tenancy)."""
        if kind not in self._handlers:
            raise ValueError(f"{kind.__name__} is not a master request")
        self._handlers[kind] = handler
        self._routes.pop(kind, None)

    def settle(self, expire: bool = False) -> None:
        """Apply what nodes reported, and answer the held replies that can be."""
        self.node_copies.settle(expire)

    def _failed(self, op: str, exc: Exception) -> Error:
        """The error reply of ``exc``, counted (called in its ``except`` clause)."""
        if isinstance(exc, KVPoolError):
            self.metrics.errors.labels(op=op, code=exc.code).inc()
            if not isinstance(exc, ObjectNotFound):
                self.recent_errors.append(f"{op}: {exc.code}: {exc}")
        else:
            log.exception("internal error handling %s", op)
            self.metrics.errors.labels(op=op, code="INTERNAL").inc()
            self.recent_errors.append(f"{op}: INTERNAL: {exc}")
        return error_reply(exc)

    @property
    def request_types(self) -> frozenset[type]:
        """The request types this service handles (all of ``m.MasterRequest``: a test
        holds it to that)."""
        return frozenset(self._handlers)

    def _route(self, kind: type) -> _Route:
        """Handler, op name and latency child of a request type, looked up once per type:
        a ``labels()`` call per request cost more than an ``Exists`` itself."""
        op = kind.__name__
        route = self._routes[kind] = (
            self._handlers.get(kind, self._unhandled),
            op,
            self.metrics.latency_of(op),
        )
        return route

    def _unhandled(self, request: Any, now: int) -> m.MasterReply:
        raise KeyError(type(request))  # a bug: an INTERNAL error reply, as for any other

    def attach_local(self, storage: LocalStorage) -> None:
        """Register storage hosted in the master's own process (the embedded segment)."""
        self.clients.attach_local(storage, self.clock())

    def tick(self) -> None:
        """Expire leases, writers and clients; run watermark eviction.  Called periodically."""
        now = self.clock()
        for client_id in self._local:
            self.index.heartbeat(client_id, now)  # in-process owners are alive by definition
        self._apply(self.index.tick(now))
        if len(self._endpoints) != len(self.index.registry.segments):
            self.clients.forget_segments()  # clients expired
        self.node_copies.settle(expire=True)

    def close(self) -> None:
        self.node_copies.links.close()

    # ---------------------------------------------------------------------------- effects
    def _apply(self, events: list[Event]) -> None:
        """Demotions in the master's own storage are copied before the reply leaves, so
        a freed extent is never handed out while its bytes are still being copied.  A
        node's (and its SSD deletions) go to its link thread: the object stays DEMOTING
        until the node reports back (:class:`NodeCopies`)."""
        ssd_gone: dict[str, list[str]] = {}  # remote owner -> SSD keys to delete there
        for event in events:
            if isinstance(event, CopyLost):  # one copy of a replicated object
                self.metrics.replicas_lost.labels(reason=event.reason).inc()
                if event.client_id in self.outbox:
                    self.outbox.remove(event.client_id, event.key)
                continue
            if isinstance(event, Demote):
                if event.in_flight:
                    self.node_copies.demote(event)
                    continue
                owner = self._local.get(event.src.client_id)  # copies at once
                if owner is None or not owner.demote(event):
                    self.index.demote_failed(event.key)
                    self.metrics.demote_failures.inc()
                else:
                    self.metrics.offloads.inc()
                    if self.kv_events is not None:  # memory tier -> SSD tier
                        self.kv_events.removed(event.key)
                        self.kv_events.stored(event.key, ssd=True)
            elif isinstance(event, Dropped):
                for watch in self.drop_watchers:
                    watch(event.key)
                if self.kv_events is not None:
                    self.kv_events.removed(event.key, ssd=event.tier is Tier.SSD)
                self.metrics.dropped.labels(reason=event.reason, tier=event.tier.value).inc()
                if event.reason == "evicted":
                    self.metrics.evictions.labels(tier=event.tier.value).inc()
                for other in event.also:  # its replicas' owners (memory only)
                    if other in self.outbox:
                        self.outbox.remove(other, event.key)
                owner = self._local.get(event.client_id)
                if owner is not None and event.tier is Tier.SSD:
                    owner.forget_ssd(event.key)
                elif event.client_id in self.outbox:
                    self.outbox.remove(event.client_id, event.key)
                    if event.tier is Tier.SSD and event.reason not in _OWNER_GONE:
                        ssd_gone.setdefault(event.client_id, []).append(event.key)
        for client_id, keys in ssd_gone.items():
            self.node_copies.ssd_remove(client_id, keys)

    def _placement(
        self,
        key: str,
        loc: Location,
        checksum: int = 0,
        copies: int = 1,
        replicas: tuple[Location, ...] = (),
    ) -> m.Placement:
        ep = self._endpoints.get(loc.segment_id)
        if ep is None:
            raise UnknownSegment(f"segment {loc.segment_id} has no endpoint")
        return m.Placement(
            True,
            key,
            loc.segment_id,
            _TIER_NAMES[loc.tier],
            loc.offset,
            loc.size,
            checksum,
            ep.data_address,
            ep.shm_name,
            ep.host_token,
            replicas=[self._placement(key, other) for other in replicas] if replicas else [],
            copies=copies,
        )

    # ----------------------------------------------------------------------------- writes
    def puts(self, put_key: PutKey, *, may_wait: bool) -> _PutHandler:
        """The handler of ``PutStart`` and ``BatchPutStart`` that reserves each key with
        ``put_key`` (this service's own, or a layer's over it)."""

        def put(req: m.PutStart | m.BatchPutStart, now: int) -> m.Placement | m.Placements | None:
            if isinstance(req, m.PutStart):
                return put_key(
                    req.client_id, req.key, req.size, req.parent, now, may_wait, req.replica_num
                )
            return self._put_keys(req, now, put_key, may_wait)

        return put

    def put_key(
        self,
        client_id: str,
        key: str,
        size: int,
        parent: str | None,
        now: int,
        may_wait: bool,
        replica_num: int = 0,
    ) -> m.Placement | None:
        """Reserve ``size`` bytes for ``key`` in ``replica_num`` copies (0: the master's
        default): its placement (not placed: the key is stored already, a harmless
        duplicate), or None where ``may_wait`` and only the room a node's copy in flight
        is making would fit it."""
        try:
            reservation, events = self.index.put_start(
                key, size, client_id, now, parent, replica_num
            )
        except NoRoom as exc:
            self._apply(exc.events)
            if exc.coming and may_wait:
                return None
            self.metrics.put_failures.labels(reason="no_space").inc()
            raise
        except NoSpace:
            self.metrics.put_failures.labels(reason="no_space").inc()
            raise
        except PoolError as exc:
            self.metrics.put_failures.labels(reason=exc.code.lower()).inc()
            raise
        self._apply(events)
        if reservation is None:
            return m.Placement(False, key)
        if reservation.replicas:
            return self._placement(key, reservation.location, replicas=reservation.replicas)
        return self._placement(key, reservation.location)

    def _put_keys(
        self, req: m.BatchPutStart, now: int, put_key: PutKey, may_wait: bool
    ) -> m.Placements | None:
        """Each key's placement, or the error that refused that key alone; None where a
        key waits for room: so does the batch (all of it is tried again)."""
        parents = req.parents or [None] * len(req.keys)
        if not len(req.keys) == len(req.sizes) == len(parents):
            raise PoolError("keys, sizes and parents differ in length")
        items: list[m.Placement] = []
        for key, size, parent in zip(req.keys, req.sizes, parents, strict=True):
            try:
                placement = put_key(
                    req.client_id, key, size, parent, now, may_wait, req.replica_num
                )
            except Exception as exc:  # counted as the PutStart it is
                items.append(m.Placement(False, key, error=self._failed("PutStart", exc).code))
                continue
            if placement is None:
                return None
            items.append(placement)
        return m.Placements(items)

    def _put_end(self, req: m.PutEnd, now: int) -> Ok:
        self._end_key(req.client_id, req.key, req.checksum, now, req.unwritten)
        return Ok()

    def _end_key(
        self, client_id: str, key: str, checksum: int, now: int, unwritten: list[str] | None = None
    ) -> None:
        lost = self.index.put_end(key, client_id, now, checksum, unwritten or ())
        if lost:
            self._apply(lost)
        self.metrics.puts.inc()
        if self.kv_events is not None:
            self.kv_events.stored(key)
        for loc in self.index.copies_of(key):
            self.outbox.add(loc.client_id, (key, loc.segment_id, loc.offset, loc.size, checksum))

    def _batch_put_end(self, req: m.BatchPutEnd, now: int) -> m.Bools:
        if len(req.keys) != len(req.checksums):
            raise PoolError("keys and checksums differ in length")
        unwritten = req.unwritten or [[] for _ in req.keys]
        if len(unwritten) != len(req.keys):
            raise PoolError("keys and unwritten differ in length")
        ok = []
        for key, checksum, lost in zip(req.keys, req.checksums, unwritten, strict=True):
            try:
                self._end_key(req.client_id, key, checksum, now, lost)
                ok.append(True)
            except KVPoolError:
                ok.append(False)
        return m.Bools(ok)

    def _put_revoke(self, req: m.PutRevoke, now: int) -> Ok:
        self.index.put_revoke(req.key, req.client_id)
        return Ok()

    # ------------------------------------------------------------------------------ reads
    def _get(self, req: m.Get, now: int) -> m.Placement:
        self.metrics.lookups_of("get").inc()
        try:
            grant = self.index.get(req.key, req.owner, now)
        except ObjectNotFound:
            return m.Placement(False, req.key)
        loc = grant.location
        self.metrics.hits_of("get", _TIER_NAMES[loc.tier]).inc()
        return self._placement(req.key, loc, grant.checksum, grant.copies)

    def _batch_get(self, req: m.BatchGet, now: int) -> m.Placements:
        """As ``_get`` per key, with the metrics counted once per batch (two labelled
        counter increments per key were a third of a 16-key batch's handler time)."""
        index_get, owner = self.index.get, req.owner
        items: list[m.Placement] = []
        hits: dict[str, int] = {}
        for key in req.keys:
            try:
                grant = index_get(key, owner, now)
            except ObjectNotFound:
                items.append(m.Placement(False, key))
                continue
            loc = grant.location
            tier = _TIER_NAMES[loc.tier]
            hits[tier] = hits.get(tier, 0) + 1
            items.append(self._placement(key, loc, grant.checksum, grant.copies))
        self.metrics.lookups_of("get").inc(len(req.keys))
        for tier, count in hits.items():
            self.metrics.hits_of("get", tier).inc(count)
        return m.Placements(items)

    def _release(self, req: m.Release, now: int) -> Ok:
        for key in req.keys:
            self.index.release(key, req.owner)
        return Ok()

    def _release_owner(self, req: m.ReleaseOwner, now: int) -> m.Count:
        return m.Count(self.index.release_owner(req.owner))

    def _pin(self, req: m.Pin, now: int) -> m.Count:
        # ttl_ms 0 (engines.POOL_TTL): the pool's own default_kv_lease_ttl, which a
        # connector's lookup pins for without having to know the master's flags.
        ttl_ms = req.ttl_ms if req.ttl_ms > 0 else self.index.config.lease_ttl_ms
        pinned = 0
        for key in req.keys:
            try:
                self.index.pin(key, req.owner, now, ttl_ms)
                pinned += 1
            except ObjectNotFound:
                pass
        return m.Count(pinned)

    def _exists(self, req: m.Exists, now: int) -> m.Bools:
        return m.Bools([self.index.exists(req.key)])

    def _batch_exists(self, req: m.BatchExists, now: int) -> m.Bools:
        return m.Bools(self.index.batch_exists(req.keys))

    def _prefix_lookup(self, req: m.PrefixLookup, now: int) -> m.Count:
        n = self.index.prefix_lookup(req.keys)
        self.metrics.prefix_lookups.inc()
        self.metrics.prefix_keys.labels(result="queried").inc(len(req.keys))
        self.metrics.prefix_keys.labels(result="hit").inc(n)
        if req.tokens_per_key > 0:  # a counter only goes up: a negative one is no count
            self.metrics.prefix_tokens.labels(result="queried").inc(
                len(req.keys) * req.tokens_per_key
            )
            self.metrics.prefix_tokens.labels(result="hit").inc(n * req.tokens_per_key)
        return m.Count(n)

    def _remove(self, req: m.Remove, now: int) -> Ok:
        self.remove(req.key, now)
        return Ok()

    def remove(self, key: str, now: int) -> None:
        """Drop a READY object nobody holds; ObjectNotFound, ObjectBusy otherwise."""
        self._apply([self.index.remove(key, now)])

    def _report_corrupt(self, req: m.ReportCorrupt, now: int) -> Ok:
        dropped = self.index.drop_corrupt(req.key, req.segment_id, req.offset, req.checksum)
        if dropped is not None:
            log.warning("dropped %s: a reader found its copy corrupt", req.key)
            self._apply([dropped])
        return Ok()

    def _stats(self, req: m.Stats, now: int) -> m.StatsReply:
        return m.StatsReply(self.snapshot())

    def _no_quotas(self, req: m.SetQuota, now: int) -> m.Count:
        # quotas are the tenant layer's (kvpool.tenancy.master), which `kvpool master`
        # installs over this service: a service without it keeps none
        raise PoolError(f"tenant {req.tenant}: this pool has no tenant layer to keep quotas")

    # ----------------------------------------------------------------------------- status
    def snapshot(self) -> dict[str, Any]:
        """The pool at a glance, JSON-able (for `kvpool status` and the status page)."""
        return pool_snapshot(self)
