"""Helpers for tests and benchmarks: :mod:`kvpool.testing.processes` starts a real
``kvpool master`` or ``kvpool node`` as a subprocess.  The small model that ``kvpool up``
builds lives with that command, in :mod:`kvpool.ops.up.tiny_model`.  What tests start
goes through :mod:`kvpool.testing.lifetime`, so that it ends with the run that started it.
"""

from __future__ import annotations

__all__: list[str] = []
