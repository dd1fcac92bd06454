"""KVPoolStoreConnector: vLLM's KV in the pool, keyed by prefix (vllm-ascend's
``AscendStoreConnector``), loaded by ``"kv_connector_module_path": "kvpool.connectors.store"``
(docs/connectors.md §6); laid out as vLLM's ``kv_connector/v1/offloading/``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVPoolStoreConnector", "StoreConnectorMetadata", "namespace_for"]


# The connector's names resolve lazily (vLLM resolves the class with getattr on this
# package), so importing a vLLM-free part such as .scheduler or .plan does not import vLLM.
def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvpool.connectors.store' has no attribute {name!r}")
    return getattr(importlib.import_module("kvpool.connectors.store.connector"), name)
