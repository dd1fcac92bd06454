"""An object by its ``"package.module:attr"`` name, imported when asked for.

How a lower part reaches a higher one without an arrow to it (an engine's adapter, a
transport): each is imported only when chosen.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["resolve"]


def resolve(target: str) -> Any:
    """``"pkg.mod:attr"`` (``attr`` may be dotted): import ``pkg.mod``, return the attr."""
    module, _, name = target.partition(":")
    value: Any = importlib.import_module(module)
    for part in filter(None, name.split(".")):
        value = getattr(value, part)
    return value
