"""Counter statistics shared by kvpool's connectors, in vLLM's two channels: connector stats
(summed across workers and logged each interval) and Prometheus counters
(``vllm:kvpool_<prefix>_<counter>_total``).  A connector names its counters in a subclass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

__all__ = ["CounterPromMetrics", "CounterStats", "CounterStatsHooks", "register_connector"]


# A connector uses these as:
#
#     class MyStats(CounterStats):          COUNTERS = ("hits", "misses")
#     class MyProm(CounterPromMetrics):     COUNTERS = MyStats.COUNTERS; PREFIX = "mine"
#
#     class MyConnector(CounterStatsHooks, KVConnectorBase_V1):
#         STATS, PROM_METRICS = MyStats, MyProm
#         def get_kv_connector_stats(self):  return MyStats.from_counts(self._take_counts())
#
#     register_connector("MyConnector", "my.module.path")
@dataclass
class CounterStats(KVConnectorStats):
    """Counter deltas since the last report; ``data`` maps counter name -> int."""

    COUNTERS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self.COUNTERS:
            self.data.setdefault(name, 0)

    @classmethod
    def from_counts(cls, counts: Mapping[str, int]) -> Self | None:
        """Stats for one report; ``None`` when nothing happened (vLLM then sends nothing)."""
        if not any(counts.values()):
            return None
        return cls(data={name: int(counts.get(name, 0)) for name in cls.COUNTERS})

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


class CounterStatsHooks:
    """vLLM's class-level stats hooks for a connector that names its two classes.

    Put it before ``KVConnectorBase_V1`` among the bases, so that these win.
    """

    STATS: ClassVar[type[CounterStats]]
    PROM_METRICS: ClassVar[type[CounterPromMetrics]]

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> CounterStats:
        return cls.STATS(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> CounterPromMetrics:
        return cls.PROM_METRICS(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def register_connector(name: str, module_path: str) -> None:
    """Make vLLM's connector registry know ``name`` (idempotent).

    vLLM's MultiConnector rebuilds its children's stats by class *name* from the
    factory's registry, which knows only built-in connectors; a connector module calls
    this when it is imported (vLLM imports it through ``kv_connector_module_path`` in
    every process that needs it).
    """
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, module_path, name)
