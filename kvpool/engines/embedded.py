"""The ``embedded`` engine: a whole pool inside this process (:class:`kvpool.EmbeddedPool`),
for one node without a master (``backend: embedded``, tensor parallel size 1) and tests.
"""

from __future__ import annotations

from kvpool.engines.kvpool_client import ClientEngine

__all__ = ["EmbeddedEngine", "open_embedded_engine"]


class EmbeddedEngine(ClientEngine):
    """An in-process pool as a :class:`~kvpool.engines.base.PoolEngine`."""

    engine = "embedded"

    @classmethod
    def create(cls, capacity: int) -> EmbeddedEngine:
        """A new, empty pool of ``capacity`` bytes of memory."""
        from kvpool.embedded import EmbeddedPool

        return cls(EmbeddedPool(segment_size=capacity))


def open_embedded_engine(*, capacity: int, **_: object) -> EmbeddedEngine:
    """:func:`kvpool.engines.open_engine`'s ``"embedded"``: a pool of ``capacity`` bytes
    in this process."""
    return EmbeddedEngine.create(capacity)
