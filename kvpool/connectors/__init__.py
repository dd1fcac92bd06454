"""vLLM KV connectors: the only package of kvpool that imports vLLM.

``store.KVPoolStoreConnector`` is the prefix-cache pool, ``transfer.KVPoolTransferConnector``
direct P→D transfer; vLLM loads each through ``"kv_connector_module_path"``.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvpool.config.vllm_versions import check_vllm_version, installed_vllm_version

# Refuse a vLLM outside the supported range (kvpool.config.vllm_versions) with one line
# naming both versions, before an import deep inside vLLM can fail with a traceback of its
# own.
check_vllm_version(installed_vllm_version())

__all__ = ["KVPoolStoreConnector", "KVPoolTransferConnector"]

_MODULES = {
    "KVPoolStoreConnector": "kvpool.connectors.store",
    "KVPoolTransferConnector": "kvpool.connectors.transfer",
}


# Names resolve lazily, so that importing one connector (or this package) does not import
# the other, nor vLLM itself.
def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool.connectors' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
