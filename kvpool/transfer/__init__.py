"""Moving bytes between processes and hosts.

- :mod:`kvpool.transfer.framing` -- blocking-socket framing with deadlines (in-place receive).
- :mod:`kvpool.transfer.channel` -- the same over one socket with fewer syscalls.
- :mod:`kvpool.transfer.segment_server` -- the segment data server.
- :mod:`kvpool.transfer.segment_client` -- its TCP client connection (single and pipelined).
- :mod:`kvpool.transfer.shm` -- the same-host path through shared memory.
- :mod:`kvpool.transfer.path` -- picks shared memory when possible, TCP otherwise.
"""

from __future__ import annotations

__all__: list[str] = []
