"""KVPoolStoreConnector's vLLM adapter: it only wires the connector's halves to vLLM's hooks."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger

from kvpool.config.kv_transfer import (
    STORE_CONNECTOR as CONNECTOR_NAME,
)
from kvpool.config.kv_transfer import (
    StoreConfig,
    check_put_back,
    parse_store_config,
)
from kvpool.connectors.stats import CounterStatsHooks, register_connector
from kvpool.connectors.store import hybrid
from kvpool.connectors.store.groups import CacheGroups, HeadGroups
from kvpool.connectors.store.lookup import LookupClient, LookupServer, channel_path
from kvpool.connectors.store.plan import StorePlan
from kvpool.connectors.store.pool import PoolHandle, open_pool
from kvpool.connectors.store.scheduler import StoreScheduler
from kvpool.connectors.store.stats import (
    KVPoolStorePromMetrics,
    KVPoolStoreStats,
)
from kvpool.connectors.store.worker import StoreWorker
from kvpool.connectors.vllm_compat import HIT_SOURCE_HOST, ConnectorHooks
from kvpool.core.keys import KeyNamespace
from kvpool.engines import PoolEngine, PoolLookups
from kvpool.errors import ConfigError
from kvpool.mooncake.settings import load_any_node_config

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "KVPoolStoreConnector",
    "StoreConnectorMetadata",
    "cache_groups_for",
    "flush_saves",
    "head_groups_for",
    "namespace_for",
    "pending_saves",
]

_P = TypeVar("_P", bound=PoolLookups)  # what a handle opens: lookups or a whole engine

# Under "vllm." so that vLLM's logging setup (format, VLLM_LOGGING_LEVEL) applies to it.
logger = init_logger("vllm.kvpool.connectors.store")


class StoreConnectorMetadata(KVConnectorMetadata):
    """The scheduler half's per-step plan, as vLLM's metadata type."""

    def __init__(self, plan: StorePlan) -> None:
        self.plan = plan


def _is_mla(vllm_config: VllmConfig) -> bool:
    model = vllm_config.model_config
    hf = getattr(model, "hf_config", None)
    return bool(getattr(model, "use_mla", False) or getattr(hf, "kv_lora_rank", None))


def _spec(kv_cache_config: KVCacheConfig) -> Any:
    """The one group's spec of a plain model (one group of full attention or MLA)."""
    if not hybrid.is_plain(kv_cache_config):
        raise ConfigError(f"{CONNECTOR_NAME}: not a model with one KV cache group of attention")
    return kv_cache_config.kv_cache_groups[0].kv_cache_spec


def cache_groups_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: StoreConfig
) -> CacheGroups:
    """The model's KV cache groups as the connector stores them: a plain model's one group
    (its head groups, see :func:`head_groups_for`), or a hybrid model's groups
    (:mod:`~kvpool.connectors.store.hybrid`), each refused in one line if it cannot be."""
    if hybrid.is_plain(kv_cache_config):
        layers = kv_cache_config.kv_cache_groups[0].layer_names
        return CacheGroups.single(head_groups_for(vllm_config, kv_cache_config, config), layers)
    return hybrid.cache_groups(vllm_config, kv_cache_config, config)[0]


def head_groups_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: StoreConfig
) -> HeadGroups:
    """How a plain model's KV heads split into pool objects (see the groups module).

    MLA keeps one latent "head" that every rank holds whole: one group, written by rank 0.
    Otherwise the model's KV heads, ``head_group_size`` per object (default: one with a
    master, so any TP layout can assemble its heads; all of them with the embedded pool,
    which only one TP-1 instance ever reads)."""
    spec = _spec(kv_cache_config)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    # use_layerwise: every layer of a group is its own object (the columns of .groups)
    layers = len(kv_cache_config.kv_cache_groups[0].layer_names) if config.use_layerwise else 1
    if type(spec).__name__ == "MLAAttentionSpec":
        return HeadGroups(1, 1, tp_size, layers)
    total = vllm_config.model_config.get_total_num_kv_heads()
    if config.head_group_size:
        return HeadGroups(total, config.head_group_size, tp_size, layers)
    if config.backend == "embedded":
        whole = HeadGroups.whole(total, tp_size)
        return HeadGroups(total, whole.group_size, tp_size, layers)
    return HeadGroups(total, 1, tp_size, layers)


def namespace_for(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: StoreConfig
) -> KeyNamespace:
    """The key namespace: everything besides tokens that makes two pages interchangeable.

    The layout names the device (the CPU kernel orders tokens inside a block its own way),
    the attention kind, the model's KV heads and how many go in one object, the head sizes
    and the number of layers — never the TP size or rank: a chunk's key is the same in
    every TP layout, and each KV-head group is its own object under it.  (Keys written
    before head groups carried the rank and size: another namespace, so a miss, never
    wrong bytes.)  A hybrid model's layout names each KV cache group's spec instead.
    """
    from vllm.platforms import current_platform

    served = vllm_config.model_config.served_model_name
    model_id = config.model_id or (served[0] if isinstance(served, list) else served) or ""
    if not hybrid.is_plain(kv_cache_config):
        stored, layout = hybrid.cache_groups(vllm_config, kv_cache_config, config)
        first = kv_cache_config.kv_cache_groups[stored[0].group_id].kv_cache_spec
        return KeyNamespace(
            model=model_id or vllm_config.model_config.model,
            kv_dtype=str(vllm_config.cache_config.cache_dtype),  # each group's is in layout
            chunk_size=first.block_size,
            layout=layout,
            tenant=config.tenant,
        )
    spec = _spec(kv_cache_config)
    heads = head_groups_for(vllm_config, kv_cache_config, config)
    layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
    layout = (
        f"{current_platform.device_type}:{type(spec).__name__}:H{heads.num_kv_heads}"
        f":g{heads.group_size}"
        f":d{spec.head_size}x{getattr(spec, 'head_size_v', spec.head_size)}:L{layers}"
    )
    return KeyNamespace(
        model=model_id or vllm_config.model_config.model,
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        chunk_size=spec.block_size,
        layout=layout,
        tenant=config.tenant,
    )


# Roles: kv_producer and kv_both save what they compute; every role loads hits (a prefill
# node reuses a shared system prompt just as a decode node does); kv_consumer saves only
# with consumer_is_to_put.  Saves run off the engine step (.saves): the pages are copied
# out in wait_for_save and put by a writer thread, so no block is held past its step;
# async_saves: false puts them in the step.
class KVPoolStoreConnector(ConnectorHooks, CounterStatsHooks, KVConnectorBase_V1, SupportsHMA):
    """A vLLM v1 KV connector that keeps KV in the kvpool pool, keyed by prefix."""

    _cache_hit_source = HIT_SOURCE_HOST
    STATS = KVPoolStoreStats
    PROM_METRICS = KVPoolStorePromMetrics

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        config = parse_store_config(
            ktc.kv_role,
            ktc.kv_connector_extra_config,
            env=os.environ,
            load_node=load_any_node_config,
        )
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        check_put_back(config, is_mla=_is_mla(vllm_config), tp_size=tp_size)
        if config.backend == "embedded" and tp_size > 1:
            raise ConfigError(
                f'backend "embedded" keeps the pool inside one worker process, but'
                f" tensor_parallel_size is {tp_size} (one process per rank); use backend"
                " kvpool with a master"
            )
        groups = cache_groups_for(vllm_config, kv_cache_config, config)
        # a hybrid model's loads are async for vLLM; unless asked for (load_async: true)
        # they run in the engine step all the same, as fast as synchronous ones
        inline_async = groups.hybrid and not config.load_async
        if groups.hybrid:
            config = self._for_hybrid(config, kv_cache_config)
        self._config = config
        self._hybrid = groups.hybrid
        namespace = namespace_for(vllm_config, kv_cache_config, config)
        where = config.master or "in-process"

        channel = channel_path(
            instance_id=vllm_config.instance_id,
            engine_id=str(ktc.engine_id),
            dp_rank=vllm_config.parallel_config.data_parallel_rank,
            lookup_rpc_port=config.lookup_rpc_port,
        )

        def handle(opener: Callable[[], _P]) -> PoolHandle[_P]:
            return PoolHandle(
                opener,
                reconnect_interval_s=config.reconnect_interval_ms / 1000,
                describe=f"{config.backend}@{where}",
            )

        def pool() -> PoolEngine:
            engine = open_pool(config)
            warm = getattr(engine, "warm", None)
            if warm is not None:  # what a first read would set up, now (Client.warm)
                warm()
            return engine

        def lookups() -> PoolLookups:
            if config.backend == "embedded":  # the pool lives in the worker: ask it there
                return LookupClient(channel, timeout_s=config.lookup_timeout_ms / 1000)
            return open_pool(config, timeout_ms=config.lookup_timeout_ms, lookups=True)

        self._scheduler: StoreScheduler | None = None
        self._worker: StoreWorker | None = None
        self._lookup_server: LookupServer | None = None
        if role == KVConnectorRole.SCHEDULER:
            events = getattr(vllm_config, "kv_events_config", None)
            self._scheduler = StoreScheduler(
                namespace=namespace,
                pool=handle(lookups),
                saves=config.saves,
                load_async=config.load_async,
                logger=logger,
                groups=groups,
                events=bool(events and events.enable_kv_cache_events),
                read_your_writes=config.read_your_writes,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = StoreWorker(
                tp_rank=get_tensor_model_parallel_rank() if tp_size > 1 else 0,
                pool=handle(pool),
                loader_pool=handle(pool),
                saver_pool=handle(pool),
                logger=logger,
                groups=groups,
                save_buffer_bytes=config.save_buffer_size if config.async_saves else 0,
                drain_s=config.pool_timeout_ms / 1000,
                inline_async=inline_async,
                commit_timeout_s=config.pool_timeout_ms / 1000,
            )
            if config.backend == "embedded":
                shared = open_pool(config)
                shared.prefix_lookup([])  # create the pool now, not on the first lookup
                self._lookup_server = LookupServer(channel, shared, logger)
        logger.info(
            "[%s] role=%s, backend=%s, master=%s, load_async=%s, consumer_is_to_put=%s,"
            " async_saves=%s, read_your_writes=%s, use_layerwise=%s, lookup_rpc_port=%d,"
            " block_size=%d, half=%s",
            CONNECTOR_NAME,
            config.role,
            config.backend,
            where,
            str(config.load_async).lower(),
            str(config.consumer_is_to_put).lower(),
            str(config.async_saves).lower(),
            str(config.read_your_writes).lower(),
            str(config.use_layerwise).lower(),
            config.lookup_rpc_port,
            namespace.chunk_size,
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
        )

    @staticmethod
    def _for_hybrid(config: StoreConfig, kv_cache_config: KVCacheConfig) -> StoreConfig:
        """A hybrid model's settings: vLLM takes its failed loads only per request
        (failed_recving, which ends an async load), so loads are async and whole."""
        from dataclasses import replace

        for line in hybrid.describe_groups(kv_cache_config):
            logger.info("[%s] KV cache %s", CONNECTOR_NAME, line)
        logger.info(
            "[%s] hybrid model: loads are asynchronous and whole (use_layerwise false),"
            " the only loads whose failure vLLM takes back for a hybrid model; they run in"
            " the engine step unless load_async is true%s",
            CONNECTOR_NAME,
            " (use_layerwise is ignored)" if config.use_layerwise else "",
        )
        return replace(config, load_async=True, use_layerwise=False)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def _plan(self) -> StorePlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, StoreConnectorMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_loads(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # sync loads complete in start_load_kv, before the forward pass, unless they are
        # layer-wise: then this layer's pages may still be on their way
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole pages are saved after the forward pass, in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.finish_layer_loads()  # the forward is over: no read may outlive it
        if self.has_connector_metadata():
            self._worker.save(self._plan())

    def flush_saves(self, timeout_s: float) -> dict[str, int]:
        """Wait until this worker's saves so far are in the pool, and take the counts
        not yet reported to vLLM (see :func:`flush_saves`)."""
        if self._worker is None:
            return {}
        if not self._worker.wait_saved(timeout_s):
            raise TimeoutError(f"{CONNECTOR_NAME}: saves still queued after {timeout_s}s")
        return dict(self._worker.take_counters())

    @property
    def pending_saves(self) -> int:
        """Save batches queued or being put by this worker."""
        return 0 if self._worker is None else self._worker.pending_saves

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        done = self._worker.finished_loads(finished_req_ids)
        if not self._hybrid:
            return KVConnectorTransferResults(finished_recving=done)
        # a hybrid model's failed loads go back per request (vLLM recomputes it whole)
        return KVConnectorTransferResults(
            finished_recving=done, failed_recving=self._worker.take_failed_requests()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        self._worker.finish_layer_loads()
        return self._worker.take_invalid_block_ids()  # always empty for a hybrid model

    def get_kv_connector_stats(self) -> KVPoolStoreStats | None:
        if self._worker is not None:
            return KVPoolStoreStats.from_counts(self._worker.take_counters())
        assert self._scheduler is not None
        stats = KVPoolStoreStats.from_counts(self._scheduler.counters)
        self._scheduler.counters.clear()
        return stats

    def shutdown(self) -> None:
        if self._lookup_server is not None:
            self._lookup_server.close()
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids() if num_external_tokens > 0 else ()
        self._scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return StoreConnectorMetadata(self._scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.on_load_errors(connector_output.invalid_block_ids or ())
        self._scheduler.on_failed_loads(getattr(connector_output, "failed_recving", None) or ())

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pool's side of this instance's KV events: the chunks it saved (medium CPU,
        kvpool's memory tier) and the ones it dropped as unreadable, keyed by kvpool's
        chunk keys, with their tokens (a router keys blocks by tokens)."""
        if self._scheduler is None:
            return
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        for chunk in self._scheduler.take_events():
            if chunk.removed:
                yield BlockRemoved(block_hashes=[chunk.key], medium="CPU")
                continue
            yield BlockStored(
                block_hashes=[chunk.key],
                parent_block_hash=chunk.parent,
                token_ids=list(chunk.tokens),
                block_size=len(chunk.tokens),
                lora_id=None,
                medium="CPU",
                lora_name=None,
            )

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # saves copy their pages out in the step that computed them: no block is kept
        return self.request_finished(request, block_ids[0] if block_ids else [])


def flush_saves(timeout_s: float = 30.0) -> dict[str, int]:
    """Wait until the saves of this process's store connector (alone or as a
    MultiConnector child) are in the pool; the worker's counts not yet reported, which
    are taken (vLLM will not see them).  TimeoutError when saves are still queued.

    Saves end off the engine step, and nothing steps an offline engine after ``generate``
    returns, so the last step's saves are neither known done nor counted: offline runs
    and benchmarks that want a save's hit next call this in each worker
    (``LLM.collective_rpc``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    counts: Counter[str] = Counter()
    if not has_kv_transfer_group():
        return {}
    group = get_kv_transfer_group()
    for child in getattr(group, "_connectors", [group]):
        if isinstance(child, KVPoolStoreConnector):
            counts.update(child.flush_saves(timeout_s))
    return dict(counts)


def pending_saves() -> int:
    """Save batches this process's store connector has queued or is putting."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    group = get_kv_transfer_group()
    children = getattr(group, "_connectors", [group])
    return sum(c.pending_saves for c in children if isinstance(c, KVPoolStoreConnector))


register_connector(CONNECTOR_NAME, "kvpool.connectors.store")
