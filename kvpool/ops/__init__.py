"""Operator tools: ``kvpool doctor`` (checks a node or a P/D pair against the seed's
troubleshooting table and deployment checklist) and ``kvpool config render`` (per-node
configs from an inventory).  Checks are pure functions over parsed inputs; sockets, disks,
files and the environment are read only in :mod:`kvpool.ops.probes` and the entry points.
"""

from __future__ import annotations

__all__: list[str] = []
