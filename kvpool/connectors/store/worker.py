"""The worker half of the store connector: copies pages between vLLM's KV cache and the pool,
one pool object per KV-head group of a page; the rules are on :class:`StoreWorker`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvpool.connectors.pages import PagedCaches, block_pages
from kvpool.connectors.store.groups import CacheGroups, GroupSlot, HeadGroups
from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolHandle, is_outage
from kvpool.connectors.store.saves import SaveBatch, SaveQueue
from kvpool.engines import MISS, PoolEngine
from kvpool.errors import (
    ChecksumMismatch,
    ConfigError,
    KVPoolError,
    ObjectNotFound,
    WriteConflict,
)

__all__ = ["LoadResult", "StoreWorker"]

# Pages staged per batch: bounds the staging memory of one load or save.
_BATCH = 16
_WARN_EVERY_S = 30.0


def _get_parts(pool: PoolEngine, keys: Sequence[str], parts: Sequence[Sequence[Any]]) -> list[int]:
    return pool.batch_get_parts(keys, parts)


def _remove(pool: PoolEngine, key: str) -> bool:
    return pool.remove(key)


def _release(pool: PoolEngine, owner: str) -> int:
    return pool.release(owner)


def _put_parts(
    pool: PoolEngine,
    keys: Sequence[str],
    parts: Sequence[Sequence[Any]],
    parents: Sequence[str | None],
) -> list[KVPoolError | None]:
    return pool.batch_put_parts(keys, parts, parents=parents)


@dataclass(frozen=True, slots=True)
class LoadResult:
    req_id: str
    loaded: int
    failed_block_ids: frozenset[int]
    dropped: int = 0  # unreadable objects removed from the pool
    loaded_bytes: int = 0

    def __add__(self, other: LoadResult) -> LoadResult:
        """The result of a request's loads in two KV cache groups."""
        return LoadResult(
            self.req_id,
            self.loaded + other.loaded,
            self.failed_block_ids | other.failed_block_ids,
            self.dropped + other.dropped,
            self.loaded_bytes + other.loaded_bytes,
        )


@dataclass(slots=True)
class _View:
    """One KV cache group's caches as this rank moves them: its pages, the head groups it
    reads (None: the page is object 0), and whether it saves them."""

    paged: PagedCaches
    heads: HeadGroups | None
    reads: tuple[GroupSlot, ...] | None = None
    writer: bool = True

    @property
    def layers(self) -> int:
        """Objects per head group and block: 1, or one per layer (use_layerwise)."""
        return 1 if self.heads is None else self.heads.layers

    @property
    def whole(self) -> bool:
        """Whether one object is this rank's whole page (one head group, or none, and not
        split into layers): then it moves as one part."""
        return (self.reads is None or len(self.reads) == 1) and self.layers == 1

    @property
    def slots(self) -> Sequence[GroupSlot | None]:
        return (None,) if self.reads is None else self.reads

    def columns(self, slot: GroupSlot | None) -> range:
        return range(1) if slot is None or self.heads is None else self.heads.columns(slot)

    @property
    def object_bytes(self) -> int:
        """Bytes of one pool object: a page, or one head group of it (of one layer,
        layer-wise)."""
        paged = self.paged
        if self.reads is None or len(self.reads) == 1:
            return paged.page_bytes // self.layers
        return self.reads[0].count * paged.head_bytes * len(paged.names) // self.layers


@dataclass(slots=True)
class _LayerLoads:
    """One step's synchronous loads, read layer by layer in the background during the
    forward pass: ``ready[i]`` is set once layer ``i`` of every block they will deliver
    has landed (or a load gave up on it), always before the job ends."""

    specs: tuple[LoadSpec, ...]
    ready: list[threading.Event]
    future: Future[list[LoadResult]]


class StoreWorker:
    """Worker-side logic of :class:`~kvpool.connectors.store.KVPoolStoreConnector`.

    A *page* is one vLLM block of every layer (see :mod:`kvpool.connectors.pages`).  Pages
    move whole and opaque — on CPU the kernel does not keep a block's tokens in position
    order, so nothing here looks inside a block.  One pool object holds one KV-head group of a
    page (:mod:`~kvpool.connectors.store.groups`): a rank loads the groups of the heads it holds
    and saves them unless a lower rank holds the same heads; when one group is all of a rank's
    heads (MLA, an embedded pool) an object is the rank's whole page.  Heads are whole inside
    a block (``[heads, block_size, row]``), so a group's part of each layer is contiguous and
    the kernel's token order inside a head is kept as it is.

    Rules:
    - A load either fills a block with exactly the bytes that were saved, or reports the block
      as failed (``invalid_block_ids``): a miss, a short or corrupt object and a dead pool all
      end the same way, and vLLM recomputes from the first failed block.  An object that was
      listed but unreadable is removed, so the recomputed copy replaces it.
    - Every async load is reported as finished exactly once, failed or not, aborted or not:
      vLLM holds the request's blocks until then.
    - The pins the scheduler's lookup took for a load (``LoadSpec.owners``) are released as
      soon as this rank's copy ends, however it ends, and before an unreadable object is
      dropped (a pinned object cannot be removed); a release that fails is left to the pins'
      TTL.
    - Saves start in ``wait_for_save``, after the step's forward pass.  By default the pages
      are copied into the connector's staging there and put into the pool by a writer thread
      (:mod:`~kvpool.connectors.store.saves`), so the step does not wait on the pool and vLLM
      may reuse the blocks at once; ``async_saves: false`` puts them in the step, straight
      from the cache (a block is never freed or reused while it is written out).  A failed
      save only costs a future hit.  A step whose plan names requests in ``commit`` (their
      answer may end with it) waits, at most ``commit_timeout_s``, until their saves are
      put or failed: an answered prompt is in the pool for every instance (read-your-writes).
    - A hybrid model (several KV cache groups, :class:`~kvpool.connectors.store.groups.CacheGroups`)
      has a page per group: its layers' rows of a block, whatever their shapes (a recurrent
      state's padded block included).  A request's load is its LoadSpecs, one per group,
      run as one job: the pins are released once all have run, and a failure in any group
      fails the request (vLLM reports a hybrid model's failed loads per request, and
      recomputes it).
    - A request's blocks move in batches of up to ``_BATCH`` pages (all their groups), one
      engine call per batch
      (:meth:`~kvpool.engines.PoolEngine.batch_get_parts`,
      :meth:`~kvpool.engines.PoolEngine.batch_put_parts`) instead of one per block.
    - CPU caches move in place: each page is handed to the engine as its L layer rows
      (:meth:`~kvpool.connectors.pages.PagedCaches.block_parts`), so an engine that can (Mooncake,
      on a registered cache) moves them with no copy, and one that cannot copies once through
      its own staging.  A read in place may write a block before its checksum fails: that
      block is reported failed like any other, and vLLM recomputes it.  Caches on a device
      go through host staging pages allocated once per worker thread and reused (a save and
      an async load run on different threads), never a fresh page per load.
    - Each pool call goes through a :class:`~kvpool.connectors.store.pool.PoolHandle`, so a
      dead pool fails fast instead of stalling every step for a timeout.
    - Layer-wise (``use_layerwise``: one object per layer of a group, the columns of
      :class:`~kvpool.connectors.store.groups.HeadGroups`): a synchronous load reads layer
      after layer in a thread of its own, and ``wait_layer`` lets vLLM's forward pass into
      layer N as soon as layer N has landed, while N+1 is read.  A layer a failure cut short
      still sets its event (the forward never waits forever; its calls are bounded by the
      pool's timeout), and the blocks from the failed one on are reported failed: vLLM drops
      that step's output for the request and recomputes them.  Every such load is joined
      by the end of its step (``finish_layer_loads``), so no read writes into a block after
      the step that planned it.  Caches on a device stage each layer through host
      pages and copy it to the device before its event is set.
    """

    def __init__(
        self,
        *,
        tp_rank: int,
        pool: PoolHandle[PoolEngine],
        loader_pool: PoolHandle[PoolEngine],
        logger: logging.Logger,
        groups: CacheGroups | HeadGroups | None = None,
        save_buffer_bytes: int = 0,
        drain_s: float = 5.0,
        saver_pool: PoolHandle[PoolEngine] | None = None,
        inline_async: bool = False,
        commit_timeout_s: float = 10.0,
    ) -> None:
        """``save_buffer_bytes``: staging for saves off the step (0: saves in the step,
        see :mod:`~kvpool.connectors.store.saves`); ``drain_s``: how long shutdown lets
        queued saves finish; ``saver_pool``: the writer thread's own connection (else the
        step's), so that a put in progress never holds up a load in the step;
        ``commit_timeout_s``: how long a step waits for the saves of requests it may end."""
        self._commit_timeout_s = commit_timeout_s
        # after a commit wait ran out: the writer's finished batches then (FIFO, one
        # writer: once that count moves, the put it ran out on has ended)
        self._stuck_at: int | None = None
        self._rank = tp_rank
        # None: one object per (chunk, rank) page, group 0 (tests and benches)
        self._cache_groups = groups if isinstance(groups, CacheGroups) else None
        self._groups = groups[0].heads if isinstance(groups, CacheGroups) else groups
        self._pool = pool
        self._loader_pool = loader_pool  # async loads run on their own connection
        self._log = logger
        self._views: list[_View] = []  # one per KV cache group, once registered
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future[LoadResult], threading.Event]] = {}
        self._invalid: set[int] = set()
        self._failed_requests: set[str] = set()  # hybrid: loads failed as a whole
        self._inline_async = inline_async
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._last_save_warning = -_WARN_EVERY_S
        self._staging = threading.local()  # staged caches: one page batch per thread
        self._save_buffer_bytes = save_buffer_bytes
        self._drain_s = drain_s
        self._saves: SaveQueue | None = None
        self._saver_pool = saver_pool or pool
        self._save_ids = 0
        self._layer_loads: _LayerLoads | None = None
        self._layer_index: dict[str, int] = {}
        self._layer_executor: ThreadPoolExecutor | None = None

    @property
    def paged(self) -> PagedCaches | None:
        """The first (with one KV cache group, the only) group's pages."""
        return self._views[0].paged if self._views else None

    @paged.setter
    def paged(self, paged: PagedCaches) -> None:
        # tests and benches put staged pages in place of registered ones (the device path)
        self._views[0].paged = paged

    @property
    def _hybrid(self) -> bool:
        """A hybrid model's caches: one page per group, failures per request."""
        return self._cache_groups is not None and self._cache_groups.hybrid

    @property
    def _layers(self) -> int:
        """Objects per group and block: 1, or one per layer (use_layerwise)."""
        return 1 if self._groups is None else self._groups.layers

    @property
    def object_bytes(self) -> int:
        """Bytes of one pool object of the first KV cache group."""
        assert self._views
        return self._views[0].object_bytes

    @staticmethod
    def _split_layers(view: _View, parts: list[list[Any]]) -> list[list[Any]]:
        """Layer-wise, each object's L layer parts become L objects of one part each."""
        if view.layers == 1:
            return parts
        return [[part] for object_parts in parts for part in object_parts]

    def _pages(
        self, view: _View, block_ids: Sequence[int], slots: Sequence[GroupSlot | None]
    ) -> tuple[list[list[Any]], Any]:
        """The parts of the objects of ``block_ids`` (each block's ``slots`` in turn): the
        cache's own rows (CPU), or this thread's reused staging pages (device caches;
        returned too, to scatter or gather)."""
        paged = view.paged
        whole = view.whole
        if not paged.staged:
            return [
                paged.block_parts(b) if whole or slot is None
                else paged.head_parts(b, slot.head_start, slot.count)
                for b in block_ids for slot in slots
            ], None  # fmt: skip
        host, tensor = self._stage(paged)
        hb = paged.head_bytes
        layers = range(len(paged.names))
        return [
            [tensor[j]] if whole or slot is None
            else [tensor[j, i, slot.head_start * hb : (slot.head_start + slot.count) * hb]
                  for i in layers]
            for j in range(len(block_ids)) for slot in slots
        ], host  # fmt: skip

    def _stage(self, paged: PagedCaches) -> tuple[Any, torch.Tensor]:
        """This thread's staging pages of ``paged`` (device caches): ``_BATCH`` pages,
        allocated once."""
        stages = getattr(self._staging, "pages", None)
        if stages is None:
            stages = self._staging.pages = {}
        pages = stages.get(id(paged))
        if pages is None:
            host = paged.new_pages(_BATCH)
            # a CPU tensor over the same memory: an engine that registers big CPU
            # tensors (Mooncake, from 16 MiB) then moves the staging in place
            pages = stages[id(paged)] = (host, torch.from_numpy(host))
        return pages

    def register(
        self, kv_caches: Mapping[str, torch.Tensor], *, staged: bool | None = None
    ) -> None:
        """Take vLLM's caches (``staged``: see :func:`~kvpool.connectors.pages.block_pages`):
        with several KV cache groups, each group's layers are its own pages."""
        if self._cache_groups is None or not self._cache_groups.hybrid:
            self._views = [self._view(block_pages(kv_caches, staged=staged), self._groups)]
        else:
            views = []
            for group in self._cache_groups:
                missing = [name for name in group.layers if name not in kv_caches]
                if missing:
                    raise ConfigError(
                        f"[KVPoolStoreConnector] KV cache group {group.group_id}: vLLM"
                        f" registered no KV cache for layers {missing}"
                    )
                layers = {name: kv_caches[name] for name in group.layers}
                views.append(self._view(block_pages(layers, staged=staged), group.heads))
            self._views = views
        paged = self._views[0].paged
        self._layer_index = {name: i for i, name in enumerate(paged.names)}
        if self._layers > 1 and self._layers != len(paged.names):
            raise ConfigError(
                f"[KVPoolStoreConnector] use_layerwise: the KV cache has {len(paged.names)}"
                f" layers but the scheduler keyed {self._layers}"
            )

        self._start_saves()
        # the pool opened with the KV caches (the guide's "every node registers memory":
        # a Mooncake worker's segment is in the pool before its first request), and the
        # async loads' connection too: a fresh instance's first hit sets nothing up
        if self._loader_pool is not self._pool:
            self._loader_pool.open()
        if not self._pool.open():
            self._log.warning(
                "[KVPoolStoreConnector] pool not reachable at start (%s); trying again at"
                " the first load or save",
                self._pool.last_error,
            )

    def _view(self, paged: PagedCaches, heads: HeadGroups | None) -> _View:
        """One group's pages, the head groups this rank reads, and whether it saves them (a
        rank that holds the same heads as a lower one does not).  One head group is the
        whole page: it moves as one part per layer, as without groups."""
        if heads is None:
            return _View(paged, None)
        reads, writes = heads.reads(self._rank), heads.writes(self._rank)
        held = sum(slot.count for slot in reads)
        if held != paged.num_heads and len(reads) > 1:
            raise ConfigError(
                f"[KVPoolStoreConnector] TP rank {self._rank}'s KV cache shows"
                f" {paged.num_heads} KV heads per block but the head groups give it {held}"
                f" ({heads}): this KV cache layout cannot be split by head; set"
                f' kv_connector_extra_config "head_group_size": {held} (one object per rank,'
                " shared only with instances of the same TP size)"
            )
        return _View(paged, heads, reads, bool(writes))

    def _start_saves(self) -> None:
        """The save queue and its staging, when saves run off the step (and this rank
        writes at all).  A slot holds one page of the largest group (hybrid models)."""
        if not self._save_buffer_bytes or self._saves is not None:
            return
        if not any(view.writer for view in self._views):
            return
        page_bytes = max(view.paged.page_bytes for view in self._views)
        capacity = self._save_buffer_bytes // page_bytes
        if capacity == 0:
            self._log.warning(
                "[KVPoolStoreConnector] save_buffer_size %d bytes holds no page of %d bytes;"
                " saving in the engine step (raise save_buffer_size to save off the step)",
                self._save_buffer_bytes,
                page_bytes,
            )
            return
        host = (
            self._views[0].paged.new_pages(capacity)
            if not self._hybrid
            else np.empty((capacity, page_bytes), dtype=np.uint8)
        )
        self._saves = SaveQueue(
            host,
            write=partial(self._put, handle=self._saver_pool),
            counters=self.counters,
            lock=self._lock,
            logger=self._log,
        )

    # ------------------------------------------------------------------ loads

    def start_loads(self, plan: StorePlan) -> None:
        layered = self._layers > 1 and self.paged is not None
        if layered and (sync := tuple(s for s in plan.loads if not s.is_async)):
            self._start_layer_loads(sync)
        requests: dict[str, list[LoadSpec]] = {}  # a request's specs: one per cache group
        for spec in plan.loads:
            if not spec.is_async and layered:
                continue  # in the layer-wise job
            requests.setdefault(spec.req_id, []).append(spec)
        for req_id, specs in requests.items():
            if not specs[0].is_async:
                self._record(self._load(specs, self._pool, None))
                continue
            if self._inline_async:  # async for vLLM, done in this step all the same
                done: Future[LoadResult] = Future()
                try:
                    done.set_result(self._load(specs, self._pool, None))
                except Exception as exc:  # reported as a crashed load, never lost
                    done.set_exception(exc)
                self._inflight[req_id] = (done, threading.Event())
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-store-load")
            cancel = threading.Event()
            future = self._executor.submit(self._load, specs, self._loader_pool, cancel)
            self._inflight[req_id] = (future, cancel)

    def _start_layer_loads(self, specs: tuple[LoadSpec, ...]) -> None:
        """Read this step's ``specs`` layer by layer in the background (see the rules)."""
        assert self.paged is not None and self._layer_loads is None
        if self._layer_executor is None:
            self._layer_executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-store-layers")
        ready = [threading.Event() for _ in self.paged.names]
        # its own connection: the step's may be busy with a save in the step meanwhile
        future = self._layer_executor.submit(self._load_layers, specs, self._loader_pool, ready)
        self._layer_loads = _LayerLoads(specs, ready, future)

    def wait_layer(self, layer_name: str) -> None:
        """Return once layer ``layer_name`` of this step's layer-wise loads is in."""
        index = self._layer_index.get(layer_name)
        if index is not None and self._layer_loads is not None:
            self._layer_loads.ready[index].wait()  # set by the job, however it ends

    def finish_layer_loads(self) -> None:
        """Join this step's layer-wise loads and record them (their failures reach vLLM
        in this step's ``get_block_ids_with_load_errors``)."""
        job, self._layer_loads = self._layer_loads, None
        if job is None:
            return
        try:
            results = job.future.result()
        except Exception as exc:  # a bug in the loader: nothing it wrote can be trusted
            self._log.error("[KVPoolStoreConnector] layer-wise load crashed: %s", exc)
            results = [LoadResult(s.req_id, 0, frozenset(s.block_ids)) for s in job.specs]
        for result in results:
            self._record(result)

    def _unpinner(self, spec: LoadSpec, handle: PoolHandle[PoolEngine]) -> Callable[[], None]:
        """Releases the pins the scheduler took for ``spec``, once, when first called."""
        owner = spec.owners[self._rank] if spec.owners else None
        unpinned = False

        def unpin() -> None:  # once, as soon as the pins have served
            nonlocal unpinned
            if owner is not None and not unpinned:
                unpinned = True
                self._unpin(handle, owner)

        return unpin

    def _load(
        self,
        specs: Sequence[LoadSpec],
        handle: PoolHandle[PoolEngine],
        cancel: threading.Event | None,
    ) -> LoadResult:
        """One request's loads (one spec per KV cache group), its pins released once all
        have run; the first failure ends the request's load (a hybrid model recomputes it
        whole)."""
        unpin = self._unpinner(specs[0], handle)
        try:
            if self._hybrid and not any(self._views[s.group].paged.staged for s in specs):
                return self._copy_groups(specs, handle, cancel, unpin)
            result = self._load_one(specs[0], handle, cancel, unpin)
            for spec in specs[1:]:
                if result.failed_block_ids:
                    failed = frozenset(b for s in specs[1:] for b in s.block_ids)
                    return result + LoadResult(spec.req_id, 0, failed)
                result += self._load_one(spec, handle, cancel, unpin)
            return result
        finally:
            unpin()

    def _copy_groups(
        self,
        specs: Sequence[LoadSpec],
        handle: PoolHandle[PoolEngine],
        cancel: threading.Event | None,
        unpin: Callable[[], None],
    ) -> LoadResult:
        """A hybrid model's load, every group's objects in the same engine calls (a
        group may have only a few small objects: a window's last blocks, one state), read
        in place into the CPU cache.  A failure fails the request (vLLM recomputes it)."""
        req_id = specs[0].req_id
        every = frozenset(b for spec in specs for b in spec.block_ids)
        keys: list[str] = []
        parts: list[Sequence[Any]] = []
        sizes: list[int] = []
        nbytes = 0
        for spec in specs:
            view = self._views[spec.group]
            spec_parts, _ = self._pages(view, spec.block_ids, view.slots)
            keys += self._object_keys(view, spec.keys, view.slots)
            parts += spec_parts
            sizes += [view.object_bytes] * len(spec_parts)
            nbytes += len(spec.block_ids) * view.paged.page_bytes
        step = _BATCH * 4  # objects per engine call: many are small here
        for start in range(0, len(keys), step):
            if cancel is not None and cancel.is_set():
                return LoadResult(req_id, 0, frozenset())  # aborted: nobody reads them
            end = start + step
            good, failure = self._read(handle, keys[start:end], parts[start:end], sizes[start:end])
            if failure is not None:
                key = keys[start + good]
                self._log.warning(
                    "[KVPoolStoreConnector] load of %s for request %s failed: %s: %s",
                    key, req_id, type(failure).__name__, failure,
                )  # fmt: skip
                unpin()  # the load is over, and a pinned object cannot be removed
                dropped = int(self._drop_unreadable(handle, key, failure))
                return LoadResult(req_id, 0, every, dropped)
        loaded = sum(len(spec.block_ids) for spec in specs)
        return LoadResult(req_id, loaded, frozenset(), 0, nbytes)

    def _load_one(
        self,
        spec: LoadSpec,
        handle: PoolHandle[PoolEngine],
        cancel: threading.Event | None,
        unpin: Callable[[], None],
    ) -> LoadResult:
        if self._layers == 1:
            return self._copy(spec, handle, cancel, unpin)
        reader = self._copy_layers(spec, handle, unpin)
        while True:  # an async load: layer after layer, nobody waits on one
            if cancel is not None and cancel.is_set():
                return LoadResult(spec.req_id, 0, frozenset())  # aborted: nobody reads
            try:
                next(reader)
            except StopIteration as done:
                result: LoadResult = done.value
                return result

    def _load_layers(
        self,
        specs: Sequence[LoadSpec],
        handle: PoolHandle[PoolEngine],
        ready: Sequence[threading.Event],
    ) -> list[LoadResult]:
        """One step's synchronous loads, layer-major: layer 0 of every request, then
        layer 1, ...; ``ready[i]`` is set when layer ``i`` is in for all of them."""
        unpins = [self._unpinner(spec, handle) for spec in specs]
        try:
            readers = [
                self._copy_layers(spec, handle, unpin)
                for spec, unpin in zip(specs, unpins, strict=True)
            ]
            results: dict[int, LoadResult] = {}
            for layer in range(self._layers + 1):  # the last round collects the results
                for i, reader in enumerate(readers):
                    if i not in results:
                        try:
                            next(reader)
                        except StopIteration as done:
                            results[i] = done.value
                if layer < len(ready):
                    ready[layer].set()
            return [results[i] for i in range(len(specs))]
        finally:
            for unpin in unpins:
                unpin()
            for event in ready:
                event.set()  # the forward pass never waits on a load that is over

    def _unpin(self, handle: PoolHandle[PoolEngine], owner: str) -> None:
        """The load's pins have served: let the pool evict those blocks again."""
        try:
            handle.call(partial(_release, owner=owner))
        except Exception:  # the pins' TTL ends them anyway
            with self._lock:
                self.counters["pin_errors"] += 1

    def _copy(
        self,
        spec: LoadSpec,
        handle: PoolHandle[PoolEngine],
        cancel: threading.Event | None,
        unpin: Callable[[], None],
    ) -> LoadResult:
        if not self._views:
            return LoadResult(spec.req_id, 0, frozenset(spec.block_ids))
        view = self._views[spec.group]
        paged = view.paged
        slots = view.slots
        keys = self._object_keys(view, spec.keys, slots)
        per = len(slots)  # objects per block
        loaded = 0
        for start in range(0, len(spec.block_ids), _BATCH):
            if cancel is not None and cancel.is_set():
                # Aborted: vLLM frees the blocks once we report; nobody reads them.
                return LoadResult(spec.req_id, loaded, frozenset())
            batch = keys[start * per : (start + _BATCH) * per]
            block_ids = spec.block_ids[start : start + _BATCH]
            parts, staging = self._pages(view, block_ids, slots)
            good_objects, failure = self._read(handle, batch, parts, view.object_bytes)
            good = good_objects // per  # a block is good when all its groups are
            if staging is not None:
                paged.scatter(block_ids[:good], staging)
            loaded += good
            if failure is not None:
                key = batch[good_objects]
                self._log.warning(
                    "[KVPoolStoreConnector] load of %s for request %s failed: %s: %s",
                    key,
                    spec.req_id,
                    type(failure).__name__,
                    failure,
                )
                unpin()  # the load is over, and a pinned object cannot be removed
                dropped = int(self._drop_unreadable(handle, key, failure))
                failed = frozenset(spec.block_ids[start + good :])
                nbytes = loaded * paged.page_bytes
                return LoadResult(spec.req_id, loaded, failed, dropped, nbytes)
        return LoadResult(spec.req_id, loaded, frozenset(), 0, loaded * paged.page_bytes)

    def _copy_layers(
        self, spec: LoadSpec, handle: PoolHandle[PoolEngine], unpin: Callable[[], None]
    ) -> Generator[None, None, LoadResult]:
        """Layer-wise: every block's layer 0, then layer 1, ..., yielding after each
        layer; blocks [0, good) stay intact in every layer read so far, and a failure
        shortens ``good`` for the layers after it.  Returns the load's result."""
        if not self._views:
            return LoadResult(spec.req_id, 0, frozenset(spec.block_ids))
        view = self._views[spec.group]
        paged = view.paged
        slots = view.slots
        per = len(slots)  # objects per block and layer
        good, dropped = len(spec.block_ids), 0
        # in place, a layer's blocks go in few calls; staged, as many as the staging holds
        step = _BATCH if paged.staged else _BATCH * self._layers
        for layer in range(self._layers):
            keys = self._object_keys(view, spec.keys, slots, layer)
            for start in range(0, good, step):
                blocks = spec.block_ids[start : min(good, start + step)]
                pages, host = self._pages(view, blocks, slots)
                batch = keys[start * per : (start + len(blocks)) * per]
                parts = [[p[layer]] for p in pages]
                n, failure = self._read(handle, batch, parts, view.object_bytes)
                if host is not None:  # staged: this layer of the blocks read whole
                    paged.scatter(blocks[: n // per], host, layer=layer)
                if failure is None:
                    continue
                key = batch[n]
                self._log.warning(
                    "[KVPoolStoreConnector] load of %s (layer %d) for request %s failed: %s: %s",
                    key, layer, spec.req_id, type(failure).__name__, failure,
                )  # fmt: skip
                good = start + n // per
                unpin()  # a pinned object cannot be removed
                dropped += int(self._drop_unreadable(handle, key, failure))
                break
            yield
        failed = frozenset(spec.block_ids[good:])
        return LoadResult(spec.req_id, good, failed, dropped, good * paged.page_bytes)

    @staticmethod
    def _object_keys(
        view: _View,
        keys: Sequence[Sequence[str | None]],
        slots: Sequence[GroupSlot | None],
        layer: int | None = None,
    ) -> list[Any]:
        """This rank's object keys block by block (each block's ``slots`` in turn, each
        slot's layers in turn when layer-wise; only ``layer``'s when given)."""
        columns = [
            keys[c]
            for slot in slots
            for c in view.columns(slot)
            if layer is None or c % view.layers == layer
        ]
        return [column[i] for i in range(len(columns[0])) for column in columns]

    def _read(
        self,
        handle: PoolHandle[PoolEngine],
        keys: Sequence[str],
        parts: Sequence[Sequence[Any]],
        page_bytes: int | Sequence[int],
    ) -> tuple[int, Exception | None]:
        """Read ``keys`` into their objects' ``parts`` (``page_bytes`` each, or each its
        own): how many leading objects are good, and why the one after them is not (None
        when all are).  Objects from there on may hold anything (a read in place): the
        caller reports their blocks failed."""
        sizes_wanted = [page_bytes] * len(keys) if isinstance(page_bytes, int) else page_bytes
        try:
            sizes = handle.call(partial(_get_parts, keys=keys, parts=parts))
        except Exception as exc:
            if is_outage(exc) or len(keys) == 1:
                return 0, exc
            # An answer about one object failed the whole batch (an object larger than a
            # page): read them one by one to find which, so that the right one is dropped.
            for j in range(len(keys)):
                one = sizes_wanted[j : j + 1]
                _, failure = self._read(handle, keys[j : j + 1], parts[j : j + 1], one)
                if failure is not None:
                    return j, failure
            return len(keys), None
        for j, (n, want) in enumerate(zip(sizes, sizes_wanted, strict=True)):
            if n == MISS:
                return j, ObjectNotFound(f"{keys[j]}: missing, corrupt or unreachable")
            if n != want:
                return j, ChecksumMismatch(f"object {keys[j]} has {n} bytes, expected {want}")
        return len(keys), None

    def _drop_unreadable(self, handle: PoolHandle[PoolEngine], key: str, exc: Exception) -> bool:
        """Remove an object the pool listed but could not deliver intact (corrupt, short,
        or on a dead node), so that the copy vLLM now recomputes replaces it instead of
        failing every later hit.  Best effort: an outage or a reader's lease leaves it."""
        if is_outage(exc):
            return False
        try:
            return bool(handle.call(partial(_remove, key=key)))
        except Exception:  # busy (leased by a reader) or gone: the next failure retries
            return False

    def _record(self, result: LoadResult) -> None:
        with self._lock:
            if self._hybrid and result.failed_block_ids:
                self._failed_requests.add(result.req_id)  # vLLM takes them per request
            else:
                self._invalid |= result.failed_block_ids
            self.counters["loaded_blocks"] += result.loaded
            self.counters["failed_blocks"] += len(result.failed_block_ids)
            self.counters["dropped_blocks"] += result.dropped
            self.counters["loaded_bytes"] += result.loaded_bytes

    def finished_loads(self, finished_req_ids: Iterable[str]) -> set[str]:
        """Async loads that completed (or failed) since the last call; cancels the loads of
        requests vLLM reports finished (aborted), which are then reported once they stop."""
        for req_id in finished_req_ids:
            entry = self._inflight.get(req_id)
            if entry is not None:
                entry[1].set()
        done: set[str] = set()
        for req_id, (future, _) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[req_id]
            try:
                self._record(future.result())
            except Exception as exc:  # a bug in the loader must not hang the request
                self._log.error("[KVPoolStoreConnector] async load %s crashed: %s", req_id, exc)
            done.add(req_id)
        return done

    def take_invalid_block_ids(self) -> set[int]:
        with self._lock:
            invalid, self._invalid = self._invalid, set()
        return invalid

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed as a whole since the last call (hybrid models:
        vLLM's failed_recving; they are also among the finished loads)."""
        with self._lock:
            failed, self._failed_requests = self._failed_requests, set()
        return failed

    # ------------------------------------------------------------------ saves

    def save(self, plan: StorePlan) -> None:
        if not self._views:
            return
        for spec in plan.saves:
            self._save_one(spec, self._views[spec.group])
        if plan.commit and self._saves is not None:
            self._commit(plan.commit, self._saves)

    def _commit(self, req_ids: Sequence[str], queue: SaveQueue) -> None:
        """Wait until the saves of ``req_ids`` are put (or failed), so that their answers
        leave the engine with their prefixes in the pool.  After a wait that ran out, no
        step waits again until the writer has emptied its queue: a hung pool holds one
        answer for ``commit_timeout_s``, not every answer behind it."""
        started = time.perf_counter()
        if queue.wait_saved(req_ids, 0):
            return
        if self._stuck_at is not None:
            if queue.finished == self._stuck_at:  # the put it ran out on has not ended
                with self._lock:
                    self.counters["late_commits"] += 1
                return
            self._stuck_at = None
        done = queue.wait_saved(req_ids, self._commit_timeout_s)
        if not done:
            self._stuck_at = queue.finished
        waited_us = int((time.perf_counter() - started) * 1e6)
        with self._lock:
            self.counters["commit_waits"] += 1
            self.counters["commit_wait_us"] += waited_us
            if not done:
                self.counters["late_commits"] += 1
        now = time.monotonic()
        if not done and now - self._last_save_warning >= _WARN_EVERY_S:  # one per outage
            self._last_save_warning = now
            self._log.warning(
                "[KVPoolStoreConnector] saves of %s not in the pool after %.1fs: their"
                " answers go out first (the prefix is found once the puts end)",
                ",".join(req_ids),
                self._commit_timeout_s,
            )

    def _save_one(self, spec: SaveSpec, view: _View) -> None:
        if not view.writer:
            return  # a lower rank holds (and saves) the same heads
        paged = view.paged
        slots = view.slots
        per = len(slots) * view.layers
        keys = self._object_keys(view, spec.keys, slots)
        # each group's chunk hangs off the same group's chunk before it
        parents = self._object_keys(
            view, [(p, *ks[:-1]) for p, ks in zip(spec.parents, spec.keys, strict=True)], slots
        )
        queue = self._saves
        size = _BATCH if queue is None else min(_BATCH, queue.capacity)
        self._save_ids += 1
        for start in range(0, len(spec.block_ids), size):
            block_ids = spec.block_ids[start : start + size]
            batch = SaveBatch(
                save_id=self._save_ids,
                req_id=spec.req_id,
                keys=keys[start * per : (start + size) * per],
                parts=[],
                parents=parents[start * per : (start + size) * per],
                pages=[],
                group=spec.group,
            )
            pages = None if queue is None else queue.acquire(len(block_ids))
            if queue is None or pages is None:  # synchronous (or shutting down)
                parts, staging = self._pages(view, block_ids, slots)
                batch.parts = self._split_layers(view, parts)
                if staging is not None:
                    paged.gather(block_ids, staging)
                if not self._put(batch, self._pool):
                    return
                continue
            # off the step: copy the pages out now, put them in the writer thread
            host, tensor = self._queue_pages(queue, paged)
            for j, first, count in queue.runs(pages):
                paged.gather(block_ids[j : j + count], host[first : first + count])
            batch.pages = pages
            batch.parts = self._split_layers(view, self._staged_parts(view, tensor, pages, slots))
            queue.submit(batch)

    def _queue_pages(self, queue: SaveQueue, paged: PagedCaches) -> tuple[Any, torch.Tensor]:
        """The save queue's staging seen as ``paged``'s pages, ``[slot, layer, bytes]``
        (a hybrid model's slots fit the largest group's page: a group uses their head)."""
        if not self._hybrid:
            return queue.host, queue.tensor
        shape = (queue.capacity, len(paged.names), paged.layer_page_bytes)
        host = queue.host[:, : paged.page_bytes].reshape(shape)
        return host, queue.tensor[:, : paged.page_bytes].view(shape)

    @staticmethod
    def _staged_parts(
        view: _View, tensor: torch.Tensor, pages: Sequence[int], slots: Sequence[GroupSlot | None]
    ) -> list[list[Any]]:
        """The objects' parts in the save queue's staging pages (each page's ``slots``)."""
        hb = view.paged.head_bytes
        whole = view.whole
        layers = range(len(view.paged.names))
        return [
            [tensor[j]] if whole or slot is None
            else [tensor[j, i, slot.head_start * hb : (slot.head_start + slot.count) * hb]
                  for i in layers]
            for j in pages for slot in slots
        ]  # fmt: skip

    def _put(self, batch: SaveBatch, handle: PoolHandle[PoolEngine]) -> bool:
        """Put one batch (in the step, or in the save queue's writer); False when the
        rest of its save must stop (the chain hangs off the chunk that failed)."""
        view = self._views[batch.group]
        per = len(view.slots) * view.layers
        try:
            results = handle.call(
                partial(_put_parts, keys=batch.keys, parts=batch.parts, parents=batch.parents)
            )
        except Exception as exc:
            self._save_failed(batch.req_id, batch.keys[0], exc)
            return False
        saved = sum(1 for r in results if r is None)
        with self._lock:
            self.counters["saved_blocks"] += saved // per
            self.counters["saved_bytes"] += saved * view.object_bytes
        for key, error in zip(batch.keys, results, strict=True):
            # Another instance writing the same chunk right now is no failure.
            if error is not None and not isinstance(error, WriteConflict):
                self._save_failed(batch.req_id, key, error)
                return False
        return True

    def wait_saved(self, timeout_s: float) -> bool:
        """Wait until every save handed off so far is in the pool (or failed); False at
        the timeout.  Nothing steps an offline engine after ``generate`` returns: a
        caller that wants a save's hit next waits here."""
        return self._saves is None or self._saves.wait_idle(timeout_s)

    @property
    def pending_saves(self) -> int:
        """Save batches queued or being put (0 when saves run in the step)."""
        return 0 if self._saves is None else self._saves.pending

    def take_counters(self) -> Counter[str]:
        """The counts since the last call (the writer thread counts too)."""
        with self._lock:
            counts = Counter(self.counters)
            self.counters.clear()
        return counts

    def _save_failed(self, req_id: str, key: str, exc: BaseException) -> None:
        with self._lock:
            self.counters["save_errors"] += 1
        now = time.monotonic()
        if now - self._last_save_warning >= _WARN_EVERY_S:  # one line per outage
            self._last_save_warning = now
            self._log.warning(
                "[KVPoolStoreConnector] save of %s for request %s failed: %s: %s"
                " (further save failures within %.0fs are only counted)",
                key,
                req_id,
                type(exc).__name__,
                exc,
                _WARN_EVERY_S,
            )

    def shutdown(self) -> None:
        self.finish_layer_loads()
        if self._layer_executor is not None:
            self._layer_executor.shutdown(wait=True)
        # a put still hung in the pool holds its connection: leave that one to the thread
        writer_done = self._saves is None or self._saves.close(self._drain_s)
        for _, cancel in self._inflight.values():
            cancel.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=False)
        self._pool.close()
        self._loader_pool.close()
        if self._saver_pool is not self._pool and writer_done:
            self._saver_pool.close()
