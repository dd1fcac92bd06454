"""Where pooled bytes live: shared-memory segments, the SSD tier, caller buffers as byte
views, and the end-to-end checksum.
"""

from __future__ import annotations

__all__: list[str] = []
