"""The master's Prometheus metrics, in a registry of its own (several masters may share a
process in tests).  Names keep Mooncake's ``kv_cache`` / ``connected`` words so the guide's
``curl …/metrics | grep -E "kv_cache|connected"`` works as written, and every ratio has its
denominator exported next to it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from kvpool.master.service import MasterService

__all__ = ["LabelCache", "MasterMetrics", "counter_total"]

_LATENCY_BUCKETS = (
    0.00002,
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.05,
    0.1,
    1.0,
)


def counter_total(counter: Any, **labels: str) -> float:
    """A counter's value summed over its children whose labels include ``labels``: what
    ``/metrics`` says, for the status page (one source, so they never disagree)."""
    return float(
        sum(
            s.value
            for metric in counter.collect()
            for s in metric.samples
            if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in labels.items())
        )
    )


class LabelCache:
    """The children of a labelled metric, looked up once per label values.

    ``metric.labels(...)`` costs a few microseconds (it validates, sorts and locks on
    every call): more than the master's whole ``Exists``.  The hot handlers call this
    instead.  A child is still made on first use only, so ``/metrics`` shows exactly
    the series it showed before (none for a label set never used).
    """

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        """The child for these label values, in the metric's label order."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class MasterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.blocks = Gauge("kvpool_kv_cache_blocks_total", "READY objects in the pool", registry=r)
        self.connected = Gauge(
            "kvpool_connected_clients",
            "processes connected to the master (open RPC connections: nodes, vLLM workers, "
            "clients) plus the master's own segment owner",
            registry=r,
        )
        self.registered = Gauge(
            "kvpool_registered_nodes",
            "live storage owners (nodes contributing segments)",
            registry=r,
        )
        self.tier_capacity = Gauge(
            "kvpool_tier_capacity_bytes", "capacity per tier", ["tier"], registry=r
        )
        self.tier_used = Gauge(
            "kvpool_tier_used_bytes", "bytes used per tier", ["tier"], registry=r
        )
        self.tier_objects = Gauge(
            "kvpool_tier_objects", "READY objects per tier", ["tier"], registry=r
        )
        self.active_leases = Gauge(
            "kvpool_active_leases", "unexpired read leases and pins", registry=r
        )
        self.warm_bytes = Gauge(
            "kvpool_memory_warm_bytes",
            "memory segment bytes whose pages are faulted in (of kvpool_tier_capacity_bytes"
            '{tier="memory"}; segments whose owner does not say count as none)',
            registry=r,
        )
        self.segments_warming = Gauge(
            "kvpool_segments_warming",
            "memory segments whose pages are being faulted in",
            registry=r,
        )
        self.lookups = Counter(
            "kvpool_lookups", "get requests (denominator of hits)", ["kind"], registry=r
        )
        self.hits = Counter(
            "kvpool_hits", "get requests that found the object", ["kind", "tier"], registry=r
        )
        self.prefix_lookups = Counter("kvpool_prefix_lookups", "prefix lookups", registry=r)
        self.prefix_keys = Counter(
            "kvpool_prefix_blocks",
            "blocks asked for / found by prefix lookups",
            ["result"],
            registry=r,
        )
        self.prefix_tokens = Counter(
            "kvpool_prefix_tokens",
            "tokens asked for / found by prefix lookups",
            ["result"],
            registry=r,
        )
        self.puts = Counter("kvpool_puts", "objects made visible", registry=r)
        self.put_failures = Counter(
            "kvpool_put_failures", "refused puts by reason", ["reason"], registry=r
        )
        self.evictions = Counter("kvpool_evictions", "objects evicted", ["tier"], registry=r)
        # one meaning everywhere (this, /api/status, kvpool status): a demotion whose copy
        # completed; a failed one is counted once, as a failure, and never as an offload
        self.offloads = Counter(
            "kvpool_offloads", "objects demoted from memory to SSD (copy completed)", registry=r
        )
        self.demote_failures = Counter(
            "kvpool_offload_failures", "demotions that failed (the object was dropped)", registry=r
        )
        self.dropped = Counter(
            "kvpool_dropped_objects", "objects that left the index", ["reason", "tier"], registry=r
        )
        self.replicas_lost = Counter(
            "kvpool_replicas_lost",
            "copies of replicated objects that left while the object stayed",
            ["reason"],
            registry=r,
        )
        self.errors = Counter("kvpool_request_errors", "error replies", ["op", "code"], registry=r)
        self.latency = Histogram(
            "kvpool_request_seconds",
            "master request latency",
            ["op"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # per-request children, cached (see LabelCache); never removed from the metrics
        self.latency_of = LabelCache(self.latency)
        self.lookups_of = LabelCache(self.lookups)
        self.hits_of = LabelCache(self.hits)
        self.ssd_corruptions = Gauge(
            "kvpool_ssd_corrupt_reads", "SSD reads that failed their checksum (misses)", registry=r
        )
        self.ssd_bad_files = Gauge(
            "kvpool_ssd_bad_files",
            "SSD files a start-up scan found corrupt or unreadable (deleted, never announced)",
            registry=r,
        )

    def refresh(self, master: MasterService) -> None:
        """Copy gauges from the index (cheap; called on each tick and before a scrape)."""
        from kvpool.core.registry import Tier

        idx = master.index
        self.blocks.set(idx.count())
        self.connected.set(master.rpc_connections + len(master.clients.local))
        self.registered.set(len(idx.registry.clients))
        for tier in Tier:
            capacity, used = idx.usage(tier)
            self.tier_capacity.labels(tier=tier.value).set(capacity)
            self.tier_used.labels(tier=tier.value).set(used)
            self.tier_objects.labels(tier=tier.value).set(idx.count(tier))
        self.active_leases.set(idx.active_leases(master.clock()))
        warm = [master.clients.warmth_of(seg) for seg in idx.registry.segments]
        self.warm_bytes.set(sum(w[1] for w in warm if w is not None))
        self.segments_warming.set(sum(1 for w in warm if w is not None and w[0] == "warming"))
        tiers = [o.ssd.stats for o in master.clients.local.values() if o.ssd is not None]
        self.ssd_corruptions.set(sum(stats.corruptions for stats in tiers))
        self.ssd_bad_files.set(sum(stats.bad_headers for stats in tiers))

    def lookup_counts(self) -> dict[str, Any]:
        total = counter_total
        return {
            "gets": total(self.lookups),
            "get_hits": total(self.hits),
            "prefix_blocks_queried": total(self.prefix_keys, result="queried"),
            "prefix_blocks_hit": total(self.prefix_keys, result="hit"),
            "prefix_tokens_queried": total(self.prefix_tokens, result="queried"),
            "prefix_tokens_hit": total(self.prefix_tokens, result="hit"),
        }

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
