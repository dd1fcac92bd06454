"""KV caches as byte pages that the transfer connector sends and receives in place.

:class:`PagedCaches` needs only numpy; :func:`byte_pages` turns vLLM's torch tensors into
one (torch is imported when it is called, so the worker and its tests stay torch-free).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from kvpool.config.kv_transfer import TRANSFER_CONNECTOR as CONNECTOR_NAME
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    import torch

__all__ = ["PagedCaches", "byte_pages"]


class PagedCaches:
    """vLLM's per-layer KV caches as ``uint8`` arrays ``[num_blocks, heads, block_size, row]``.

    A *page slice* (``[block, h0:h1]``) is contiguous in this layout, which is what lets
    both sides send and receive in place.
    """

    def __init__(self, layers: Mapping[str, np.ndarray]) -> None:
        if not layers:
            raise ConfigError(f"{CONNECTOR_NAME}: no KV cache layers were registered")
        shapes = {arr.shape for arr in layers.values()}
        if len(shapes) != 1:
            raise ConfigError(
                f"{CONNECTOR_NAME}: KV cache layers differ in shape: {sorted(shapes)}"
            )
        for name, arr in layers.items():
            if arr.ndim != 4 or arr.dtype != np.uint8 or not arr.flags.c_contiguous:
                raise ConfigError(
                    f"{CONNECTOR_NAME}: layer {name} is not a contiguous "
                    "[num_blocks, heads, block_size, row] byte view"
                )
        self._layers = dict(layers)
        self.names: list[str] = list(layers)
        self.num_blocks, self.num_heads, self.block_size, row = next(iter(shapes))
        self.head_bytes = self.block_size * row

    def page(self, layer: str, block: int, head_start: int, head_count: int) -> memoryview:
        page = self._layers[layer][block, head_start : head_start + head_count]
        return page.data.cast("B")


def byte_pages(kv_caches: dict[str, torch.Tensor], block_size: int) -> PagedCaches:
    """vLLM's per-layer KV tensors as byte arrays ``[num_blocks, heads, block_size, row]``.

    The CPU layout is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; MLA's
    ``[num_blocks, block_size, latent]`` is one replicated head.  The arrays share memory
    with vLLM's tensors: pulls write straight into the KV cache.
    """
    import torch

    layers = {}
    for name, tensor in kv_caches.items():
        if tensor.device.type != "cpu":
            raise ConfigError(
                f"{CONNECTOR_NAME} moves KV through host memory; layer {name} is on "
                f"{tensor.device} (this build supports vLLM's CPU KV cache)"
            )
        if tensor.dim() == 3:
            tensor = tensor.unsqueeze(1)
        if tensor.dim() != 4 or not tensor.is_contiguous():
            raise ConfigError(
                f"{CONNECTOR_NAME}: layer {name} has an unsupported KV cache layout "
                f"{tuple(tensor.shape)} (expected contiguous [blocks, heads, block_size, row])"
            )
        if tensor.shape[2] != block_size:
            raise ConfigError(
                f"{CONNECTOR_NAME}: layer {name} stores {tensor.shape[2]} tokens per kernel "
                f"block but the scheduler's block size is {block_size}; use a --block-size "
                "the attention kernel supports natively"
            )
        layers[name] = tensor.view(torch.uint8).numpy()
    return PagedCaches(layers)
