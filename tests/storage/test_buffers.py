from __future__ import annotations

import numpy as np
import pytest

from kvpool.storage.buffers import byte_view, copy_bytes, writable_byte_view


def test_numpy_arrays_are_viewed_as_their_bytes_without_copy() -> None:
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = writable_byte_view(arr)
    assert view.nbytes == 48 and view.format == "B" and view.ndim == 1
    view[0:4] = np.float32(9.5).tobytes()
    assert arr[0, 0] == 9.5


def test_torch_cpu_tensors_alias_their_storage() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, dtype=torch.bfloat16)
    view = writable_byte_view(t)
    assert view.nbytes == 8
    view[:2] = torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    assert t[0].item() == 1.5
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(torch.zeros(4, 4).t())


def test_non_contiguous_read_only_and_non_buffers_are_refused() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(np.zeros((4, 4))[:, ::2])
    with pytest.raises(TypeError, match="read-only"):
        writable_byte_view(b"abc")
    with pytest.raises(TypeError, match="bytes-like"):
        byte_view("text")


@pytest.mark.parametrize("size", [0, 1, 1000, 1 << 20])
def test_copy_bytes_copies_small_and_large(size: int) -> None:
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = bytearray(size)
    copy_bytes(memoryview(dst), byte_view(src))
    assert dst == src.tobytes()
    with pytest.raises(ValueError):
        copy_bytes(memoryview(dst), memoryview(b"x" * (size + 1)))
