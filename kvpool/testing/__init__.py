"""Helpers for tests and benchmarks that need a model: :func:`build_tiny_model`.

Names are resolved lazily so that ``python -m kvpool.testing.tiny_model`` does not import the
module twice (runpy warns when the package already imported it).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PRESETS", "TinyModelSpec", "build_tiny_model", "sample_text"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("kvpool.testing.tiny_model"), name)
    raise AttributeError(f"module 'kvpool.testing' has no attribute {name!r}")
