"""A tenant's data path: every read and write over the node's data port, each with the
master's grant.

A tenant holds no node key, so the master hands it ``<segment id>#<grant>#<data key>`` in
each placement; the connection opens with the data key (role ``tenant-data``) and each
request carries its grant, never the key, which the node checks before it serves a byte.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from msgspec import structs

from kvpool.closing import Closing
from kvpool.datapath.data_ops import DataOp, OpResult, SsdReadOp, WriteOp
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.errors import PoolError
from kvpool.net import split_address
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from kvpool.tenancy.book import scoped
from kvpool.tenancy.grants import GRANT_SEP as _SEP

__all__ = ["TenantDataPath", "TenantTransport"]


def _split(segment_id: str) -> tuple[str, str]:
    """``(segment id with its grant, data key hex)`` of a tenant's segment id."""
    granted, sep, data_key = segment_id.rpartition(_SEP)
    if not sep or _SEP not in granted or not data_key:
        raise PoolError(
            f"segment {segment_id}: no grant from the master for it (a tenant reads and "
            "writes memory placements only)"
        )
    return granted, data_key


# Rules:
# - Never shared memory: a segment mapped into a tenant's process would bypass every
#   grant (the master gives a tenant no shared-memory name either).
# - A segment id without a grant (a pool without tenants) is refused here, as a plain
#   PoolError: a miss for the caller, which reports nothing (the object is fine).
# - An SSD read is by key: it sends the key as stored (`@tenant/key`) with the grant for
#   that key after a `#`.
class TenantDataPath(Closing):
    """Reads and writes of one node's segments for one tenant, over TCP with grants.

    ``peer`` is the tenant client's: its timeout and TLS context; each connection's
    credential is the data key of the node's latest placement, proved as the tenant."""

    def __init__(self, host: str, port: int, tenant: str, peer: PeerSettings) -> None:
        self.host, self.port, self.tenant = host, port, tenant
        self.peer = peer
        self._conn: SegmentConnection | None = None
        self._key = ""

    def _connection(self, data_key: str) -> SegmentConnection:
        if self._conn is None or data_key != self._key:  # a node restarted: a new key
            if self._conn is not None:
                self._conn.close()
            try:
                key = bytes.fromhex(data_key)
            except ValueError:
                raise PoolError("a placement's data key is not hex: a broken reply") from None
            credential = Credential(tenant=self.tenant, data_key=key)
            peer = dataclasses.replace(self.peer, credential=credential, client_id=self.tenant)
            self._conn = SegmentConnection(self.host, self.port, peer)
            self._key = data_key
        return self._conn

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        """The ops (:mod:`kvpool.datapath.data_ops`) on the node's connection, their
        grants split off.  An op whose grant is malformed gets its error instead; no
        write is noted (a tenant's keys are the master's to scope: nodes ignore its tags,
        so none is sent)."""
        results: list[OpResult] = [None] * len(ops)
        granted_ops: list[DataOp] = []
        where: list[int] = []
        data_key = ""
        for i, op in enumerate(ops):
            try:
                granted, data_key = _split(op.segment_id)
            except PoolError as exc:
                results[i] = exc
                continue
            if isinstance(op, SsdReadOp):  # by key, as stored: the grant rides with it
                grant = granted.partition(_SEP)[2]
                key = f"{scoped(self.tenant, op.key)}{_SEP}{grant}"
                granted_ops.append(SsdReadOp(key, op.buffer))
            elif isinstance(op, WriteOp):
                granted_ops.append(structs.replace(op, segment_id=granted, key="", checksum=0))
            else:
                granted_ops.append(structs.replace(op, segment_id=granted))
            where.append(i)
        if granted_ops:
            done = self._connection(data_key).run(granted_ops)  # one node, one tenant: one key
            for i, result in zip(where, done, strict=True):
                results[i] = result
        return results

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class TenantTransport:
    """Opens :class:`TenantDataPath`\\ s for the tenant of ``peer.credential``."""

    name = "tenant"

    def __init__(self, peer: PeerSettings) -> None:
        if peer.credential is None or not peer.credential.is_tenant:
            raise ValueError("a tenant transport needs a tenant's credential")
        self.peer = peer
        self.tenant = peer.credential.tenant

    def connect(self, address: str) -> TenantDataPath:
        host, port = split_address(address)
        return TenantDataPath(host, port, self.tenant, self.peer)
