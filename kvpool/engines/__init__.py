"""Pool engines behind one interface (:class:`~kvpool.engines.base.PoolEngine`): kvpool's
own master, the in-process embedded pool, and real Mooncake Store.  No vLLM here.

- :mod:`.base` — the interface (:class:`PoolEngine`, and :class:`PoolLookups`: the part
  the scheduler half asks) and the rules every adapter keeps;
- :mod:`.parts` — an object's parts as bytes, and a reused staging area;
- :mod:`.kvpool_master` — :class:`MasterEngine`, over :class:`kvpool.Client`;
- :mod:`.embedded` — :class:`EmbeddedEngine`, over :class:`kvpool.EmbeddedPool`;
- :mod:`.mooncake` — :class:`MooncakeEngine`, over real Mooncake Store (the ``mooncake``
  extra; imported only when that engine is opened);
- :func:`open_engine` — an engine by name, as a connector's settings choose it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvpool.engines.base import MISS, POOL_TTL, PoolEngine, PoolLookups
from kvpool.engines.embedded import EmbeddedEngine
from kvpool.engines.kvpool_master import MasterEngine
from kvpool.engines.mooncake import MooncakeEngine
from kvpool.errors import ConfigError

if TYPE_CHECKING:
    from kvpool.config.node import MooncakeNodeConfig

__all__ = [
    "ENGINES",
    "MISS",
    "POOL_TTL",
    "EmbeddedEngine",
    "MasterEngine",
    "MooncakeEngine",
    "PoolEngine",
    "PoolLookups",
    "open_engine",
]

#: the engines :func:`open_engine` opens, by :attr:`PoolEngine.engine` name
ENGINES = ("kvpool", "embedded", "mooncake")

_DEFAULT_EMBEDDED_CAPACITY = 1 << 30


def open_engine(
    engine: str,
    *,
    master: str = "",
    timeout_s: float = 10.0,
    capacity: int = _DEFAULT_EMBEDDED_CAPACITY,
    mooncake: MooncakeNodeConfig | None = None,
) -> PoolEngine:
    """A new engine: ``"kvpool"`` connects to ``master`` (host:port; each call waits at most
    ``timeout_s``), ``"embedded"`` creates an in-process pool of ``capacity`` bytes,
    ``"mooncake"`` opens Mooncake Store as the ``mooncake`` config says (default: the node
    config that KVPOOL_CONFIG_PATH / MOONCAKE_CONFIG_PATH names).  Each connects on first
    use."""
    if engine == "kvpool":
        if not master:
            raise ConfigError('engine "kvpool" needs the master\'s address (host:port)')
        return MasterEngine.connect(master, timeout_s=timeout_s)
    if engine == "embedded":
        return EmbeddedEngine.create(capacity)
    if engine == "mooncake":
        if mooncake is None:
            from kvpool.config.node import parse_mooncake_config, read_node_json

            data, source = read_node_json()
            if not isinstance(data, dict):
                raise ConfigError(f"{source}: expected a JSON object")
            mooncake = parse_mooncake_config(data, source=source)
        return MooncakeEngine(mooncake, timeout_s=timeout_s)
    raise ConfigError(f"unknown pool engine {engine!r}; use one of {', '.join(ENGINES)}")
