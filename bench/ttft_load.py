"""How ``bench/ttft.py`` measures a request's load: seconds in the connector's load of the
request, bytes of the blocks that came from the pool, and memcpy of as many bytes.

- **Seconds**: the wall time of the one call in which a connector's worker loads one
  request's blocks into vLLM's KV cache, from its first pool read to the last page in
  place.  kvpool's store connector: ``StoreWorker._load`` (lookup pins released at its
  end included; synchronous by default, so inside ``start_load_kv``).  vLLM's
  ``MooncakeStoreConnector``: ``KVCacheStoreRecvingThread._handle_request`` (its key
  list, then ``batch_get_into_multi_buffers`` into the KV cache; on its receive thread).
  The call is wrapped once, before the engine starts; nothing else changes.  What is
  left out: the scheduler's lookup, and the step in which vLLM learns that an async load
  ended — both are in the TTFT.
- **Bytes**: ``num_cached_tokens / block_size`` pages of ``layers × kv_heads × block_size
  × 2 × head_size × 4`` bytes (float32), the same for both connectors: only blocks vLLM
  counts as loaded (a failed block is recomputed and not counted).
- **memcpy**: ``bench.baselines.memcpy`` of one request's bytes between two page-aligned
  buffers, in the same process right after the prompts, median of :data:`MEMCPY_ROUNDS`;
  **xxh3** the checksum kvpool computes over those bytes, timed the same way.
- **Phases** (kvpool's store connector): :class:`Phases` sums, per request, the seconds
  in the scheduler's lookup, the worker's load, the master round trips and the data
  path's reads (copy and checksum together) within it, and counts the engine's steps.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LoadTimer", "Phases", "memcpy_gib_s", "page_bytes", "xxh3_gib_s"]

MEMCPY_ROUNDS = 20
GIB = float(1 << 30)

# The call that loads one request, per connector (see the module docstring).
_LOAD_CALLS: dict[str, tuple[str, str, str]] = {
    "KVPoolStoreConnector": ("kvpool.connectors.store.worker", "StoreWorker", "_load"),
    "MooncakeStoreConnector": (
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker",
        "KVCacheStoreRecvingThread",
        "_handle_request",
    ),
}


def timed(call: Callable[..., Any], record: Callable[[float], object]) -> Callable[..., Any]:
    """``call``, wrapped to hand the seconds each call took to ``record``."""

    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            record(time.perf_counter() - t0)

    return wrapper


class LoadTimer:
    """Seconds spent in a connector's per-request load call since the last :meth:`take`."""

    def __init__(self, connector: str) -> None:
        import importlib

        if connector not in _LOAD_CALLS:
            raise ValueError(f"no load call known for connector {connector!r}")
        module, cls_name, method = _LOAD_CALLS[connector]
        cls = getattr(importlib.import_module(module), cls_name)
        self._seconds: list[float] = []
        # the list is looked up at each call: take() swaps it; list.append is atomic
        setattr(cls, method, timed(getattr(cls, method), lambda s: self._seconds.append(s)))

    def take(self) -> tuple[int, float]:
        """(loads, their seconds) since the last call."""
        taken, self._seconds = self._seconds, []
        return len(taken), sum(taken)


# What a kvpool hit spends its time in (see the module docstring): name -> the call.
_PHASES: dict[str, tuple[str, str, str]] = {
    "lookup": ("kvpool.connectors.store.scheduler", "StoreScheduler", "get_num_new_matched_tokens"),
    "load": ("kvpool.connectors.store.worker", "StoreWorker", "_load"),
    "master": ("kvpool.client.client", "Client", "call"),
    "data": ("kvpool.datapath.path", "NodeDataPath", "run"),
    "data (in-process)": ("kvpool.datapath.in_process", "InProcessPath", "run"),
    "steps": ("vllm.v1.engine.core", "EngineCore", "step"),
}


class Phases:
    """Calls and seconds in each of :data:`_PHASES` since the last :meth:`take`."""

    def __init__(self) -> None:
        import importlib

        self._calls: dict[str, list[float]] = {name: [] for name in _PHASES}
        for name, (module, cls_name, method) in _PHASES.items():
            cls = getattr(importlib.import_module(module), cls_name)
            setattr(cls, method, timed(getattr(cls, method), self._calls[name].append))

    def take(self) -> dict[str, tuple[int, float]]:
        """name -> (calls, seconds) since the last call."""
        out = {}
        for name, calls in self._calls.items():
            out[name] = (len(calls), sum(calls))
            calls.clear()
        return out


def page_bytes(llm: Any) -> int:
    """Bytes of one block of every layer in this engine's (float32, CPU) KV cache."""
    config = llm.llm_engine.vllm_config
    model, parallel = config.model_config, config.parallel_config
    per_token = model.get_num_kv_heads(parallel) * 2 * model.get_head_size() * 4
    return int(model.get_num_layers(parallel) * config.cache_config.block_size * per_token)


def xxh3_gib_s(nbytes: int) -> float:
    from kvpool.storage.checksum import checksum

    data = bytearray(nbytes)
    checksum(data)
    seconds = []
    for _ in range(MEMCPY_ROUNDS):
        t0 = time.perf_counter()
        checksum(data)
        seconds.append(time.perf_counter() - t0)
    return nbytes / statistics.median(seconds) / GIB


def memcpy_gib_s(nbytes: int) -> float:
    from bench.baselines import memcpy

    copy = memcpy(nbytes)
    copy()  # first touch of the destination's pages
    seconds = []
    for _ in range(MEMCPY_ROUNDS):
        t0 = time.perf_counter()
        copy()
        seconds.append(time.perf_counter() - t0)
    return nbytes / statistics.median(seconds) / GIB
