"""KVPoolTransferConnector: direct P→D transfer of KV blocks, as vLLM's own
``kv_connector/v1/offloading/`` is laid out.

vLLM loads it by ``"kv_connector_module_path": "kvpool.connectors.transfer"`` (importlib,
then ``getattr`` of the class name), so this package exports the class.  :mod:`.connector`
is the vLLM adapter; the halves it wires (:mod:`.scheduler`, :mod:`.worker` and what they
use) import without vLLM.  Settings and the P/D layout are vLLM-free and live in
:mod:`kvpool.config`.
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
