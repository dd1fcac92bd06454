"""The operator's commands, one module or package per command; each is an options
dataclass and ``run(options) -> int`` (:mod:`kvpool.cli` only builds the options).
"""

from __future__ import annotations

__all__: list[str] = []
