"""KVPoolTransferConnector: direct P→D transfer of KV blocks, as vLLM's own
``kv_connector/v1/offloading/`` is laid out.

vLLM loads it by ``"kv_connector_module_path": "kvpool.connectors.transfer"`` (importlib,
then ``getattr`` of the class name), so this package exports the class.  It resolves
lazily: the vLLM-free halves (:mod:`.scheduler`, :mod:`.worker`, :mod:`.server`,
:mod:`.transport`, :mod:`.tcp`, :mod:`.jobs`, :mod:`.state`) import without vLLM, and
importing this connector never imports the store connector.

- :mod:`.connector` — the vLLM adapter (the only module here that imports vLLM, with
  :mod:`.stats`);
- :mod:`.scheduler` — what to hold, pull and release; :mod:`.jobs` — what it tells the
  workers each step;
- :mod:`.worker` — one rank's pulls (D) and holds (P); :mod:`.server` — P's rules for
  serving pulls on its ``kv_port``; :mod:`.state` — the hold and load book-keeping;
- :mod:`.transport` — the data-plane seam; :mod:`.tcp` — kvpool's TCP behind it;
- :mod:`.stats` — counters in vLLM's stats and Prometheus channels.

Settings and the P/D layout are vLLM-free and live in :mod:`kvpool.config`.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["KVPoolTransferConnector", "TransferMetadata"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvpool.connectors.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module("kvpool.connectors.transfer.connector"), name)
