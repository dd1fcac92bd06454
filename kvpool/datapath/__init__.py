"""Moving bytes between processes and hosts.

The client's seam is :mod:`kvpool.datapath.transport` (what a client needs from a data
path, with the TCP and same-host shared-memory transports) and
:mod:`kvpool.datapath.in_process` (a pool in this very process); behind them, one node's
data path (:mod:`kvpool.datapath.path`) chooses shared memory when it can and TCP
otherwise.
"""

from __future__ import annotations

__all__: list[str] = []
