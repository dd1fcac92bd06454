"""The worker half of the store connector: copies pages between vLLM's KV cache and the pool.

A *page* is one vLLM block of every layer: ``kv[layer][block_id]`` for each layer, stacked.
Pages move whole and opaque — on CPU the kernel does not keep a block's tokens in position
order, so nothing here looks inside a block.  One pool object holds one page of one TP rank.

Rules:
- A load either fills a block with exactly the bytes that were saved, or reports the block
  as failed (``invalid_block_ids``): a miss, a short or corrupt object and a dead pool all
  end the same way, and vLLM recomputes from the first failed block.  An object that was
  listed but unreadable is removed, so the recomputed copy replaces it.
- Every async load is reported as finished exactly once, failed or not, aborted or not:
  vLLM holds the request's blocks until then.
- Saves happen in ``wait_for_save``, after the step's forward pass, synchronously: a block
  is never freed or reused while it is being written out.  A failed save only costs a
  future hit.
- Each pool call goes through a :class:`~kvpool.connectors.store.pool.PoolHandle`, so a
  dead pool fails fast instead of stalling every step for a timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from kvpool.connectors.store.plan import LoadSpec, SaveSpec, StorePlan
from kvpool.connectors.store.pool import PoolClient, PoolHandle, is_outage
from kvpool.errors import ChecksumMismatch, WriteConflict

__all__ = ["LoadResult", "PagedKV", "StoreWorker"]

# Pages staged per batch: bounds the staging memory of one load or save.
_BATCH = 16
_WARN_EVERY_S = 30.0


class PagedKV:
    """vLLM's per-layer KV tensors seen as pages (one block of every layer), as bytes.

    Copies go through NumPy byte views of the KV tensors: a plain single-threaded memcpy
    per layer page.  Torch's ``copy_`` would open an OpenMP parallel region per 256 KiB
    page, and on a loaded host (vLLM pins its OpenMP threads to cores) each region can
    wait a scheduler tick: measured 0.5 s instead of 5 ms for a 24 MiB load.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise ValueError("store connector: vLLM registered no KV cache tensors")
        self.layer_names = list(kv_caches)
        tensors = [kv_caches[name] for name in self.layer_names]
        first = tensors[0]
        for name, t in zip(self.layer_names, tensors, strict=True):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"store connector: layer {name} has KV shape {tuple(t.shape)} {t.dtype},"
                    f" unlike {tuple(first.shape)} {first.dtype}; mixed layouts are unsupported"
                )
            if not t.is_contiguous():
                raise ValueError(f"store connector: layer {name}'s KV cache is not contiguous")
        self.num_blocks = int(first.shape[0])
        self.layer_page_bytes = first[0].numel() * first.element_size()
        # [num_blocks, layer_page_bytes] byte views sharing the tensors' memory
        self._layers: list[np.ndarray[Any, Any]] = [
            t.detach().view(torch.uint8).numpy().reshape(self.num_blocks, -1) for t in tensors
        ]
        self.page_bytes = self.layer_page_bytes * len(tensors)

    def new_pages(self, n: int) -> np.ndarray[Any, Any]:
        """Staging for ``n`` pages: ``[n, layers, layer_page_bytes]`` bytes."""
        return np.empty((n, len(self._layers), self.layer_page_bytes), dtype=np.uint8)

    def gather(self, block_ids: Iterable[int], out: np.ndarray[Any, Any]) -> None:
        for j, block in enumerate(block_ids):
            for layer, kv in enumerate(self._layers):
                np.copyto(out[j, layer], kv[block])

    def scatter(self, block_ids: Iterable[int], pages: np.ndarray[Any, Any]) -> None:
        for j, block in enumerate(block_ids):
            for layer, kv in enumerate(self._layers):
                np.copyto(kv[block], pages[j, layer])


def _bytes_view(page: np.ndarray[Any, Any]) -> memoryview:
    """A writable byte view of one contiguous page (what the pool client reads/writes)."""
    buffer: Any = page  # NumPy arrays export the buffer protocol; its stubs do not say so
    return memoryview(buffer).cast("B")


def _get_into(pool: PoolClient, key: str, view: memoryview) -> int:
    return pool.get_into(key, view)


def _remove(pool: PoolClient, key: str) -> bool:
    return pool.remove(key)


def _put_from(pool: PoolClient, key: str, view: memoryview, parent: str | None) -> None:
    pool.put_from(key, view, parent=parent)


@dataclass(frozen=True, slots=True)
class LoadResult:
    req_id: str
    loaded: int
    failed_block_ids: frozenset[int]
    dropped: int = 0  # unreadable objects removed from the pool


class StoreWorker:
    """Worker-side logic of :class:`~kvpool.connectors.store.KVPoolStoreConnector`."""

    def __init__(
        self,
        *,
        tp_rank: int,
        pool: PoolHandle,
        loader_pool: PoolHandle,
        logger: logging.Logger,
    ) -> None:
        self._rank = tp_rank
        self._pool = pool
        self._loader_pool = loader_pool  # async loads run on their own connection
        self._log = logger
        self.paged: PagedKV | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[str, tuple[Future[LoadResult], threading.Event]] = {}
        self._invalid: set[int] = set()
        self._lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self._last_save_warning = -_WARN_EVERY_S

    def register(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.paged = PagedKV(kv_caches)

    # ------------------------------------------------------------------ loads

    def start_loads(self, plan: StorePlan) -> None:
        for spec in plan.loads:
            if not spec.is_async:
                result = self._load(spec, self._pool, None)
                self._record(result)
                continue
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvpool-store-load")
            cancel = threading.Event()
            future = self._executor.submit(self._load, spec, self._loader_pool, cancel)
            self._inflight[spec.req_id] = (future, cancel)

    def _load(
        self, spec: LoadSpec, handle: PoolHandle, cancel: threading.Event | None
    ) -> LoadResult:
        paged = self.paged
        keys = spec.keys[self._rank]
        if paged is None:
            return LoadResult(spec.req_id, 0, frozenset(spec.block_ids))
        loaded = 0
        dropped = 0
        for start in range(0, len(keys), _BATCH):
            block_ids = spec.block_ids[start : start + _BATCH]
            pages = paged.new_pages(len(block_ids))
            good = 0
            for j, key in enumerate(keys[start : start + _BATCH]):
                if cancel is not None and cancel.is_set():
                    # Aborted: vLLM frees the blocks once we report; nobody reads them.
                    return LoadResult(spec.req_id, loaded, frozenset())
                try:
                    n = handle.call(partial(_get_into, key=key, view=_bytes_view(pages[j])))
                    if n != paged.page_bytes:
                        raise ChecksumMismatch(
                            f"object {key} has {n} bytes, a page has {paged.page_bytes}"
                        )
                except Exception as exc:
                    self._log.warning(
                        "[KVPoolStoreConnector] load of %s for request %s failed: %s: %s",
                        key,
                        spec.req_id,
                        type(exc).__name__,
                        exc,
                    )
                    dropped = int(self._drop_unreadable(handle, key, exc))
                    break
                good += 1
            paged.scatter(block_ids[:good], pages)
            loaded += good
            if good < len(block_ids):
                failed = frozenset(spec.block_ids[start + good :])
                return LoadResult(spec.req_id, loaded, failed, dropped)
        return LoadResult(spec.req_id, loaded, frozenset())

    def _drop_unreadable(self, handle: PoolHandle, key: str, exc: Exception) -> bool:
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
            self._invalid |= result.failed_block_ids
            self.counters["loaded_blocks"] += result.loaded
            self.counters["failed_blocks"] += len(result.failed_block_ids)
            self.counters["dropped_blocks"] += result.dropped
            if self.paged is not None:
                self.counters["loaded_bytes"] += result.loaded * self.paged.page_bytes

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

    # ------------------------------------------------------------------ saves

    def save(self, plan: StorePlan) -> None:
        paged = self.paged
        if paged is None:
            return
        for spec in plan.saves:
            self._save_one(spec, paged)

    def _save_one(self, spec: SaveSpec, paged: PagedKV) -> None:
        keys = spec.keys[self._rank]
        parent = spec.parents[self._rank]
        for start in range(0, len(keys), _BATCH):
            block_ids = spec.block_ids[start : start + _BATCH]
            pages = paged.new_pages(len(block_ids))
            paged.gather(block_ids, pages)
            for j, key in enumerate(keys[start : start + _BATCH]):
                try:
                    self._pool.call(
                        partial(_put_from, key=key, view=_bytes_view(pages[j]), parent=parent)
                    )
                except WriteConflict:
                    pass  # another instance is writing the same chunk right now
                except Exception as exc:
                    # The rest of the chain hangs off this chunk: stop here.
                    self.counters["save_errors"] += 1
                    now = time.monotonic()
                    if now - self._last_save_warning >= _WARN_EVERY_S:  # one line per outage
                        self._last_save_warning = now
                        self._log.warning(
                            "[KVPoolStoreConnector] save of %s for request %s failed: %s: %s"
                            " (further save failures within %.0fs are only counted)",
                            key,
                            spec.req_id,
                            type(exc).__name__,
                            exc,
                            _WARN_EVERY_S,
                        )
                    return
                else:
                    self.counters["saved_blocks"] += 1
                    self.counters["saved_bytes"] += paged.page_bytes
                parent = key

    def shutdown(self) -> None:
        for _, cancel in self._inflight.values():
            cancel.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=False)
        self._pool.close()
        self._loader_pool.close()
