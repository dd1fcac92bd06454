"""Per-tenant series on the master's /metrics (``kvpool_tenant_*``, label ``tenant``),
read from the tenant layer's :class:`~kvpool.tenancy.book.TenantBook` at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.tenancy.book import TenantBook

__all__ = ["TenantCollector"]


class TenantCollector(Collector):
    """Per-tenant series, read from ``book`` at scrape time.  Only tenants the book keeps
    (configured with a quota, or that proved their key) have series, so a key's name
    never makes a label."""

    def __init__(self, book: TenantBook) -> None:
        self.book = book

    def describe(self) -> list[Any]:
        return []  # unchecked: the families depend on the tenants there are

    def collect(self) -> Iterator[Any]:
        tenants = self.book.tenants
        gauges = (
            ("kvpool_tenant_bytes", "bytes a tenant holds (reserved and stored)", "bytes"),
            ("kvpool_tenant_objects", "READY objects of a tenant", "objects"),
            ("kvpool_tenant_quota_bytes", "a tenant's byte quota (0: none)", "quota"),
        )
        counters = (
            ("kvpool_tenant_hits", "a tenant's get requests that found the object", "hits"),
            ("kvpool_tenant_misses", "a tenant's get requests that found nothing", "misses"),
            (
                "kvpool_tenant_evictions",
                "a tenant's objects evicted to make room for its own puts (quota)",
                "evictions",
            ),
            ("kvpool_tenant_quota_refusals", "a tenant's puts refused over quota", "refused"),
        )
        for kind, series in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, attr in series:
                family = kind(name, doc, labels=["tenant"])
                for tenant, usage in sorted(tenants.items()):
                    family.add_metric([tenant], getattr(usage, attr))
                yield family
