"""KVPoolTransferConnector: direct P→D transfer of a request's KV blocks (the guide's L1).

kvpool's counterpart of ``MooncakeConnectorV1`` (docs/connectors.md §5); this module is
the thin vLLM adapter, the decisions live in :mod:`.scheduler` and :mod:`.worker`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvpool.config import (
    TRANSFER_CONNECTOR,
    NodeConfig,
    TransferConfig,
    config_path_from_env,
)
from kvpool.connectors.pages import CacheSet, byte_pages
from kvpool.connectors.stats import CounterStatsHooks, register_connector
from kvpool.connectors.transfer.jobs import TransferJobs
from kvpool.connectors.transfer.scheduler import TransferScheduler
from kvpool.connectors.transfer.stats import KVPoolTransferPromMetrics, KVPoolTransferStats
from kvpool.connectors.transfer.worker import RankInfo, TransferWorker
from kvpool.connectors.vllm_compat import HIT_SOURCE_P2P, ConnectorHooks
from kvpool.mooncake.settings import MooncakeNodeConfig, load_any_node_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVPoolTransferConnector", "TransferMetadata"]


@dataclass
class TransferMetadata(KVConnectorMetadata):
    """Scheduler → workers, once per step."""

    jobs: TransferJobs = field(default_factory=TransferJobs)
    # the step runs no forward: the workers may wait (idle_wait_ms) for a transfer to end
    idle: bool = False


def _node_config(env: Mapping[str, str] = os.environ) -> NodeConfig | MooncakeNodeConfig | None:
    """The node config (``mooncake.json``), if the environment names one: kvpool's, or a
    Mooncake one when the store child runs on real Mooncake (one file for both children)."""
    if config_path_from_env(env) is None:
        return None
    return load_any_node_config(env=env)


def _tp_rank(vllm_config: VllmConfig) -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except (AssertionError, RuntimeError):  # no TP group: a single-rank engine
        return 0


def _dp_rank(parallel: Any) -> int:
    """This engine's DP rank among its instance's DP engines.

    vLLM runs the DP engines of a dense (non-MoE) model as independent engines and resets
    each one's ``data_parallel_rank`` to 0 (``reconfigure_for_independent_dp_rank``);
    ``data_parallel_index`` keeps the real rank.  Port and params must use the real one,
    or every DP engine of a prefill claims ``kv_port + 0`` and only the first can listen.
    """
    index = getattr(parallel, "data_parallel_index", None)
    return int(parallel.data_parallel_rank if index is None else index)


def _cache_groups(kv_cache_config: KVCacheConfig | None) -> tuple[list[list[str]], frozenset[int]]:
    """Each KV cache group's layers, and which groups keep a recurrent state (Mamba,
    linear attention: one state per request and rank, not pages of tokens)."""
    if kv_cache_config is None:
        return [], frozenset()
    from vllm.v1.kv_cache_interface import MambaSpec

    groups = kv_cache_config.kv_cache_groups
    states = frozenset(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec))
    return [list(g.layer_names) for g in groups], states


# P pushes nothing: D pulls from P's kv_port after P has answered, so P's engine never
# waits on D.  A hybrid model (several KV cache groups, vLLM's hybrid KV cache manager on)
# moves every group: P holds each group's blocks, D pulls them group by group.
class KVPoolTransferConnector(ConnectorHooks, CounterStatsHooks, KVConnectorBase_V1, SupportsHMA):
    """vLLM connector for P→D KV transfer (pull by D from P's ``kv_port``; TCP by default)."""

    _cache_hit_source = HIT_SOURCE_P2P
    STATS = KVPoolTransferStats
    PROM_METRICS = KVPoolTransferPromMetrics

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        ktc = self._kv_transfer_config
        self._config = TransferConfig.from_values(
            role=ktc.kv_role,
            kv_port=ktc.kv_port,
            engine_id=ktc.engine_id,
            extra=ktc.kv_connector_extra_config,
            env=os.environ,
            node=_node_config(),
        )
        parallel = vllm_config.parallel_config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._group_layers, self._state_groups = _cache_groups(kv_cache_config)
        groups = max(len(self._group_layers), 1)
        self._single_group = groups == 1
        self._scheduler: TransferScheduler | None = None
        self._worker: TransferWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = TransferScheduler(
                self._config,
                block_size=self._block_size,
                tp_size=parallel.tensor_parallel_size,
                dp_rank=_dp_rank(parallel),
                num_kv_cache_groups=groups,
                state_groups=self._state_groups,
            )
        else:
            self._worker = TransferWorker(
                self._config,
                RankInfo(
                    tp_rank=_tp_rank(vllm_config),
                    tp_size=parallel.tensor_parallel_size,
                    dp_rank=_dp_rank(parallel),
                    total_kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
                ),
            )

    # -- scheduler side ----------------------------------------------------------------

    def _sched(self) -> TransferScheduler:
        assert self._scheduler is not None, "scheduler-side call on a worker connector"
        return self._scheduler

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        idle = getattr(scheduler_output, "total_num_scheduled_tokens", 0) == 0
        return TransferMetadata(self._sched().build_jobs(), idle=idle)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self._single_group:
            return self._sched().request_finished(request, block_ids[0] if block_ids else [])
        return self._sched().request_finished(request, block_ids)

    # -- worker side -------------------------------------------------------------------

    def _work(self) -> TransferWorker:
        assert self._worker is not None, "worker-side call on a scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._single_group:
            self._work().register(byte_pages(kv_caches, self._block_size))
            return
        groups = [
            byte_pages(
                {name: kv_caches[name] for name in layers},
                self._block_size,
                state=index in self._state_groups,
            )
            for index, layers in enumerate(self._group_layers)
        ]
        self._work().register(CacheSet(groups), self._state_groups)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TransferMetadata)
        if metadata.jobs:
            self._work().submit(metadata.jobs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits in WAITING_FOR_REMOTE_KVS

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # P does not push: D pulls the held blocks after P answered

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        metadata = self._connector_metadata
        idle = isinstance(metadata, TransferMetadata) and metadata.idle
        results = self._work().results(self._config.idle_wait_ms / 1000 if idle else 0.0)
        return KVConnectorTransferResults(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._work().take_load_errors()
        # Block ids are only unique within one KV cache group; with several, vLLM takes
        # failures per request only (failed_recving), which get_transfer_results reports.
        return errors if self._single_group else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- statistics (see .stats; the class-level hooks are CounterStatsHooks') ---------

    def get_kv_connector_stats(self) -> KVPoolTransferStats | None:
        if self._worker is None:
            return None
        return KVPoolTransferStats.from_counts(self._worker.take_counts())


register_connector(TRANSFER_CONNECTOR, "kvpool.connectors.transfer")
