"""Pool engines behind one interface (:class:`~kvpool.engines.base.PoolEngine`): kvpool's
own master, the in-process embedded pool, and real Mooncake Store.  No vLLM here.

- :mod:`.base` — the interface and the rules every adapter keeps;
- :mod:`.kvpool_master` — :class:`MasterEngine`, over :class:`kvpool.Client`;
- :mod:`.embedded` — :class:`EmbeddedEngine`, over :class:`kvpool.EmbeddedPool`;
- :func:`open_engine` — an engine by name, as a connector's settings choose it.
"""

from __future__ import annotations

from kvpool.engines.base import MISS, POOL_TTL, PoolEngine
from kvpool.engines.embedded import EmbeddedEngine
from kvpool.engines.kvpool_master import MasterEngine
from kvpool.errors import ConfigError

__all__ = [
    "ENGINES",
    "MISS",
    "POOL_TTL",
    "EmbeddedEngine",
    "MasterEngine",
    "PoolEngine",
    "open_engine",
]

#: the engines :func:`open_engine` opens, by :attr:`PoolEngine.engine` name
ENGINES = ("kvpool", "embedded")

_DEFAULT_EMBEDDED_CAPACITY = 1 << 30


def open_engine(
    engine: str,
    *,
    master: str = "",
    timeout_s: float = 10.0,
    capacity: int = _DEFAULT_EMBEDDED_CAPACITY,
) -> PoolEngine:
    """A new engine: ``"kvpool"`` connects to ``master`` (host:port; each call waits at most
    ``timeout_s``), ``"embedded"`` creates an in-process pool of ``capacity`` bytes."""
    if engine == "kvpool":
        if not master:
            raise ConfigError('engine "kvpool" needs the master\'s address (host:port)')
        return MasterEngine.connect(master, timeout_s=timeout_s)
    if engine == "embedded":
        return EmbeddedEngine.create(capacity)
    raise ConfigError(f"unknown pool engine {engine!r}; use one of {', '.join(ENGINES)}")
