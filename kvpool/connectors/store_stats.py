"""Hit statistics of the store connector, in vLLM's connector-stats and Prometheus channels.

Both halves count; vLLM sums the worker's and the scheduler's counts each step and logs
them (``KV Transfer metrics: lookups=..., hit_tokens=..., hit_rate=...``) and, through
:class:`KVPoolStorePromMetrics`, exports them as ``vllm:kvpool_store_<counter>_total``.

Counters (all monotonic within an interval, summed across workers):

==============  ==============================================================
lookups         requests the scheduler asked the pool about
query_tokens    prompt tokens asked for beyond vLLM's own prefix-cache hit
hit_tokens      tokens the pool supplied (the denominator is query_tokens)
lookup_errors   lookups that failed (pool down): counted as misses
loaded_blocks   blocks copied from the pool into the KV cache
failed_blocks   blocks whose load failed (miss, corrupt, pool down): recomputed
dropped_blocks  unreadable objects removed from the pool so a recomputed copy replaces them
loaded_bytes    bytes loaded
saved_blocks    blocks written to the pool
saved_bytes     bytes written
save_errors     saves that failed (pool full or down): a future miss, nothing more
==============  ==============================================================
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTERS", "KVPoolStorePromMetrics", "KVPoolStoreStats", "stats_from_counters"]

COUNTERS = (
    "lookups",
    "query_tokens",
    "hit_tokens",
    "lookup_errors",
    "loaded_blocks",
    "failed_blocks",
    "dropped_blocks",
    "loaded_bytes",
    "saved_blocks",
    "saved_bytes",
    "save_errors",
)


@dataclass
class KVPoolStoreStats(KVConnectorStats):
    """Counter deltas since the last report; ``data`` maps counter name -> int."""

    def __post_init__(self) -> None:
        for name in COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] = int(self.data.get(name, 0)) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: int(self.data.get(name, 0)) for name in COUNTERS}
        query = out["query_tokens"]
        out["hit_rate"] = round(out["hit_tokens"] / query, 4) if query else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


def stats_from_counters(counters: Counter[str]) -> KVPoolStoreStats | None:
    """Take the counts accumulated so far (and zero them); None when there are none."""
    if not any(counters.values()):
        return None
    stats = KVPoolStoreStats(data={name: int(counters.get(name, 0)) for name in COUNTERS})
    counters.clear()
    return stats


class KVPoolStorePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per statistic, labelled per engine as vLLM's own metrics are."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(
                name=f"vllm:kvpool_store_{name}",
                documentation=f"kvpool store connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = int(transfer_stats_data.get(name, 0))
            if value:
                self._counters[name][engine_idx].inc(value)
