"""Moving bytes between processes and hosts.

The client's seam:

- :mod:`kvpool.transfer.transport` -- :class:`Transport` and :class:`DataPath`, what a
  client needs from a data path; the TCP and same-host (shared memory) transports.
- :mod:`kvpool.transfer.in_process` -- the transport of a pool in this very process.

Behind them:

- :mod:`kvpool.transfer.path` -- one node's data path: shared memory when possible, TCP
  otherwise, decided once per segment.
- :mod:`kvpool.transfer.shm` -- the same-host path through shared memory.
- :mod:`kvpool.transfer.segment_client` -- the TCP connection to a segment data server
  (single and pipelined transfers).
- :mod:`kvpool.transfer.segment_server` -- the segment data server.
- :mod:`kvpool.transfer.server` -- the one threaded TCP server (accept loop, a thread per
  connection, bounded stop) that the segment server and the prefill's pull server share.
- :mod:`kvpool.transfer.channel` -- a framed connection end with few syscalls.
- :mod:`kvpool.transfer.framing` -- frames over plain blocking sockets, with deadlines.
"""

from __future__ import annotations

__all__: list[str] = []
