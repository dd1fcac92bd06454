"""An object's parts as bytes: the views the adapters move, and a reused staging area.

The store connector hands over one 1-D row of bytes per layer, hundreds per call, so those
take a fast path; :class:`StagingPages` joins an object's parts for engines that move one
buffer per object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.storage.buffers import byte_view, writable_byte_view

__all__ = ["StagingPages", "part_views", "row_view"]


def row_view(part: Any) -> memoryview | None:
    """A writable byte view of a 1-D contiguous CPU tensor of bytes, made in a fraction of
    :func:`~kvpool.storage.buffers.byte_view`'s general checks.  None for anything else."""
    try:
        one_d = part.dim() == 1 and part.element_size() == 1 and part.is_contiguous()
        if part.is_cpu and one_d:
            return memoryview(part.numpy()).cast("B")
    except (AttributeError, RuntimeError, TypeError):  # not a tensor, or needs grad
        pass
    return None


def part_views(parts: Sequence[Any], *, writable: bool) -> list[memoryview]:
    """One byte view per part (``writable``: for a read into them)."""
    view = writable_byte_view if writable else byte_view
    out = []
    for part in parts:
        fast = row_view(part)
        out.append(view(part) if fast is None else fast)
    return out


class StagingPages:
    """One staging area, grown on demand and reused by every call, instead of a page per
    key per call.  One user at a time (an engine is called by one thread at a time)."""

    def __init__(self) -> None:
        self._area: Any = None

    def slots(self, sizes: Sequence[int]) -> list[memoryview]:
        """One writable slot per size, back to back in the area."""
        import numpy as np

        starts = [0]
        for n in sizes:  # each slot starts on a page, as the KV rows copied to or from it
            starts.append(starts[-1] + -(-n // 4096) * 4096)
        if self._area is None or len(self._area) < starts[-1]:
            self._area = np.empty(max(starts[-1], 1), dtype=np.uint8).data.cast("B")
        return [self._area[at : at + n] for at, n in zip(starts, sizes, strict=False)]
