"""Statistics of the transfer connector, in vLLM's connector-stats and Prometheus channels
(``vllm:kvpool_transfer_<counter>_total``); the counters: docs/connectors.md §8.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.connectors.stats import CounterPromMetrics, CounterStats

__all__ = ["COUNTERS", "KVPoolTransferPromMetrics", "KVPoolTransferStats"]

COUNTERS = (
    "pulls",
    "pull_failures",
    "pulled_blocks",
    "pulled_bytes",
    "served_pulls",
    "served_bytes",
    "holds",
    "holds_released",
    "holds_expired",
)


@dataclass
class KVPoolTransferStats(CounterStats):
    """Counter deltas since the last report; ``data`` maps counter name -> int."""

    COUNTERS: ClassVar[tuple[str, ...]] = COUNTERS


class KVPoolTransferPromMetrics(CounterPromMetrics):
    """One Prometheus counter per statistic, labelled per engine as vLLM's own metrics are."""

    COUNTERS: ClassVar[tuple[str, ...]] = COUNTERS
    PREFIX: ClassVar[str] = "transfer"
