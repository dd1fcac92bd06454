"""The data port's check of a tenant's grants, in front of a tenant's connection (role
``tenant-data``).  A connection of the cluster secret or a node key never passes here:
the plain data path has no tenant test per request.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from msgspec import structs

from kvpool.errors import AuthError
from kvpool.protocol.data import (
    DataRequest,
    SegmentRead,
    SegmentReadMany,
    SegmentWrite,
    SegmentWriteMany,
    SsdRead,
)
from kvpool.security.credentials import check_grant, ssd_subject

__all__ = ["GRANT_SEP", "TenantGrants", "tenant_check"]

#: between a segment id (or an SSD object's key) and the grant the master gave with it
GRANT_SEP = "#"


# Rules:
# - A tenant's connection may only read or write ranges and read SSD objects by key, and
#   each request must carry the master's grant for exactly that tenant, operation and
#   range (or key), unexpired (:func:`kvpool.security.credentials.check_grant`: one HMAC
#   per request, none per frame).  A request without one is refused with an AuthError
#   naming it; the server drains a refused write's payload and the connection goes on.
# - A batch is checked range by range, each against its own grant, before any byte moves.
# - A tenant's keys are the master's to scope: its write tags and notes are dropped, so
#   the node's catalog never notes a key a tenant chose.
class TenantGrants:
    """One tenant's connection to one node's data port: :meth:`check` gives each request
    as served (its segment ids without the grants), or raises the AuthError refusing it.

    ``node_key`` is the serving node's: the master MACs every grant with it."""

    def __init__(self, node_key: bytes, tenant: str) -> None:
        self.node_key = node_key
        self.tenant = tenant

    def check(self, request: DataRequest) -> DataRequest:
        """``request`` as served, once every grant in it holds (see the rules above)."""
        tenant = self.tenant
        if isinstance(request, SegmentReadMany):
            ranges = [(self._check(s, "r", o, n), o, n) for s, o, n in request.ranges]
            return structs.replace(request, ranges=ranges)
        if isinstance(request, SegmentWriteMany):  # its notes go, as a single write's tag
            ranges = [(self._check(s, "w", o, n), o, n) for s, o, n in request.ranges]
            return structs.replace(request, ranges=ranges, notes=[])
        if isinstance(request, SsdRead):  # by key: ``@tenant/key#grant``
            key, sep, grant = request.key.rpartition(GRANT_SEP)
            if not sep:
                grant = ""
            self._check(f"{ssd_subject(key)}{GRANT_SEP}{grant}", "s", 0, request.length)
            return structs.replace(request, key=key)
        if not isinstance(request, SegmentRead | SegmentWrite):
            raise AuthError(
                f"tenant {tenant}: {type(request).__name__} is not open to a tenant's "
                "connection (reads and writes with a grant only)"
            )
        op = "w" if isinstance(request, SegmentWrite) else "r"
        segment_id = self._check(request.segment_id, op, request.offset, request.length)
        if isinstance(request, SegmentWrite):
            # a tenant's keys are the master's to scope: it may not note one here
            return structs.replace(request, segment_id=segment_id, key="", checksum=0)
        return structs.replace(request, segment_id=segment_id)

    def _check(self, granted_id: str, op: str, offset: int, length: int) -> str:
        """The segment id of ``granted_id`` (``segment#grant``) once its grant lets the
        tenant do ``op`` on that range."""
        segment_id, _, grant = granted_id.partition(GRANT_SEP)
        now_ms = time.time_ns() // 1_000_000
        check_grant(self.node_key, self.tenant, segment_id, grant, op, offset, length, now_ms)
        return segment_id


def tenant_check(node_key: bytes, tenant: str) -> Callable[[DataRequest], DataRequest]:
    """The check of ``tenant``'s requests to the data port of the node whose key is
    ``node_key``: what a segment server is given as its ``tenants``."""
    return TenantGrants(node_key, tenant).check
