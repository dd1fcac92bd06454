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
pinned_blocks   blocks a lookup pinned for its request until they are loaded
pin_errors      pins or releases that failed: a hit left unprotected, or a pin left to its TTL
loaded_blocks   blocks copied from the pool into the KV cache
failed_blocks   blocks whose load failed (miss, corrupt, pool down): recomputed
dropped_blocks  unreadable objects this connector removed so a recomputed copy replaces
                them (kvpool's engines drop a corrupt copy themselves when a read
                finds it; then the connector finds nothing left to remove)
loaded_bytes    bytes loaded
saved_blocks    blocks written to the pool
saved_bytes     bytes written
save_errors     saves that failed (pool full or down): a future miss, nothing more
save_waits      steps that waited for the save queue's staging to free up (full)
skipped_blocks  blocks not saved: after a failed save of the same request's chain, or
                still queued at shutdown
==============  ==============================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.connectors.stats import CounterPromMetrics, CounterStats

__all__ = ["COUNTERS", "KVPoolStorePromMetrics", "KVPoolStoreStats"]

COUNTERS = (
    "lookups",
    "query_tokens",
    "hit_tokens",
    "lookup_errors",
    "pinned_blocks",
    "pin_errors",
    "loaded_blocks",
    "failed_blocks",
    "dropped_blocks",
    "loaded_bytes",
    "saved_blocks",
    "saved_bytes",
    "save_errors",
    "save_waits",
    "skipped_blocks",
)


@dataclass
class KVPoolStoreStats(CounterStats):
    """Counter deltas since the last report; ``data`` maps counter name -> int."""

    COUNTERS: ClassVar[tuple[str, ...]] = COUNTERS

    def reduce(self) -> dict[str, int | float]:
        out = super().reduce()
        query = out["query_tokens"]
        out["hit_rate"] = round(out["hit_tokens"] / query, 4) if query else 0.0
        return out


class KVPoolStorePromMetrics(CounterPromMetrics):
    """One Prometheus counter per statistic, labelled per engine as vLLM's own metrics are."""

    COUNTERS: ClassVar[tuple[str, ...]] = COUNTERS
    PREFIX: ClassVar[str] = "store"
