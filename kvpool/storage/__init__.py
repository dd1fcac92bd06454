"""Where pooled bytes live.

- :mod:`kvpool.storage.segment` -- a shared-memory segment other local processes can attach.
- :mod:`kvpool.storage.ssd` -- the size-capped, checksummed SSD tier.
- :mod:`kvpool.storage.buffers` -- caller buffers (bytes, NumPy, torch) as flat byte views.
- :mod:`kvpool.storage.checksum` -- the end-to-end checksum of an object's bytes (xxh3-64).
"""

from __future__ import annotations

__all__: list[str] = []
