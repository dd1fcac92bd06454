"""Memory Mooncake can move: the Mooncake engine's staging area and the caller's own
registered memory (Mooncake Store reads and writes only memory registered with
``register_buffer``): :class:`Staging` is copied through, :class:`Registered` zero-copy.
"""

from __future__ import annotations

from typing import Any

from kvpool.errors import TransferError

__all__ = ["MAX_REGIONS", "MIN_REGISTERED", "Registered", "Staging"]

#: the smallest tensor storage registered in place
MIN_REGISTERED = 16 << 20
#: at most so many caller regions (a KV cache is one tensor per layer, or one in all)
MAX_REGIONS = 512


# - :class:`Staging` — one area of the engine's own, grown on demand: bytes, NumPy arrays
#   and small tensors are copied through it, and every object's 16-byte header lives here;
class Staging:
    """One registered, growable staging area."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._array: Any = None

    def region(self, nbytes: int) -> tuple[memoryview, int]:
        """A view of at least ``nbytes`` registered bytes, and its address."""
        import numpy as np

        if self._array is None or self._array.nbytes < nbytes:
            self.free()
            size = max(1 << 20, 1 << (max(nbytes, 1) - 1).bit_length())
            array = np.empty(size, dtype=np.uint8)
            rc = self._store.register_buffer(array.ctypes.data, size)
            if rc != 0:
                raise TransferError(f"Mooncake register_buffer of {size} bytes failed ({rc})")
            self._array = array
        return memoryview(self._array), int(self._array.ctypes.data)

    def free(self) -> None:
        if self._array is not None:
            self._store.unregister_buffer(self._array.ctypes.data)
            self._array = None


def _cpu_storage(buffer: Any) -> tuple[int, int, Any] | None:
    """(address, bytes, owner) of a CPU tensor's whole storage; None for anything else."""
    storage_of = getattr(buffer, "untyped_storage", None)
    if storage_of is None or getattr(getattr(buffer, "device", None), "type", "") != "cpu":
        return None
    storage = storage_of()
    return int(storage.data_ptr()), int(storage.nbytes()), storage


# - :class:`Registered` — the caller's memory itself (zero-copy): a CPU tensor whose storage
#   is at least :data:`MIN_REGISTERED` bytes (a vLLM KV cache; its pages are views into it)
#   is registered once, kept alive while the engine lives, and read and written in place.
#   Small or short-lived tensors are not registered: each would stay registered (and, on
#   RDMA, pinned) until the engine closes.
class Registered:
    """The caller's big CPU tensors, registered in place once each."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self._regions: dict[int, tuple[int, Any]] = {}  # start -> (end, the storage)

    def __len__(self) -> int:
        return len(self._regions)

    def address(self, buffer: Any, nbytes: int) -> int | None:
        """Where ``buffer``'s ``nbytes`` are, when Mooncake may move them in place."""
        found = _cpu_storage(buffer)
        if found is None:
            return None
        start, size, storage = found
        if start not in self._regions:
            if size < MIN_REGISTERED or len(self._regions) >= MAX_REGIONS:
                return None
            if self._store.register_buffer(start, size) != 0:
                return None
            self._regions[start] = (start + size, storage)
        end = self._regions[start][0]
        address = int(buffer.data_ptr())
        return address if start <= address and address + nbytes <= end else None

    def row_address(self, tensor: Any, nbytes: int) -> int | None:
        """:meth:`address` for a CPU tensor, with one dictionary look-up once its storage
        is registered (the common case: every row of a KV cache)."""
        start = int(tensor.untyped_storage().data_ptr())
        region = self._regions.get(start)
        if region is None:
            return self.address(tensor, nbytes)
        address = int(tensor.data_ptr())
        return address if address + nbytes <= region[0] else None

    def free(self) -> None:
        for start in self._regions:
            self._store.unregister_buffer(start)
        self._regions.clear()
