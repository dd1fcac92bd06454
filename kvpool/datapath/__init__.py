"""Moving bytes between processes and hosts: the client's transport seam and its TCP,
same-host shared-memory and in-process data paths.
"""

from __future__ import annotations

__all__: list[str] = []
