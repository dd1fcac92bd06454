"""KV caches in device memory (CUDA, NPU, XPU) as byte pages, copied through host staging.

A socket cannot ``recv_into`` device memory and NumPy cannot view it, hence the torch
copies between the device caches and host buffers.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.connectors.pages import PagedCaches, page_view
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["StagedCaches"]


class StagedCaches(PagedCaches):
    """Byte pages of ``uint8`` tensors ``[num_blocks, heads, block_size, row]`` on one
    device, moved through host staging.

    - a batch's pages are gathered on the device into one contiguous tensor (one indexing
      kernel per layer), cross the bus in *one* ``copy_(non_blocking=True)``, and the
      caller waits once per batch (:func:`_wait`): per-page waits would leave the bus
      idle between pages.  Scatter is the same backwards;
    - host buffers are pinned (page-locked) where the device supports it, so that the
      copy is an asynchronous DMA; torch's caching host allocator keeps pinned blocks for
      reuse, so a buffer per batch costs no ``cudaHostAlloc`` after the first.  Elsewhere
      (a CPU tensor forced through this path, a device without pinning) they are plain
      host memory;
    - what a pool or a socket reads or writes is always that host memory: no engine is
      handed device memory (the Mooncake engine refuses device tensors, and registers in
      place only CPU storage).

    Costs per batch: one device temporary of the batch's bytes (gathers also keep the
    layers' pieces until they are stacked: twice that), one host buffer, one bus
    crossing, one wait.  The copy into the engine's or socket's memory is the one a CPU
    cache also pays.

    Ordering: copies run on the calling thread's current stream.  A save (after the
    forward pass, on vLLM's stream) is ordered after the kernels that wrote the blocks; a
    load writes blocks nothing computes on until vLLM hears the load finished, which is
    after the wait.

    ``host_bytes`` counts the bytes copied each way (``to_host``, ``to_device``): the
    tests' and the bench's evidence that this path ran.
    """

    staged = True

    def __init__(self, layers: Mapping[str, torch.Tensor], *, connector: str = "kvpool") -> None:
        import torch

        for name, t in layers.items():
            if t.dim() != 4 or t.dtype != torch.uint8 or not t.is_contiguous():
                raise ConfigError(
                    f"{connector}: layer {name} is not a contiguous "
                    "[num_blocks, heads, block_size, row] byte tensor"
                )
        self._geometry({name: tuple(t.shape) for name, t in layers.items()}, connector)
        self._torch = torch
        self._tensors = dict(layers)
        first = next(iter(self._tensors.values()))
        self.device = first.device
        self._blocks_t = [t.view(self.num_blocks, -1) for t in self._tensors.values()]
        # CPU tensors forced here have nothing to pin for; a device that cannot pin falls
        # back to plain host memory on the first refusal
        self._pin = self.device.type != "cpu"
        self._lock = threading.Lock()
        self.host_bytes: Counter[str] = Counter()

    @property
    def pinned(self) -> bool:
        """Whether host buffers are pinned (False for CPU tensors, and once refused)."""
        return self._pin

    # ------------------------------------------------------------ host memory

    def _host(self, shape: tuple[int, ...]) -> torch.Tensor:
        uint8 = self._torch.uint8
        host: torch.Tensor
        if self._pin:
            try:
                host = self._torch.empty(shape, dtype=uint8, pin_memory=True)
                return host
            except RuntimeError:  # no pinning on this device or build: pageable memory
                self._pin = False
        host = self._torch.empty(shape, dtype=uint8)
        return host

    def _index(self, blocks: Sequence[int]) -> torch.Tensor:
        index: torch.Tensor = self._torch.tensor(
            list(blocks), dtype=self._torch.long, device=self.device
        )
        return index

    def _count(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self.host_bytes[direction] += nbytes

    # ------------------------------------------------------------ page slices (transfer)

    def page(self, layer: str, block: int, head_start: int, head_count: int) -> memoryview:
        """A read-only host copy of one page slice: writing into it could not reach the
        cache, so receivers use :meth:`receiving`."""
        return self.sending(layer, [block], head_start, head_count)[0]

    def sending(
        self, layer: str, blocks: Sequence[int], head_start: int, head_count: int
    ) -> list[memoryview]:
        if not blocks:
            return []
        kv = self._tensors[layer]
        picked = kv[self._index(blocks), head_start : head_start + head_count]
        host = self._host(tuple(picked.shape))
        host.copy_(picked, non_blocking=True)
        _wait(self.device)
        self._count("to_host", host.numel())
        pages = host.numpy().reshape(len(blocks), -1)
        return [page_view(p).toreadonly() for p in _rows(pages)]

    @contextmanager
    def receiving(
        self, layer: str, blocks: Sequence[int], head_start: int, head_count: int
    ) -> Iterator[list[memoryview]]:
        kv = self._tensors[layer]
        shape = (len(blocks), head_count, self.block_size, kv.shape[3])
        host = self._host(shape)
        yield [page_view(p) for p in _rows(host.numpy().reshape(len(blocks), -1))]
        if not blocks:
            return
        staged = host.to(self.device, non_blocking=True)
        kv[self._index(blocks), head_start : head_start + head_count] = staged
        _wait(self.device)
        self._count("to_device", host.numel())

    # ------------------------------------------------------------ whole blocks (store)

    def new_pages(self, n: int) -> np.ndarray[Any, Any]:
        """Host staging for ``n`` pages (pinned where the device allows), as NumPy."""
        pages: np.ndarray[Any, Any] = self._host(
            (n, len(self._blocks_t), self.layer_page_bytes)
        ).numpy()
        return pages

    def gather(self, block_ids: Iterable[int], out: np.ndarray[Any, Any]) -> None:
        ids = list(block_ids)
        if not ids:
            return
        index = self._index(ids)
        stacked = self._torch.stack([kv.index_select(0, index) for kv in self._blocks_t], dim=1)
        host = self._torch.from_numpy(out[: len(ids)])  # shares the staging's memory
        host.copy_(stacked, non_blocking=True)
        _wait(self.device)
        self._count("to_host", stacked.numel())

    def scatter(
        self, block_ids: Iterable[int], pages: np.ndarray[Any, Any], layer: int | None = None
    ) -> None:
        ids = list(block_ids)
        if not ids:
            return
        index = self._index(ids)
        host = pages[: len(ids)] if layer is None else pages[: len(ids), layer : layer + 1]
        staged = self._torch.from_numpy(host).to(self.device, non_blocking=True)
        layers = range(len(self._blocks_t)) if layer is None else [layer]
        for i, at in enumerate(layers):
            self._blocks_t[at].index_copy_(0, index, staged[:, i])
        # the host pages may be reused as soon as this returns
        _wait(self.device)
        self._count("to_device", staged.numel())


def _rows(pages: np.ndarray[Any, Any]) -> list[np.ndarray[Any, Any]]:
    return [pages[j] for j in range(pages.shape[0])]


def _wait(device: torch.device) -> None:
    """Wait for this thread's copies on ``device``: its current stream, not the whole
    device (a loader thread must not wait for the forward pass running beside it)."""
    if device.type == "cpu":
        return  # CPU copies are done when copy_ returns
    import torch

    module: Any = torch.get_device_module(device)
    stream = getattr(module, "current_stream", None)
    if stream is not None:
        stream(device).synchronize()
    else:  # a backend without streams (MPS): its synchronize takes no device
        module.synchronize()
