"""Tenancy, a layer over the master: :class:`TenantMaster` owns the tenants' book and
quotas, and serves a tenant connection's requests in that tenant's namespace.

A connection that proved a tenant key gets this layer's handler when admitted; the
cluster secret's connections never pass through here (no copy, no rewrite).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from msgspec import structs

from kvpool.config.values import parse_size
from kvpool.core.index import ObjectIndex
from kvpool.errors import AuthError, ConfigError, KVPoolError, PoolError, QuotaExceeded
from kvpool.protocol import messages as m
from kvpool.protocol.data import Ok, error_reply
from kvpool.security.credentials import (
    Credential,
    check_tenant_name,
    make_grant,
    ssd_subject,
    tenant_data_key,
)
from kvpool.tenancy.book import TenantBook, scoped, tenant_of, unscoped
from kvpool.tenancy.grants import GRANT_SEP
from kvpool.tenancy.metrics import TenantCollector

__all__ = [
    "GRANT_SEP",
    "Master",
    "TenantMaster",
    "grant_op",
    "parse_tenant_quotas",
    "tenant_request",
]

log = logging.getLogger("kvpool.master")

#: a request handler of the master: ``(request, now)`` -> its reply
_Handler = Callable[[Any, int], Any]


class Master(Protocol):
    """What the tenant layer uses of the master it is over
    (:class:`kvpool.master.service.MasterService`, which imports nothing of tenants)."""

    index: ObjectIndex
    metrics: Any  # its put_failures counter counts the puts refused over quota
    drop_watchers: list[Callable[[str], None]]

    def puts(self, put_key: Callable[..., m.Placement | None], *, may_wait: bool) -> _Handler: ...

    def handle(
        self, request: m.MasterRequest, handler: _Handler | None = None
    ) -> m.MasterReply: ...

    def submit_via(self, request: m.MasterRequest, via: Any, out: Any) -> Any: ...

    def serve(self, kind: type, handler: _Handler) -> None: ...

    def put_key(
        self,
        client_id: str,
        key: str,
        size: int,
        parent: str | None,
        now: int,
        may_wait: bool,
        replica_num: int = 0,
    ) -> m.Placement | None: ...

    def remove(self, key: str, now: int) -> None: ...


#: what only the cluster secret may send
OPERATOR_REQUESTS = (m.SetQuota, m.ReportFailure)
#: a storage owner's own requests: never a tenant's
OWNER_REQUESTS = (m.Register, m.AddSegment, m.Heartbeat, m.Restore)

# per request type: its fields that hold one key or id, and those that hold lists of them
_ONE: dict[type, tuple[str, ...]] = {
    m.PutStart: ("client_id", "key", "parent"),
    m.PutEnd: ("client_id", "key"),
    m.PutRevoke: ("client_id", "key"),
    m.Get: ("owner", "key"),
    m.ReleaseOwner: ("owner",),
    m.Exists: ("key",),
    m.Remove: ("key",),
    m.ReportCorrupt: ("key",),
    m.BatchPutStart: ("client_id",),
    m.BatchPutEnd: ("client_id",),
    m.BatchGet: ("owner",),
    m.Release: ("owner",),
    m.Pin: ("owner",),
}
_MANY: dict[type, tuple[str, ...]] = {
    m.BatchPutStart: ("keys", "parents"),
    m.BatchPutEnd: ("keys",),
    m.BatchGet: ("keys",),
    m.Release: ("keys",),
    m.Pin: ("keys",),
    m.BatchExists: ("keys",),
    m.PrefixLookup: ("keys",),
}


def tenant_request(tenant: str, request: Any) -> Any:
    """``request`` as the master must see it from ``tenant``'s connection, or the
    AuthError that refuses it.

    Every key it sends, every parent key, and every writer and lease-owner id, is put
    into the tenant's namespace (:func:`kvpool.tenancy.book.scoped`): the client cannot
    name another tenant's object, writer or lease, so it cannot read, overwrite, remove,
    probe, pin, release or revoke one.  Operator requests (``SetQuota``; ``ReportFailure``,
    which drops a whole storage owner) and a node's own requests are refused; the
    connection stays open (a tenant client's report of a failed transfer is
    fire-and-forget: it must not cost it its link).
    """
    kind = type(request)
    if kind in OPERATOR_REQUESTS:
        return AuthError(
            f"tenant {tenant}'s credential may not send {kind.__name__}: an operator "
            "action needs the cluster secret"
        )
    if kind is m.Stats:
        return request  # answered with the tenant's own usage, never the pool's snapshot
    if kind in OWNER_REQUESTS:
        return AuthError(f"tenant {tenant}'s credential may not send {kind.__name__}")
    changes: dict[str, Any] = {}
    if kind is m.ReportCorrupt:  # the segment id came with a grant: the index's own id
        changes["segment_id"] = request.segment_id.partition(GRANT_SEP)[0]
    if kind is m.PutEnd or kind is m.BatchPutEnd:  # a node ignores a tenant's write tags
        changes["noted"] = False
    if kind is m.PutEnd and request.unwritten:  # segment ids with grants, as above
        changes["unwritten"] = [s.partition(GRANT_SEP)[0] for s in request.unwritten]
    if kind is m.BatchPutEnd and request.unwritten:
        changes["unwritten"] = [
            [s.partition(GRANT_SEP)[0] for s in each] for each in request.unwritten
        ]
    for name in _ONE.get(kind, ()):
        value = getattr(request, name)
        if value is not None:
            changes[name] = scoped(tenant, value)
    for name in _MANY.get(kind, ()):
        changes[name] = [None if v is None else scoped(tenant, v) for v in getattr(request, name)]
    if not changes:  # a request type with no key and no id: a bug to fix here, not a hole
        return AuthError(f"tenant {tenant}: {kind.__name__} is not open to tenants")
    return structs.replace(request, **changes)


def grant_op(request: Any) -> str:
    """The operation a request's placements are for."""
    kind = type(request)
    if kind is m.PutStart or kind is m.BatchPutStart:
        return "w"
    if kind is m.Get or kind is m.BatchGet:
        return "r"
    return ""


class TenantMaster:
    """The tenants' side of one master (see the module docstring).

    It owns the tenants' :class:`~kvpool.tenancy.book.TenantBook`: each tenant's quota
    (``--tenant_quota``, the operator's ``SetQuota``) and usage.  It answers the
    master's :class:`~kvpool.master.node_copies.Handler` for the tenants' (scoped)
    requests: their puts make room inside the tenant first, and what the master answers
    is counted in the tenant's usage (:meth:`_account`).  Objects that leave the index
    otherwise (evicted, expired, removed) reach it through the master's
    ``drop_watchers``, which :meth:`over` installs it in.
    """

    def __init__(self, service: Master, credential: Credential | None) -> None:
        self.service = service
        self.book = TenantBook()
        self.credential = credential  # the cluster secret: makes the grants (None: none)
        self._put = service.puts(self._put_key, may_wait=False)
        self._put_or_wait = service.puts(self._put_key, may_wait=True)

    @classmethod
    def over(cls, service: Master, credential: Credential | None) -> TenantMaster:
        """The tenant layer over ``service``, installed for what it keeps: the drops it
        must count, the operator's ``SetQuota``, its series on the master's /metrics."""
        layer = cls(service, credential)
        service.drop_watchers.append(layer.book.dropped)
        service.serve(m.SetQuota, layer._set_quota)
        service.metrics.registry.register(TenantCollector(layer.book))
        return layer

    def connection(self, tenant: str) -> Callable[[m.MasterRequest], Any]:
        """The handler of a connection that proved ``tenant``'s key, chosen once when the
        server admits it; the tenant has its series on /metrics from now on."""
        self.book.add(tenant)
        return functools.partial(self.submit, tenant)

    def submit(self, tenant: str, request: m.MasterRequest) -> Any:
        """One request from ``tenant``'s connection: its reply, or the master's ``Later``
        that the server holds (a put, as for anyone), whose reply is mapped back too."""
        op = grant_op(request)
        inside = tenant_request(tenant, request)
        if isinstance(inside, KVPoolError):  # refused; the link stays open
            return error_reply(inside)
        if isinstance(inside, m.Stats):
            return self.stats(tenant)
        return self.service.submit_via(inside, self, lambda reply: self.reply(tenant, reply, op))

    def _set_quota(self, req: m.SetQuota, now: int) -> m.Count:
        """The operator's ``SetQuota`` (the master's handler of it, see :meth:`over`).
        Only the cluster secret's connections reach it: :func:`tenant_request` refuses
        it to a tenant's."""
        try:
            check_tenant_name(req.tenant, "tenant")
            self.book.set_quota(req.tenant, req.quota_bytes)
        except (ConfigError, ValueError) as exc:
            raise PoolError(str(exc)) from None
        log.info("tenant %s: quota set to %d bytes", req.tenant, req.quota_bytes)
        return m.Count(self.book.tenants[req.tenant].bytes)

    # ------------------------------------------------------- the master's Handler, scoped
    def handle(self, request: m.MasterRequest) -> m.MasterReply:
        if isinstance(request, (m.PutStart, m.BatchPutStart)):
            return self.service.handle(request, self._put)
        reply = self.service.handle(request)
        self._account(request, reply)
        return reply

    def try_put(self, request: m.PutStart | m.BatchPutStart) -> m.MasterReply | None:
        reply: m.MasterReply | None = self.service.handle(request, self._put_or_wait)
        return reply

    def _put_key(
        self,
        client_id: str,
        key: str,
        size: int,
        parent: str | None,
        now: int,
        may_wait: bool,
        replica_num: int = 0,
    ) -> m.Placement | None:
        """The master's ``put_key``, within the tenant's quota (every copy counts)."""
        index = self.service.index
        if index.state_of(key) is None:  # a new object: it takes room
            self._make_room(key, size * (replica_num or index.config.replica_num), now)
        placement = self.service.put_key(client_id, key, size, parent, now, may_wait, replica_num)
        if placement is not None and placement.placed:
            self.book.reserved(key, size * (1 + len(placement.replicas)))
        return placement

    def _make_room(self, key: str, size: int, now: int) -> None:
        """Bring ``key``'s tenant under its quota for a put of ``size``, evicting its own
        least recently used objects (never another tenant's), or raise QuotaExceeded.
        The pool-wide watermark eviction still runs over everyone, as without tenants."""
        book = self.book
        need = book.over_by(key, size)
        if not need:
            return
        victims = book.victims(key)  # bounded: the tenant's own objects
        if sum(victim_size for _, victim_size in victims) < need:
            victims = []  # cannot fit even with all of them gone: evict nothing, refuse
        for victim, victim_size in victims:
            try:
                self.service.remove(victim, now)
            except PoolError:  # leased, pinned, or not READY: not evictable now
                continue
            book.evicted(victim)
            need -= victim_size
            if need <= 0:
                return
        book.refused(key)
        self.service.metrics.put_failures.labels(reason="quota_exceeded").inc()
        tenant = tenant_of(key)
        usage = book.tenants[tenant]
        raise QuotaExceeded(
            f"{unscoped(tenant, key)}: tenant {tenant} holds {usage.bytes} bytes of its "
            f"{usage.quota}-byte quota and none of its own objects is evictable for {size} "
            "more; raise its quota (SetQuota, --tenant_quota) or store less"
        )

    def _account(self, request: m.MasterRequest, reply: m.MasterReply) -> None:
        """Count what the master answered in the tenant's usage: reads that found the
        object or not, objects made visible, writes revoked (an error reply: nothing)."""
        book = self.book
        if isinstance(reply, m.Placement):  # a Get's
            _count_read(book, reply)
        elif isinstance(reply, m.Placements):  # a BatchGet's
            for placement in reply.items:
                _count_read(book, placement)
        elif isinstance(reply, Ok):
            if isinstance(request, m.PutEnd):
                book.stored(request.key)
            elif isinstance(request, m.PutRevoke):
                book.dropped(request.key)
        elif isinstance(reply, m.Bools) and isinstance(request, m.BatchPutEnd):
            for key, ok in zip(request.keys, reply.values, strict=True):
                if ok:
                    book.stored(key)

    # ------------------------------------------------------------------ replies, unscoped
    def reply(self, tenant: str, reply: m.MasterReply, op: str) -> m.MasterReply:
        """``reply`` with keys as ``tenant`` sent them, and each memory placement's
        segment id carrying the grant of ``op`` (``r``, ``w``) and the tenant's key to
        the owner's data port: ``<segment id>#<grant>#<data key>``.  A tenant's data
        path (:mod:`kvpool.tenancy.data_path`) takes them apart; everything between
        passes the segment id through unchanged."""
        if isinstance(reply, m.Placement):
            return self._granted(tenant, reply, op)
        if isinstance(reply, m.Placements):
            return m.Placements([self._granted(tenant, p, op) for p in reply.items])
        return reply

    def _granted(self, tenant: str, p: m.Placement, op: str) -> m.Placement:
        """A tenant holds no node key, so it reads and writes bytes only with a grant:
        one for exactly this range and operation, until the lease (read) or the writer's
        reservation (write) would have expired, MACed with the owner's node key.  No
        shared-memory name: a segment mapped into its process would bypass every grant.
        An object on the SSD tier is read by key: its grant is for that one key
        (:func:`~kvpool.security.credentials.ssd_subject`)."""
        key = unscoped(tenant, p.key)
        index = self.service.index
        segment = index.registry.segments.get(p.segment_id)
        if p.replicas:  # each copy's write needs its own grant
            p = structs.replace(p, replicas=[self._granted(tenant, r, op) for r in p.replicas])
        if not p.placed or segment is None or self.credential is None:
            return structs.replace(p, key=key, shm_name="", host_token="")
        ttl_ms = index.config.writer_ttl_ms if op == "w" else index.config.lease_ttl_ms
        until = time.time_ns() // 1_000_000 + ttl_ms
        node_key = self.credential.node_key_of(segment.client_id)
        if p.tier == "memory":
            grant = make_grant(node_key, tenant, p.segment_id, op, p.offset, p.size, until)
        elif op == "r":
            grant = make_grant(node_key, tenant, ssd_subject(p.key), "s", 0, p.size, until)
        else:  # puts go to memory: an SSD placement is only ever read
            return structs.replace(p, key=key, shm_name="", host_token="")
        data_key = tenant_data_key(node_key, tenant).hex()
        return structs.replace(
            p,
            key=key,
            segment_id=f"{p.segment_id}{GRANT_SEP}{grant}{GRANT_SEP}{data_key}",
            shm_name="",  # a tenant's bytes go through the data port, where grants are checked
            host_token="",
        )

    def stats(self, tenant: str) -> m.StatsReply:
        """What a tenant may know of the pool (``Stats``): its own usage.  The pool's
        clients, segments and objects are the operator's."""
        usage = self.book.add(tenant)
        return m.StatsReply(
            {
                "tenant": tenant,
                "bytes": usage.bytes,
                "objects": usage.objects,
                "quota_bytes": usage.quota,
                "hits": usage.hits,
                "misses": usage.misses,
                "evictions": usage.evictions,
            }
        )


def _count_read(book: TenantBook, placement: m.Placement) -> None:
    if placement.placed:
        book.hit(placement.key)
    else:
        book.miss(placement.key)


def parse_tenant_quotas(text: str, key: str = "--tenant_quota") -> dict[str, int]:
    """``NAME=SIZE[,NAME=SIZE...]`` (sizes as ``1GB``, ``512MiB`` or bytes)."""
    quotas: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, size = item.partition("=")
        if not sep:
            raise ConfigError(
                f"{key}: {item!r} is not NAME=SIZE (e.g. --tenant_quota teamA=8GB,teamB=2GB)"
            )
        check_tenant_name(name.strip(), key)
        quotas[name.strip()] = parse_size(size.strip(), key=f"{key} ({name.strip()})")
    return quotas
