"""Prometheus metrics of one proxy.  Each proxy owns its registry (no module-level
globals), so several proxies in one process, as in tests, do not share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ProxyMetrics"]

# From sub-millisecond proxy overhead up to minutes-long generations.
_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvpool_proxy_requests",
            "Requests answered, by API endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.errors = Counter(
            "kvpool_proxy_errors",
            "Failures, by stage (prefill, decode, client, request) and kind.",
            ["stage", "kind"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "kvpool_proxy_prefill_seconds",
            "P leg: request sent to P until P's JSON reply is read.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.decode_seconds = Histogram(
            "kvpool_proxy_decode_seconds",
            "D leg: request sent to D until D's last byte is passed on.",
            buckets=_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "kvpool_proxy_request_seconds",
            "End to end: request received until the answer is finished, by API endpoint.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "kvpool_proxy_inflight_requests",
            "Requests being served now.",
            registry=r,
        )
        self.upstream_inflight = Gauge(
            "kvpool_proxy_upstream_inflight_requests",
            "Requests in flight at each upstream endpoint.",
            ["role", "url"],
            registry=r,
        )
        self.upstream_healthy = Gauge(
            "kvpool_proxy_upstream_healthy",
            "1 while the endpoint is in rotation, 0 while it is out.",
            ["role", "url"],
            registry=r,
        )
        self.prefill_without_kv = Counter(
            "kvpool_proxy_prefill_without_kv_transfer_params",
            "P replies without kv_transfer_params (is P's KV connector a producer?); "
            "D then recomputes the prompt.",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
