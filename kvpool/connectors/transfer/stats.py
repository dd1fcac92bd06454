"""Statistics of the transfer connector, in vLLM's connector-stats and Prometheus channels.

Worker ranks count; vLLM sums the counts across ranks each step, logs them
(``KV Transfer metrics: ...``) and, through :class:`KVPoolTransferPromMetrics`, exports them
as ``vllm:kvpool_transfer_<counter>_total`` on the instance's ``/metrics``.

Counters (deltas since the last report, summed across workers):

===============  ===================================================================
pulls            D: requests whose KV landed in this rank's cache
pull_failures    D: pulls that failed (recomputed, or failed with policy ``fail``);
                 the denominator of the failure rate is pulls + pull_failures
pulled_blocks    D: blocks received
pulled_bytes     D: bytes received
served_pulls     P: pulls served to a D rank
served_bytes     P: bytes sent
holds            P: finished requests whose blocks were kept for D
holds_released   P: holds freed because every expected D rank had its data or released it
holds_expired    P: holds freed by ``hold_timeout_ms`` (a D that never came)
===============  ===================================================================
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
