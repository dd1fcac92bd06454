"""Pool engines behind one interface (:class:`~kvpool.engines.base.PoolEngine`): kvpool's
own master, the in-process embedded pool, and real Mooncake Store.  No vLLM here."""

from __future__ import annotations

from kvpool.engines.base import MISS, PoolEngine

__all__ = ["MISS", "PoolEngine"]
