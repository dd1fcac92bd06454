"""The wire contract: frame codec and typed messages (no sockets here).

- :mod:`kvpool.protocol.codec` -- frame header, limits, incremental decoder.
- :mod:`kvpool.protocol.data` -- data-plane messages (segment reads and writes).
- :mod:`kvpool.protocol.messages` -- the master's metadata messages.
- :mod:`kvpool.protocol.pull` -- P→D pulls of a request's KV pages (the transfer connector).
"""

from __future__ import annotations

__all__: list[str] = []
