"""The wire contract: frame codec and typed messages (no sockets here): the master's
metadata, the data plane's segment reads and writes, and P→D pulls.
"""

from __future__ import annotations

__all__: list[str] = []
