"""vLLM's KV cache tensors as byte pages: the one byte view both connectors use.

vLLM hands a connector one tensor per layer, blocks first.  On CPU the layout is
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (MLA's
``[num_blocks, block_size, latent]`` is one replicated head).  :class:`PagedCaches` views
them as ``uint8`` arrays ``[num_blocks, heads, block_size, row]`` that share memory with
vLLM's tensors, and serves two uses:

- the store connector moves *whole blocks*: :meth:`PagedCaches.gather` and
  :meth:`PagedCaches.scatter` copy one block of every layer (a *page*: one pool object) to
  and from a staging array made by :meth:`PagedCaches.new_pages`.  Pages move opaque: the
  CPU kernel does not keep a block's tokens in position order, so nothing looks inside;
- the transfer connector sends and receives *page slices* in place:
  :meth:`PagedCaches.page` is the contiguous bytes of heads ``h0:h0+n`` of one block of
  one layer, which a socket reads into or writes from directly.

Build one with :func:`block_pages` (store connector: any layout with blocks first) or
:func:`byte_pages` (transfer connector: the layouts above, with the scheduler's block size);
their errors name the connector that registered the caches.  torch is imported only when
they are called, so code and tests that use NumPy arrays stay torch-free.

Copies go through NumPy byte views: a plain single-threaded memcpy per layer page.
Torch's ``copy_`` would open an OpenMP parallel region per 256 KiB page, and on a loaded
host (vLLM pins its OpenMP threads to cores) each region can wait a scheduler tick:
measured 0.5 s instead of 5 ms for a 24 MiB load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool.config.kv_transfer import STORE_CONNECTOR as STORE
from kvpool.config.kv_transfer import TRANSFER_CONNECTOR as TRANSFER
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["PagedCaches", "block_pages", "byte_pages", "page_view"]


class PagedCaches:
    """vLLM's per-layer KV caches as ``uint8`` arrays ``[num_blocks, heads, block_size, row]``.

    A page slice (``[block, h0:h1]``) and a whole block (``[block]``) are contiguous in this
    layout, which is what lets both connectors copy without reshaping anything.
    """

    def __init__(self, layers: Mapping[str, np.ndarray], *, connector: str = "kvpool") -> None:
        if not layers:
            raise ConfigError(f"{connector}: vLLM registered no KV cache layers")
        shapes = {arr.shape for arr in layers.values()}
        if len(shapes) != 1:
            raise ConfigError(f"{connector}: KV cache layers differ in shape: {sorted(shapes)}")
        for name, arr in layers.items():
            if arr.ndim != 4 or arr.dtype != np.uint8 or not arr.flags.c_contiguous:
                raise ConfigError(
                    f"{connector}: layer {name} is not a contiguous "
                    "[num_blocks, heads, block_size, row] byte view"
                )
        self._layers = dict(layers)
        self.names: list[str] = list(layers)
        self.num_blocks, self.num_heads, self.block_size, row = next(iter(shapes))
        self.head_bytes = self.block_size * row
        #: bytes of one block of one layer, and of one page (one block of every layer)
        self.layer_page_bytes = self.num_heads * self.head_bytes
        self.page_bytes = self.layer_page_bytes * len(self.names)
        # [num_blocks, layer_page_bytes] views of the same memory, for whole-block copies
        self._blocks = [arr.reshape(self.num_blocks, -1) for arr in self._layers.values()]

    # ------------------------------------------------------------ page slices (transfer)

    def page(self, layer: str, block: int, head_start: int, head_count: int) -> memoryview:
        page = self._layers[layer][block, head_start : head_start + head_count]
        return page.data.cast("B")

    # ------------------------------------------------------------ whole blocks (store)

    def new_pages(self, n: int) -> np.ndarray[Any, Any]:
        """Staging for ``n`` pages: ``[n, layers, layer_page_bytes]`` bytes."""
        return np.empty((n, len(self._blocks), self.layer_page_bytes), dtype=np.uint8)

    def gather(self, block_ids: Iterable[int], out: np.ndarray[Any, Any]) -> None:
        for j, block in enumerate(block_ids):
            for layer, kv in enumerate(self._blocks):
                np.copyto(out[j, layer], kv[block])

    def scatter(self, block_ids: Iterable[int], pages: np.ndarray[Any, Any]) -> None:
        for j, block in enumerate(block_ids):
            for layer, kv in enumerate(self._blocks):
                np.copyto(kv[block], pages[j, layer])


def page_view(page: np.ndarray[Any, Any]) -> memoryview:
    """A writable byte view of one staged page (what a pool reads into or writes from)."""
    buffer: Any = page  # NumPy arrays export the buffer protocol; its stubs do not say so
    return memoryview(buffer).cast("B")


def block_pages(kv_caches: Mapping[str, torch.Tensor]) -> PagedCaches:
    """The store connector's view: whole blocks of any layout with blocks first.

    Layers must agree in shape and dtype (one page is one block of every layer) and be
    contiguous.  A layout other than the two above is viewed as one head of one row per
    block: whole-block copies need nothing more.
    """
    import torch

    if not kv_caches:
        raise ConfigError(f"{STORE}: vLLM registered no KV cache tensors")
    first = next(iter(kv_caches.values()))
    layers = {}
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype:
            raise ConfigError(
                f"{STORE}: layer {name} has KV shape {tuple(t.shape)} {t.dtype}, unlike"
                f" {tuple(first.shape)} {first.dtype}; mixed layouts are unsupported"
            )
        if not t.is_contiguous():
            raise ConfigError(f"{STORE}: layer {name}'s KV cache is not contiguous")
        if t.dim() == 3:
            t = t.unsqueeze(1)
        elif t.dim() != 4:
            t = t.reshape(t.shape[0], 1, 1, -1)
        layers[name] = t.detach().view(torch.uint8).numpy()
    return PagedCaches(layers, connector=STORE)


def byte_pages(kv_caches: Mapping[str, torch.Tensor], block_size: int) -> PagedCaches:
    """The transfer connector's view: page slices per head range, in place.

    The arrays share memory with vLLM's tensors: pulls write straight into the KV cache.
    """
    import torch

    layers = {}
    for name, tensor in kv_caches.items():
        if tensor.device.type != "cpu":
            raise ConfigError(
                f"{TRANSFER} moves KV through host memory; layer {name} is on "
                f"{tensor.device} (this build supports vLLM's CPU KV cache)"
            )
        if tensor.dim() == 3:
            tensor = tensor.unsqueeze(1)
        if tensor.dim() != 4 or not tensor.is_contiguous():
            raise ConfigError(
                f"{TRANSFER}: layer {name} has an unsupported KV cache layout "
                f"{tuple(tensor.shape)} (expected contiguous [blocks, heads, block_size, row])"
            )
        if tensor.shape[2] != block_size:
            raise ConfigError(
                f"{TRANSFER}: layer {name} stores {tensor.shape[2]} tokens per kernel "
                f"block but the scheduler's block size is {block_size}; use a --block-size "
                "the attention kernel supports natively"
            )
        layers[name] = tensor.view(torch.uint8).numpy()
    return PagedCaches(layers, connector=TRANSFER)
