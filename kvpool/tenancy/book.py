"""Tenants: whose namespace a key is in, and each tenant's bytes, objects and quota.

A tenant's keys live in the pool as ``@<tenant>/<key>``; the master, not the client, puts
every key a tenant's connection sends into that namespace.  Pure: no clock, no I/O.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["TenantBook", "TenantUsage", "scoped", "tenant_of", "unscoped"]

# A tenant's keys live in the pool as ``@<tenant>/<key>`` (:func:`scoped`).  The master
# puts every key a tenant's connection sends into that tenant's namespace itself, so the
# client never chooses it: the same key from two tenants is two objects, and no key a
# tenant can send names another tenant's object.  The cluster secret's connections (the
# operator's, and single-tenant pools) see keys as they are: tenant ``""``, and the
# scoped names when they mean a tenant's object.
_SCOPE = re.compile(r"^@([A-Za-z0-9][A-Za-z0-9_.-]{0,62})/")


def scoped(tenant: str, key: str) -> str:
    """``key`` as stored for ``tenant`` (unchanged for tenant ``""``)."""
    return f"@{tenant}/{key}" if tenant else key


def unscoped(tenant: str, key: str) -> str:
    """The name ``tenant`` knows a stored key by (inverse of :func:`scoped`)."""
    prefix = f"@{tenant}/" if tenant else ""
    return key[len(prefix) :] if prefix and key.startswith(prefix) else key


def tenant_of(key: str) -> str:
    """The tenant whose namespace a stored key is in (``""``: none)."""
    if not key.startswith("@"):
        return ""
    found = _SCOPE.match(key)
    return found.group(1) if found else ""


@dataclass
class TenantUsage:
    """One tenant's accounting (its series on /metrics)."""

    quota: int = 0  # bytes; 0 is none
    bytes: int = 0  # reserved and stored
    objects: int = 0  # stored (READY) objects
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # objects dropped to make room for its own puts
    refused: int = 0  # puts refused over quota
    # key -> (size, stored); stored ones in least-recently-used order
    keys: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)


# Rules:
#
# - A tenant's quota counts every byte it holds, reserved (being written) and stored, in
#   any tier: an object counts once, from put start until it leaves the index.
# - Room for a tenant's put is made from that tenant's own objects only (least recently
#   stored or read first); what cannot be made so refuses the put (QuotaExceeded).  The
#   pool-wide watermark eviction still runs over everyone, as without tenants: quotas that
#   add up to less than the pool keep one tenant from pushing out another.
# - Pure: no clock, no I/O.  The caller reports each object's life; a key of a tenant the
#   book does not keep is ignored (no unbounded label sets from arbitrary key names).
class TenantBook:
    """Every known tenant's usage (the rules are in the comment above)."""

    def __init__(self) -> None:
        self.tenants: dict[str, TenantUsage] = {}

    # a tenant the book keeps series for (bounded: only configured or authenticated tenants)
    def add(self, tenant: str) -> TenantUsage:
        usage = self.tenants.get(tenant)
        if usage is None:
            usage = self.tenants[tenant] = TenantUsage()
        return usage

    # quota 0: no quota
    def set_quota(self, tenant: str, quota: int) -> None:
        if quota < 0:
            raise ValueError(f"tenant {tenant}: a quota is a number of bytes >= 0, got {quota}")
        self.add(tenant).quota = quota

    def _of(self, key: str) -> TenantUsage | None:
        tenant = tenant_of(key)
        return self.tenants.get(tenant) if tenant else None

    # reserved / stored / dropped: an object's life, as the index reports it
    def reserved(self, key: str, size: int) -> None:
        usage = self._of(key)
        if usage is None:
            return
        old = usage.keys.pop(key, None)
        if old is not None:  # a retry of its own put: the old reservation is gone
            usage.bytes -= old[0]
            usage.objects -= old[1]
        usage.keys[key] = [size, 0]
        usage.bytes += size

    def stored(self, key: str) -> None:
        usage = self._of(key)
        entry = usage.keys.get(key) if usage is not None else None
        if usage is None or entry is None or entry[1]:
            return
        entry[1] = 1
        usage.objects += 1
        usage.keys.move_to_end(key)

    def dropped(self, key: str) -> None:
        usage = self._of(key)
        entry = usage.keys.pop(key, None) if usage is not None else None
        if usage is None or entry is None:
            return
        usage.bytes -= entry[0]
        usage.objects -= entry[1]

    def hit(self, key: str) -> None:
        usage = self._of(key)
        if usage is None:
            return
        usage.hits += 1
        if key in usage.keys:
            usage.keys.move_to_end(key)

    def miss(self, key: str) -> None:
        usage = self._of(key)
        if usage is not None:
            usage.misses += 1

    def over_by(self, key: str, size: int) -> int:
        """Bytes a put of ``size`` under ``key`` would take its tenant over its quota
        (0: it fits, or no quota).  A retry of its own reservation counts once."""
        usage = self._of(key)
        if usage is None or not usage.quota:
            return 0
        held = usage.keys.get(key)
        used = usage.bytes - (held[0] if held is not None else 0)
        return max(0, used + size - usage.quota)

    def victims(self, key: str) -> list[tuple[str, int]]:
        """The stored objects of ``key``'s tenant, least recently used first, with sizes."""
        usage = self._of(key)
        if usage is None:
            return []
        return [(k, e[0]) for k, e in usage.keys.items() if e[1] and k != key]

    # one object dropped to make room inside the tenant
    def evicted(self, key: str) -> None:
        usage = self._of(key)
        if usage is not None:
            usage.evictions += 1

    def refused(self, key: str) -> None:
        usage = self._of(key)
        if usage is not None:
            usage.refused += 1
