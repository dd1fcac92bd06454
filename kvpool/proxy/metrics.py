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

        # kv_aware routing (kvpool.proxy.kv_feed): per prefill instance ("pool": the pool)
        self.kv_events = Counter(
            "kvpool_proxy_kv_events",
            "KV events received from each instance's stream.",
            ["instance"],
            registry=r,
        )
        self.kv_events_malformed = Counter(
            "kvpool_proxy_kv_events_malformed",
            "KV event messages that could not be read, dropped.",
            ["instance"],
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "kvpool_proxy_kv_index_blocks",
            "Blocks each instance's own cache holds as its events say, and the pool's.",
            ["instance"],
            registry=r,
        )
        self.kv_index_resets = Counter(
            "kvpool_proxy_kv_index_resets",
            "Times an instance's index started afresh (restart, lost events, mispredictions).",
            ["instance"],
            registry=r,
        )
        self.kv_trusted = Gauge(
            "kvpool_proxy_kv_events_trusted",
            "1 while an instance's events are used for routing, 0 while it is routed by load.",
            ["instance"],
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "kvpool_proxy_predicted_hit_tokens",
            "Prompt tokens kv_aware expected the chosen instance to hit (own cache or pool).",
            ["instance"],
            registry=r,
        )
        self.actual_hit_tokens = Counter(
            "kvpool_proxy_actual_hit_tokens",
            "Prompt tokens the chosen instance reported cached (vLLM's prefix cache and"
            " connector hits), beside the predicted ones.",
            ["instance"],
            registry=r,
        )
        self.first_token = Counter(
            "kvpool_proxy_first_token",
            "How answers began with P's token: spliced (D continued it), mended (it ended"
            " inside a character: D's first text was mended), p_only (it ended the answer),"
            " sequential (D answered the whole request).",
            ["path"],
            registry=r,
        )
        self.mispredictions = Counter(
            "kvpool_proxy_kv_mispredictions",
            "Routed requests that hit more than a block less than predicted.",
            ["instance"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
