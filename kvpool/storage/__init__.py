"""Where pooled bytes live.

- :mod:`kvpool.storage.segment` -- a shared-memory segment other local processes can attach.
- :mod:`kvpool.storage.ssd` -- the size-capped, checksummed SSD tier.
- :mod:`kvpool.storage.buffers` -- caller buffers (bytes, NumPy, torch) as flat byte views.
"""

from __future__ import annotations

__all__: list[str] = []
