from __future__ import annotations

import pytest
import torch

from kvpool.connectors.transfer_pages import byte_pages
from kvpool.errors import ConfigError


def test_byte_pages_share_memory_with_the_kv_cache() -> None:
    kv = torch.zeros(4, 2, 16, 8, dtype=torch.float32)  # [blocks, heads, block_size, 2*head]
    pages = byte_pages({"layer.0": kv}, block_size=16)
    assert (pages.num_blocks, pages.num_heads, pages.block_size) == (4, 2, 16)
    assert pages.head_bytes == 16 * 8 * 4
    src = torch.arange(16 * 8, dtype=torch.float32).reshape(1, 16, 8)
    pages.page("layer.0", 3, 1, 1)[:] = src.numpy().tobytes()
    assert torch.equal(kv[3, 1], src[0])  # written in place: no staging copy
    assert not kv[:3].any() and not kv[3, 0].any()


def test_bf16_and_mla_layouts_are_bytes_too() -> None:
    pages = byte_pages({"mla": torch.zeros(4, 16, 576, dtype=torch.bfloat16)}, block_size=16)
    assert (pages.num_heads, pages.head_bytes) == (1, 16 * 576 * 2)


def test_unsupported_layouts_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="block size"):
        byte_pages({"l": torch.zeros(4, 2, 32, 8)}, block_size=128)
    with pytest.raises(ConfigError, match="layout"):
        byte_pages({"l": torch.zeros(8, 2, 16, 4).transpose(0, 1)}, block_size=16)
