"""KVPoolStoreConnector: vLLM's KV in the pool, keyed by prefix (vllm-ascend's
``AscendStoreConnector``, the production guide's §6).

Load it in vLLM with ``"kv_connector": "KVPoolStoreConnector"`` and
``"kv_connector_module_path": "kvpool.connectors.store"`` (this package), on its own or as
a child of vLLM's MultiConnector.  Laid out as vLLM's own ``kv_connector/v1/offloading/``:

- :mod:`.connector` — :class:`KVPoolStoreConnector`: wires the two halves to vLLM's hooks;
- :mod:`.scheduler` — the scheduler half: lookups, load and save plans (no vLLM import);
- :mod:`.worker` — the worker half: copies pages between vLLM's KV cache and the pool;
- :mod:`.plan` — what the scheduler half tells the worker half each step (the metadata);
- :mod:`.pool` — the pool as the connector sees it: a :class:`~kvpool.engines.PoolEngine`
  behind a self-healing handle, and the process's shared embedded pool;
- :mod:`.lookup` — the scheduler↔worker lookup channel of the embedded backend;
- :mod:`.stats` — hit statistics for vLLM's stats and Prometheus channels.

Settings are :mod:`kvpool.config.kv_transfer`.  The connector's names resolve lazily
(vLLM resolves the class with ``getattr`` on this package), so importing a vLLM-free part
such as :mod:`.scheduler` or :mod:`.plan` does not import vLLM.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVPoolStoreConnector", "StoreConnectorMetadata", "namespace_for"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvpool.connectors.store' has no attribute {name!r}")
    return getattr(importlib.import_module("kvpool.connectors.store.connector"), name)
