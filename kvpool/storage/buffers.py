"""Turn caller buffers (bytes-like, NumPy, CPU torch) into flat byte views, without copying:
the one place that makes a 1-D, C-contiguous ``memoryview`` of format ``"B"`` aliasing the
caller's memory.
"""

from __future__ import annotations

from typing import Any

try:  # optional: NumPy copies without holding the GIL
    import numpy as _np
except ImportError:  # pragma: no cover - numpy ships with every vLLM install
    _np = None  # type: ignore[assignment]

__all__ = ["byte_view", "copy_bytes", "writable_byte_view"]


# Rules:
#
# - Never copy: a non-contiguous array or a tensor on another device is rejected with
#   ``ValueError`` rather than silently staged through a temporary.
# - A destination must be writable (``bytes`` is not); ``TypeError`` says so.
# - torch is duck-typed (no import): torch tensors do not export the buffer protocol,
#   so a tensor is viewed as ``uint8`` and exposed through ``Tensor.numpy()``, which
#   shares its storage.
def _from_tensor(obj: Any) -> memoryview:
    device = getattr(obj, "device", None)
    if getattr(device, "type", "cpu") != "cpu":
        raise ValueError(f"tensor is on {device}; only CPU tensors can be used as buffers")
    if not obj.is_contiguous():
        raise ValueError("tensor is not contiguous; call .contiguous() first")
    import torch  # only reached when the caller already has torch loaded

    flat = obj.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy())


def byte_view(obj: Any) -> memoryview:
    """A flat ``"B"`` memoryview aliasing ``obj``'s memory (read access)."""
    # Buffer-protocol objects first: this runs on every transfer, and the common
    # case (bytes, bytearray, NumPy, memoryview) needs no attribute probing.
    try:
        view = obj if type(obj) is memoryview else memoryview(obj)
    except TypeError as exc:
        if not (hasattr(obj, "is_contiguous") and hasattr(obj, "numpy")):
            raise TypeError(
                f"expected a bytes-like object, NumPy array or CPU tensor, not {type(obj).__name__}"
            ) from exc
        view = _from_tensor(obj)
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous; make a contiguous copy first")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def writable_byte_view(obj: Any) -> memoryview:
    """Like :func:`byte_view`, and the result must be writable (a destination)."""
    view = byte_view(obj)
    if view.readonly:
        raise TypeError(f"destination buffer ({type(obj).__name__}) is read-only")
    return view


# Copies at least this large go through NumPy, which releases the GIL while it copies;
# below it, memoryview slice assignment is cheaper than building two arrays.
_NUMPY_COPY_MIN = 256 * 1024


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (flat byte views of equal length)."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into a {len(dst)}-byte buffer")
    if len(src) >= _NUMPY_COPY_MIN and _np is not None:
        _np.copyto(_np.frombuffer(dst, dtype=_np.uint8), _np.frombuffer(src, dtype=_np.uint8))
    else:
        dst[:] = src
