"""KVPoolTransferConnector: direct P→D transfer of KV blocks.

vLLM loads it by ``"kv_connector_module_path": "kvpool.connectors.transfer"`` (importlib,
then ``getattr`` of the class name), so this package exports the class; only
:mod:`.connector` imports vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVPoolTransferConnector", "TransferMetadata"]


# Resolves lazily: the vLLM-free halves (.scheduler, .worker, .server, .transport, .tcp,
# .jobs, .state) import without vLLM, and importing this connector never imports the store
# connector.
def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvpool.connectors.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module("kvpool.connectors.transfer.connector"), name)
