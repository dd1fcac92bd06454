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

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["COUNTERS", "KVPoolTransferPromMetrics", "KVPoolTransferStats", "stats_from_counts"]

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
class KVPoolTransferStats(KVConnectorStats):
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
        return {name: int(self.data.get(name, 0)) for name in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in COUNTERS)


def stats_from_counts(counts: Mapping[str, int]) -> KVPoolTransferStats | None:
    """Stats for a report; ``None`` when nothing happened (vLLM then sends nothing)."""
    if not any(counts.values()):
        return None
    return KVPoolTransferStats(data={name: int(counts.get(name, 0)) for name in COUNTERS})


class KVPoolTransferPromMetrics(KVConnectorPromMetrics):
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
                name=f"vllm:kvpool_transfer_{name}",
                documentation=f"kvpool transfer connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in COUNTERS:
            value = int(transfer_stats_data.get(name, 0))
            if value:
                self._counters[name][engine_idx].inc(value)
