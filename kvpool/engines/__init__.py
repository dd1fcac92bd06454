"""Pool engines behind one interface (:class:`~kvpool.engines.base.PoolEngine`): kvpool's
own master, the in-process embedded pool, and real Mooncake Store.  No vLLM here.

Each is named in :data:`ENGINES` as ``"module:attr"`` and imported when opened, so the
``mooncake`` engine plugs in from above without this package importing it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.engines.base import MISS, POOL_TTL, PoolEngine, PoolLookups
from kvpool.engines.embedded import EmbeddedEngine
from kvpool.engines.kvpool_master import MasterEngine
from kvpool.errors import ConfigError
from kvpool.named import resolve

if TYPE_CHECKING:
    from kvpool.config.node import AnyNodeConfig

__all__ = [
    "ENGINES",
    "MISS",
    "POOL_TTL",
    "EmbeddedEngine",
    "MasterEngine",
    "PoolEngine",
    "PoolLookups",
    "open_engine",
]

#: the engines :func:`open_engine` opens, by :attr:`PoolEngine.engine` name: each an
#: opener (``master``, ``timeout_s``, ``capacity``, ``mooncake`` keywords) named
#: ``"module:attr"``
ENGINES: dict[str, str] = {
    "kvpool": "kvpool.engines.kvpool_master:open_master_engine",
    "embedded": "kvpool.engines.embedded:open_embedded_engine",
    "mooncake": "kvpool.mooncake.engine:open_mooncake_engine",
}

_DEFAULT_EMBEDDED_CAPACITY = 1 << 30


def open_engine(
    engine: str,
    *,
    master: str = "",
    timeout_s: float = 10.0,
    capacity: int = _DEFAULT_EMBEDDED_CAPACITY,
    mooncake: AnyNodeConfig | None = None,
    replica_num: int = 0,
) -> PoolEngine:
    """A new engine: ``"kvpool"`` connects to ``master`` (host:port; each call waits at most
    ``timeout_s``), ``"embedded"`` creates an in-process pool of ``capacity`` bytes,
    ``"mooncake"`` opens Mooncake Store as the ``mooncake`` config says (default: the node
    config that KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH names).  Each connects on first
    use.  ``replica_num``: copies of each put, on different nodes (0: the pool's default;
    the embedded pool has one segment, so one copy)."""
    opener = ENGINES.get(engine)
    if opener is None:
        raise ConfigError(f"unknown pool engine {engine!r}; use one of {', '.join(ENGINES)}")
    opened: PoolEngine = resolve(opener)(
        master=master,
        timeout_s=timeout_s,
        capacity=capacity,
        mooncake=mooncake,
        replica_num=replica_num,
    )
    return opened
