"""The one byte-page view of vLLM's KV caches, in both of its uses."""

from __future__ import annotations

import pytest
import torch

from kvpool.connectors.pages import block_pages, byte_pages
from kvpool.errors import ConfigError

# ------------------------------------------------------------------ page slices (transfer)


def test_byte_pages_share_memory_with_the_kv_cache() -> None:
    kv = torch.zeros(4, 2, 16, 8, dtype=torch.float32)  # [blocks, heads, block_size, 2*head]
    paged = byte_pages({"layer.0": kv}, block_size=16)
    assert (paged.num_blocks, paged.num_heads, paged.block_size) == (4, 2, 16)
    assert paged.head_bytes == 16 * 8 * 4
    src = torch.arange(16 * 8, dtype=torch.float32).reshape(1, 16, 8)
    paged.page("layer.0", 3, 1, 1)[:] = src.numpy().tobytes()
    assert torch.equal(kv[3, 1], src[0])  # written in place: no staging copy
    assert not kv[:3].any() and not kv[3, 0].any()


def test_bf16_and_mla_layouts_are_bytes_too() -> None:
    paged = byte_pages({"mla": torch.zeros(4, 16, 576, dtype=torch.bfloat16)}, block_size=16)
    assert (paged.num_heads, paged.head_bytes) == (1, 16 * 576 * 2)


def test_unsupported_layouts_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="block size"):
        byte_pages({"l": torch.zeros(4, 2, 32, 8)}, block_size=128)
    with pytest.raises(ConfigError, match="layout"):
        byte_pages({"l": torch.zeros(8, 2, 16, 4).transpose(0, 1)}, block_size=16)


# ------------------------------------------------------------------ whole blocks (store)


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(12, 2, 4, 6, generator=g) for i in range(3)}


def test_whole_blocks_round_trip_through_staging() -> None:
    src, dst = kv_caches(1), kv_caches(2)
    a, b = block_pages(src), block_pages(dst)
    assert a.page_bytes == 3 * 2 * 4 * 6 * 4
    staged = a.new_pages(2)
    a.gather([3, 7], staged)
    b.scatter([0, 5], staged)
    for name in src:
        assert torch.equal(dst[name][0], src[name][3]) and torch.equal(dst[name][5], src[name][7])


def test_the_store_view_rejects_mixed_layers_and_names_its_connector() -> None:
    with pytest.raises(ConfigError, match=r"KVPoolStoreConnector.*mixed layouts"):
        block_pages({"a": torch.zeros(2, 1, 4, 4), "b": torch.zeros(2, 2, 4, 4)})
    with pytest.raises(ConfigError, match=r"KVPoolStoreConnector.*not contiguous"):
        block_pages({"a": torch.zeros(4, 2, 4, 4).transpose(0, 1)})
    with pytest.raises(ConfigError, match=r"KVPoolTransferConnector.*layout"):
        byte_pages({"l": torch.zeros(8, 2, 16, 4).transpose(0, 1)}, block_size=16)


def test_the_store_view_takes_any_blocks_first_layout() -> None:
    kv = {"mla": torch.randn(5, 16, 8), "odd": torch.randn(5, 3, 2, 2, 2)}
    with pytest.raises(ConfigError, match="mixed layouts"):
        block_pages(kv)
    paged = block_pages({"odd": kv["odd"]})
    assert paged.page_bytes == 3 * 2 * 2 * 2 * 4
    staged = paged.new_pages(1)
    paged.gather([4], staged)
    assert staged.tobytes() == kv["odd"][4].numpy().tobytes()
