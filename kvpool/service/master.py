"""The master's request handler: the core index plus a clock, endpoints and metrics.

This is the one place where wire requests meet the index and where errors become
replies.  It is synchronous and runs on the server's event loop thread only: the index
is never touched concurrently.  Demotions in the master's own storage are copied before
the reply leaves, so a freed extent is never handed out while its bytes are still being
copied.  Work on a node (its demotions, SSD deletions) never runs here: it goes to the
node's link thread, the object stays DEMOTING until the node reports back, and a put
that waits for that room is answered later (:mod:`kvpool.service.copies`).

Its two base classes hold two groups of its handlers and what they keep:
:class:`~kvpool.service.master_clients.MasterClients` the storage owners (registration,
segments and their endpoints, heartbeats, re-announcements, failed transfers), and
:class:`~kvpool.service.master_copies.NodeCopies` what it waits on nodes for (their
copies in flight, their catalogs, the replies held meanwhile).  Here: the entry point,
the effects of the index's events, puts, reads, probes and pins, and the snapshot.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvpool.core.credentials import check_tenant_name
from kvpool.core.index import (
    Demote,
    Dropped,
    Event,
    IndexConfig,
    Location,
    NoRoom,
    ObjectIndex,
)
from kvpool.core.registry import Tier
from kvpool.core.tenants import TenantBook
from kvpool.errors import (
    ConfigError,
    KVPoolError,
    NoSpace,
    ObjectNotFound,
    PoolError,
    UnknownSegment,
)
from kvpool.protocol import messages as m
from kvpool.protocol.data import Error, Ok, error_reply
from kvpool.service.catalog import Outbox
from kvpool.service.copies import Copies, Later
from kvpool.service.local_storage import LocalStorage
from kvpool.service.master_clients import Endpoint, MasterClients
from kvpool.service.master_copies import NodeCopies
from kvpool.service.master_tenants import make_tenant_room
from kvpool.service.metrics import MasterMetrics
from kvpool.service.node_links import NodeLinks
from kvpool.service.snapshot import pool_snapshot

__all__ = ["Endpoint", "Later", "MasterService", "monotonic_ms"]

log = logging.getLogger("kvpool.master")

# handler, op name (metric label), that op's latency histogram child
_Route = tuple[Callable[[Any, int], Any], str, Any]
_TIER_NAMES = {tier: tier.value for tier in Tier}  # an Enum .value is a descriptor call


# Drops of a whole storage owner.  Its SSD files are left alone: they outlive the
# owner's registration, and it re-announces them when it registers again (what the
# index then refuses, it deletes itself).
_OWNER_GONE = frozenset({"expired_client", "transfer_failed", "restarted"})


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class MasterService(MasterClients, NodeCopies):
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
        self.endpoints: dict[str, Endpoint] = {}  # segment_id -> endpoint
        self.client_addresses: dict[str, tuple[str, str]] = {}  # id -> (data addr, token)
        self.local: dict[str, LocalStorage] = {}  # storage hosted in this very process
        self.node_links = NodeLinks()  # demotions and SSD deletions on remote nodes
        self.copies = Copies(self.node_links, int(self.node_links.timeout_s * 1000))
        self.room_wait_ms = 1000  # how long a put may wait for room a copy makes
        self.catalog_wait_ms = 2 * heartbeat_interval_ms + 2000  # ... for its node's catalog
        self.laters: list[Later] = []  # replies the server holds, resolved by settle()
        self.may_wait = False  # the put being handled may be answered later
        self.waits = False  # ... and it does (master_copies.py has the rest)
        self.recent_errors: deque[str] = deque(maxlen=20)
        # per remote storage owner: catalog changes not yet sent with a heartbeat reply
        self.outbox = Outbox()
        self.started_ms = clock()
        self.rpc_connections = 0  # open client connections (kept by the server)
        self.config_view: dict[str, Any] = {}  # the flags it runs with, for doctor and status
        self.tenants = TenantBook()  # per-tenant quotas and usage (empty: no tenants)
        self._handlers: dict[type, Callable[[Any, int], Any]] = {
            m.Register: self._register,
            m.AddSegment: self._add_segment,
            m.Heartbeat: self._heartbeat,
            m.Restore: self._restore,
            m.PutStart: self._put_start,
            m.BatchPutStart: self._batch_put_start,
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
            m.ReportFailure: self._report_failure,
            m.ReportCorrupt: self._report_corrupt,
            m.Stats: self._stats,
            m.SetQuota: self._set_quota,
        }
        self._routes: dict[type, _Route] = {}  # filled by _route

    # ----------------------------------------------------------------------------- entry
    def handle(self, request: m.MasterRequest) -> m.MasterReply:
        """One request in, one reply out; never raises."""
        route = self._routes.get(type(request))
        if route is None:
            route = self._route(type(request))
        handler, op, latency = route
        if self.copies.has_reports():
            self._settle_copies()
        started = time.perf_counter()
        try:
            reply: m.MasterReply = handler(request, self.clock())
        except KVPoolError as exc:
            self.metrics.errors.labels(op=op, code=exc.code).inc()
            if not isinstance(exc, ObjectNotFound):
                self.recent_errors.append(f"{op}: {exc.code}: {exc}")
            reply = error_reply(exc)
        except Exception as exc:  # a bug must cost one reply, not the master
            log.exception("internal error handling %s", op)
            self.metrics.errors.labels(op=op, code="INTERNAL").inc()
            self.recent_errors.append(f"{op}: INTERNAL: {exc}")
            reply = error_reply(exc)
        latency.observe(time.perf_counter() - started)
        return reply

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

    def tick(self) -> None:
        """Expire leases, writers and clients; run watermark eviction.  Called periodically."""
        now = self.clock()
        for client_id in self.local:
            self.index.heartbeat(client_id, now)  # in-process owners are alive by definition
        self._apply(self.index.tick(now))
        if len(self.endpoints) != len(self.index.registry.segments):
            self._forget_segments()  # clients expired
        self.settle(expire=True)

    def close(self) -> None:
        self.node_links.close()

    # ---------------------------------------------------------------------------- effects
    def apply_events(self, events: list[Event]) -> None:
        """Carry out the index's effects (for the handlers of the modules beside this)."""
        self._apply(events)

    def _apply(self, events: list[Event]) -> None:
        ssd_gone: dict[str, list[str]] = {}  # remote owner -> SSD keys to delete there
        for event in events:
            if isinstance(event, Demote):
                if event.in_flight:
                    self._remote_demote(event)
                    continue
                owner = self.local.get(event.src.client_id)  # copies at once
                if owner is None or not owner.demote(event):
                    self.index.demote_failed(event.key)
                    self.metrics.demote_failures.inc()
                else:
                    self.metrics.offloads.inc()
            elif isinstance(event, Dropped):
                if self.tenants.tenants:
                    self.tenants.dropped(event.key)
                self.metrics.dropped.labels(reason=event.reason, tier=event.tier.value).inc()
                if event.reason == "evicted":
                    self.metrics.evictions.labels(tier=event.tier.value).inc()
                owner = self.local.get(event.client_id)
                if owner is not None and event.tier is Tier.SSD:
                    owner.forget_ssd(event.key)
                elif event.client_id in self.outbox:
                    self.outbox.remove(event.client_id, event.key)
                    if event.tier is Tier.SSD and event.reason not in _OWNER_GONE:
                        ssd_gone.setdefault(event.client_id, []).append(event.key)
        for client_id, keys in ssd_gone.items():
            self._remote_ssd_remove(client_id, keys)

    def _placement(self, key: str, loc: Location, checksum: int = 0) -> m.Placement:
        ep = self.endpoints.get(loc.segment_id)
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
        )

    # ----------------------------------------------------------------------------- writes
    def _put_start(self, req: m.PutStart, now: int) -> m.Placement:
        tenanted = bool(self.tenants.tenants) and req.key.startswith("@")
        if tenanted and self.index.state_of(req.key) is None:
            make_tenant_room(self, req.key, req.size, now)
        try:
            reservation, events = self.index.put_start(
                req.key, req.size, req.client_id, now, req.parent
            )
        except NoRoom as exc:
            self._apply(exc.events)
            if exc.coming and self.may_wait:
                self.waits = True  # submit() answers it later
                return m.Placement(False, req.key)  # never sent
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
            return m.Placement(False, req.key)
        if tenanted:
            self.tenants.reserved(req.key, req.size)
        return self._placement(req.key, reservation.location)

    def _batch_put_start(self, req: m.BatchPutStart, now: int) -> m.Placements:
        parents = req.parents or [None] * len(req.keys)
        if not len(req.keys) == len(req.sizes) == len(parents):
            raise PoolError("keys, sizes and parents differ in length")
        items: list[m.Placement] = []
        for key, size, parent in zip(req.keys, req.sizes, parents, strict=True):
            reply = self.handle(m.PutStart(req.client_id, key, size, parent))
            if self.waits:  # this key waits for room: so does the batch (all of it is
                return m.Placements(items)  # tried again; never sent)
            if isinstance(reply, Error):
                items.append(m.Placement(False, key, error=reply.code))
            else:
                assert isinstance(reply, m.Placement)
                items.append(reply)
        return m.Placements(items)

    def _put_end(self, req: m.PutEnd, now: int) -> Ok:
        self.index.put_end(req.key, req.client_id, now, req.checksum)
        self.metrics.puts.inc()
        if self.tenants.tenants:
            self.tenants.stored(req.key)
        loc = self.index.location_of(req.key)
        if loc is not None:
            self.outbox.add(
                loc.client_id, (req.key, loc.segment_id, loc.offset, loc.size, req.checksum)
            )
        return Ok()

    def _batch_put_end(self, req: m.BatchPutEnd, now: int) -> m.Bools:
        if len(req.keys) != len(req.checksums):
            raise PoolError("keys and checksums differ in length")
        ok = []
        for key, checksum in zip(req.keys, req.checksums, strict=True):
            try:
                self._put_end(m.PutEnd(req.client_id, key, checksum), now)
                ok.append(True)
            except KVPoolError:
                ok.append(False)
        return m.Bools(ok)

    def _put_revoke(self, req: m.PutRevoke, now: int) -> Ok:
        self.index.put_revoke(req.key, req.client_id)
        if self.tenants.tenants:
            self.tenants.dropped(req.key)
        return Ok()

    # ------------------------------------------------------------------------------ reads
    def _get(self, req: m.Get, now: int) -> m.Placement:
        self.metrics.lookups_of("get").inc()
        try:
            grant = self.index.get(req.key, req.owner, now)
        except ObjectNotFound:
            if self.tenants.tenants:
                self.tenants.miss(req.key)
            return m.Placement(False, req.key)
        if self.tenants.tenants:
            self.tenants.hit(req.key)
        loc = grant.location
        self.metrics.hits_of("get", _TIER_NAMES[loc.tier]).inc()
        return self._placement(req.key, loc, grant.checksum)

    def _batch_get(self, req: m.BatchGet, now: int) -> m.Placements:
        """As ``_get`` per key, with the metrics counted once per batch (two labelled
        counter increments per key were a third of a 16-key batch's handler time)."""
        index_get, owner, tenants = self.index.get, req.owner, self.tenants
        tenanted = bool(tenants.tenants)
        items: list[m.Placement] = []
        hits: dict[str, int] = {}
        for key in req.keys:
            try:
                grant = index_get(key, owner, now)
            except ObjectNotFound:
                if tenanted:
                    tenants.miss(key)
                items.append(m.Placement(False, key))
                continue
            if tenanted:
                tenants.hit(key)
            loc = grant.location
            tier = _TIER_NAMES[loc.tier]
            hits[tier] = hits.get(tier, 0) + 1
            items.append(self._placement(key, loc, grant.checksum))
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
        exists = self.index.exists
        return m.Bools([exists(k) for k in req.keys])

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
        self._apply([self.index.remove(req.key, now)])
        return Ok()

    def _report_corrupt(self, req: m.ReportCorrupt, now: int) -> Ok:
        dropped = self.index.drop_corrupt(req.key, req.segment_id, req.offset, req.checksum)
        if dropped is not None:
            log.warning("dropped %s: a reader found its copy corrupt", req.key)
            self._apply([dropped])
        return Ok()

    def _stats(self, req: m.Stats, now: int) -> m.StatsReply:
        return m.StatsReply(self.snapshot())

    def _set_quota(self, req: m.SetQuota, now: int) -> m.Count:
        # who may send it is the server's rule (master_tenants.py): the operator only
        try:
            check_tenant_name(req.tenant, "tenant")
            self.tenants.set_quota(req.tenant, req.quota_bytes)
        except (ConfigError, ValueError) as exc:
            raise PoolError(str(exc)) from None
        log.info("tenant %s: quota set to %d bytes", req.tenant, req.quota_bytes)
        return m.Count(self.tenants.tenants[req.tenant].bytes)

    # ----------------------------------------------------------------------------- status
    def snapshot(self) -> dict[str, Any]:
        """The pool at a glance, JSON-able (for `kvpool status` and the status page)."""
        return pool_snapshot(self)
