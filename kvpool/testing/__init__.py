"""Helpers for tests and benchmarks.  What tests start goes through
:mod:`kvpool.testing.lifetime`, so that it ends with the run that started it.
"""

from __future__ import annotations

__all__: list[str] = []
