"""vLLM's KV cache tensors as byte pages the transfer worker can send and receive in place.

Only torch here (no vLLM), so it is tested without starting an engine.
"""

from __future__ import annotations

import torch

from kvpool.connectors.transfer_config import CONNECTOR_NAME
from kvpool.connectors.transfer_worker import PagedCaches
from kvpool.errors import ConfigError

__all__ = ["byte_pages"]


def byte_pages(kv_caches: dict[str, torch.Tensor], block_size: int) -> PagedCaches:
    """vLLM's per-layer KV tensors as byte arrays ``[num_blocks, heads, block_size, row]``.

    The CPU layout is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``; MLA's
    ``[num_blocks, block_size, latent]`` is one replicated head.  The arrays share memory
    with vLLM's tensors: pulls write straight into the KV cache.
    """
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
