"""The master's side of tenants: a tenant connection's requests in its own namespace,
what only the operator may do, quotas from the command line, and room inside a tenant.

A connection that proved a tenant key (handshake role ``tenant``, its id the tenant's
name) is that tenant's.  Rules, applied to each of its requests before the service sees
it (:func:`tenant_request`) and to each reply (:func:`tenant_reply`):

- Every key it sends, every parent key, and every writer and lease-owner id, is put
  into the tenant's namespace (:func:`kvpool.core.tenants.scoped`) by the master: the
  client cannot name another tenant's object, writer or lease, so it cannot read,
  overwrite, remove, probe, pin, release or revoke one.  Keys in replies are given back
  as the tenant sent them.
- A tenant holds no node key, so it reads and writes bytes only with a grant: each
  memory placement it is given carries one for exactly that range and operation, until
  the lease (read) or the writer's reservation (write) would have expired, MACed with
  the owner's node key (:func:`kvpool.core.credentials.make_grant`), plus the tenant's
  key to that node's data port.  Placements carry no shared-memory name for a tenant:
  a segment mapped into its process would bypass every grant.  Its objects on the SSD
  tier are misses for it (an SSD read by key takes no grant yet).
- Operator requests (``SetQuota``; ``ReportFailure``, which drops a whole storage owner)
  and a node's own requests are refused with an ``AuthError`` reply; the connection
  stays open (a tenant client's report of a failed transfer is fire-and-forget: it must
  not cost it its link).  ``Stats`` (the pool's clients, segments and objects for the
  operator) answers a tenant with its own usage only (:func:`tenant_stats`).
- The cluster secret's connections are untouched (no copy, no rewrite): the operator's
  and single-tenant pools' fast path is what it was.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from msgspec import structs

from kvpool.config.values import parse_size
from kvpool.core.credentials import Credential, check_tenant_name, make_grant, tenant_data_key
from kvpool.core.tenants import scoped, tenant_of, unscoped
from kvpool.errors import AuthError, ConfigError, PoolError, QuotaExceeded
from kvpool.protocol import messages as m

if TYPE_CHECKING:
    from kvpool.service.master import MasterService

__all__ = [
    "GRANT_SEP",
    "Grants",
    "grant_op",
    "make_tenant_room",
    "parse_tenant_quotas",
    "tenant_reply",
    "tenant_request",
    "tenant_stats",
]

#: between a segment id and the grant a tenant's placement carries with it
GRANT_SEP = "#"

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
    """``request`` as the service must see it from ``tenant``'s connection, or the
    AuthError that refuses it."""
    kind = type(request)
    if kind in OPERATOR_REQUESTS:
        return AuthError(
            f"tenant {tenant}'s credential may not send {kind.__name__}: an operator "
            "action needs the cluster secret"
        )
    if kind is m.Stats:
        return request  # answered by tenant_stats, never by the pool's snapshot
    if kind in OWNER_REQUESTS:
        return AuthError(f"tenant {tenant}'s credential may not send {kind.__name__}")
    changes: dict[str, Any] = {}
    if kind is m.ReportCorrupt:  # the segment id came with a grant: the index's own id
        changes["segment_id"] = request.segment_id.partition(GRANT_SEP)[0]
    if kind is m.PutEnd or kind is m.BatchPutEnd:  # a node ignores a tenant's write tags
        changes["noted"] = False
    for name in _ONE.get(kind, ()):
        value = getattr(request, name)
        if value is not None:
            changes[name] = scoped(tenant, value)
    for name in _MANY.get(kind, ()):
        changes[name] = [None if v is None else scoped(tenant, v) for v in getattr(request, name)]
    if not changes:  # a request type with no key and no id: a bug to fix here, not a hole
        return AuthError(f"tenant {tenant}: {kind.__name__} is not open to tenants")
    return structs.replace(request, **changes)


class Grants:
    """Makes the grants of a tenant's placements (see :func:`tenant_reply`)."""

    def __init__(self, service: MasterService, credential: Credential | None) -> None:
        self.service = service
        self.credential = credential

    def placement(self, tenant: str, p: m.Placement, op: str) -> m.Placement:
        key = unscoped(tenant, p.key)
        segment = self.service.index.registry.segments.get(p.segment_id)
        if not p.placed or p.tier != "memory" or segment is None or self.credential is None:
            return structs.replace(p, key=key, shm_name="", host_token="")
        config = self.service.index.config
        ttl_ms = config.writer_ttl_ms if op == "w" else config.lease_ttl_ms
        until = time.time_ns() // 1_000_000 + ttl_ms
        node_key = self.credential.node_key_of(segment.client_id)
        grant = make_grant(node_key, tenant, p.segment_id, op, p.offset, p.size, until)
        data_key = tenant_data_key(node_key, tenant).hex()
        return structs.replace(
            p,
            key=key,
            segment_id=f"{p.segment_id}{GRANT_SEP}{grant}{GRANT_SEP}{data_key}",
            shm_name="",  # a tenant's bytes go through the data port, where grants are checked
            host_token="",
        )


def tenant_reply(tenant: str, reply: Any, op: str, grants: Grants) -> Any:
    """``reply`` with keys as ``tenant`` sent them, and each memory placement's segment
    id carrying the grant of ``op`` (``r``, ``w``) and the tenant's key to the owner's
    data port: ``<segment id>#<grant>#<data key>``.  A tenant's data path
    (:mod:`kvpool.transfer.tenant_path`) takes them apart; everything between passes the
    segment id through unchanged."""
    if isinstance(reply, m.Placement):
        return grants.placement(tenant, reply, op)
    if isinstance(reply, m.Placements):
        return m.Placements([grants.placement(tenant, p, op) for p in reply.items])
    return reply


def tenant_stats(service: MasterService, tenant: str) -> m.StatsReply:
    """What a tenant may know of the pool: its own usage."""
    usage = service.tenants.add(tenant)
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


def grant_op(request: Any) -> str:
    """The operation a request's placements are for."""
    kind = type(request)
    if kind is m.PutStart or kind is m.BatchPutStart:
        return "w"
    if kind is m.Get or kind is m.BatchGet:
        return "r"
    return ""


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


def make_tenant_room(service: MasterService, key: str, size: int, now: int) -> None:
    """Bring ``key``'s tenant under its quota for a put of ``size``, evicting its own
    least recently used objects (never another tenant's), or raise QuotaExceeded."""
    book = service.tenants
    need = book.over_by(key, size)
    if not need:
        return
    for victim, victim_size in book.victims(key):  # bounded: the tenant's own objects
        try:
            event = service.index.remove(victim, now)
        except PoolError:  # leased, pinned, or not READY: not evictable now
            continue
        book.evicted(victim)
        service.apply_events([event])
        need -= victim_size
        if need <= 0:
            return
    book.refused(key)
    service.metrics.put_failures.labels(reason="quota_exceeded").inc()
    tenant = tenant_of(key)
    usage = book.tenants[tenant]
    raise QuotaExceeded(
        f"{unscoped(tenant, key)}: tenant {tenant} holds {usage.bytes} bytes of its "
        f"{usage.quota}-byte quota and none of its own objects is evictable for {size} "
        "more; raise its quota (SetQuota, --tenant_quota) or store less"
    )
