"""Counter statistics shared by kvpool's connectors, in vLLM's two channels: connector stats
(summed across workers and logged each interval) and Prometheus counters
(``vllm:kvpool_<prefix>_<counter>_total``).  A connector names its counters once in a
subclass; the summing, reporting and exporting live here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["CounterPromMetrics", "CounterStats"]


@dataclass
class CounterStats(KVConnectorStats):
    """Counter deltas since the last report; ``data`` maps counter name -> int."""

    COUNTERS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self.COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self) -> None:
        self.data = dict.fromkeys(self.COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in self.COUNTERS:
            self.data[name] = int(self.data.get(name, 0)) + int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(self.data.get(name, 0)) for name in self.COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(name, 0) for name in self.COUNTERS)


class CounterPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per statistic, labelled per engine as vLLM's own metrics are."""

    COUNTERS: ClassVar[tuple[str, ...]] = ()
    PREFIX: ClassVar[str] = ""  # "store" -> vllm:kvpool_store_<counter>

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name in self.COUNTERS:
            metric = self._counter_cls(
                name=f"vllm:kvpool_{self.PREFIX}_{name}",
                documentation=f"kvpool {self.PREFIX} connector: {name.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[name] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name in self.COUNTERS:
            value = int(transfer_stats_data.get(name, 0))
            if value:
                self._counters[name][engine_idx].inc(value)
