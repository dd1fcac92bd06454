"""Statistics of the transfer connector, in vLLM's connector-stats and Prometheus channels.

Worker ranks count; vLLM sums the counts across ranks each step, logs them
(``KV Transfer metrics: ...``) and, through :class:`KVPoolTransferPromMetrics`, exports them
as ``vllm:kvpool_transfer_<counter>_total`` on the instance's ``/metrics``.  What each
counter means: docs/connectors.md, "§8.2 Log lines".
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
