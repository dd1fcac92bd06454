"""The one place where kvpool's connectors meet differences between vLLM releases.

Each difference is detected by what the installed vLLM has, not by its version number, and
names the vLLM change that made it; connectors import these names instead of vLLM's own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HIT_SOURCE_HOST", "HIT_SOURCE_P2P", "ConnectorHooks"]

# CacheHitSource (vllm.v1.metrics.cache_hit_source) arrived in vLLM 0.32 with the
# per-source external cache hit metrics (KVConnectorBase_V1._cache_hit_source); on 0.30
# and 0.31 there is no such metric and the connectors' _cache_hit_source is unused, so it
# is None there.
try:  # vLLM ≥ 0.32: external hits are counted per source (host memory, disk, peer)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HIT_SOURCE_HOST: Any = CacheHitSource.HOST
    HIT_SOURCE_P2P: Any = CacheHitSource.P2P
except ImportError:  # vLLM 0.30, 0.31: no per-source hit metric reads the attribute
    HIT_SOURCE_HOST = None
    HIT_SOURCE_P2P = None


class ConnectorHooks:
    """Class-level hooks newer vLLM asks a connector; put it before ``KVConnectorBase_V1``."""

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # A class hook of KVConnectorBase_V1 since vLLM 0.33 (with unregister_kv_caches /
        # restore_kv_caches), default True.  kvpool's workers keep views of the KV cache
        # and the transfer connector holds P's blocks until D pulls them; a sleep discards
        # that KV, so both say False and vLLM refuses --enable-sleep-mode at start-up
        # with its own one line.  Older vLLM never calls the hook.
        return False
