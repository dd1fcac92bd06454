"""Hit statistics of the store connector, in vLLM's connector-stats and Prometheus channels
(``vllm:kvpool_store_<counter>_total``); what each counter means: docs/connectors.md.
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
    "commit_waits",
    "commit_wait_us",
    "late_commits",
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
