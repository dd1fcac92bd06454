"""A tenant's data path: every read and write over the node's data port, each with the
master's grant.

A tenant holds no node key, so it cannot open a node's data port the way a holder of
the cluster secret does.  The master hands it, inside each memory placement's segment
id, ``<segment id>#<grant>#<data key>`` (:mod:`kvpool.service.master_tenants`): the
grant for exactly that range and operation, and the tenant's key to that node's data
port.  This path opens the connection with the data key (handshake role
``tenant-data``) and sends each request's segment id with its grant, never the key;
the node checks the grant before it serves a byte (:mod:`kvpool.transfer.segment_server`).

Rules:

- Never shared memory: a segment mapped into a tenant's process would bypass every
  grant (the master gives a tenant no shared-memory name either).
- A segment id without a grant (an SSD placement, a pool without tenants) is refused
  here, as a plain :class:`~kvpool.errors.PoolError`: a miss for the caller, which
  reports nothing (the object is fine).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.closing import Closing
from kvpool.core.credentials import Credential
from kvpool.errors import KVPoolError, PoolError
from kvpool.net import split_address
from kvpool.transfer.segment_client import SegmentConnection

__all__ = ["TenantDataPath", "TenantTransport"]

_SEP = "#"


def _split(segment_id: str) -> tuple[str, str]:
    """``(segment id with its grant, data key hex)`` of a tenant's segment id."""
    granted, sep, data_key = segment_id.rpartition(_SEP)
    if not sep or _SEP not in granted or not data_key:
        raise PoolError(
            f"segment {segment_id}: no grant from the master for it (a tenant reads and "
            "writes memory placements only)"
        )
    return granted, data_key


class TenantDataPath(Closing):
    """Reads and writes of one node's segments for one tenant, over TCP with grants."""

    def __init__(
        self, host: str, port: int, tenant: str, timeout_s: float, tls: ssl.SSLContext | None
    ) -> None:
        self.host, self.port, self.tenant = host, port, tenant
        self.timeout_s = timeout_s
        self.tls = tls
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
            self._conn = SegmentConnection(
                self.host,
                self.port,
                self.timeout_s,
                credential=credential,
                client_id=self.tenant,
                tls=self.tls,
            )
            self._key = data_key
        return self._conn

    def write(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        granted, data_key = _split(segment_id)
        return self._connection(data_key).write(granted, offset, buffer)

    def write_noted(
        self,
        segment_id: str,
        offset: int,
        buffer: Any,
        key: str,
        checksum: int,
        *,
        shm_name: str = "",
    ) -> bool:
        self.write(segment_id, offset, buffer)
        return False  # a tenant's keys are the master's to scope: nodes ignore its tags

    def read_into(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        granted, data_key = _split(segment_id)
        return self._connection(data_key).read_into(granted, offset, buffer)

    def read_checked(self, segment_id: str, offset: int, buffer: Any, *, shm_name: str = "") -> int:
        granted, data_key = _split(segment_id)
        return self._connection(data_key).read_checked(granted, offset, buffer)

    def _many(
        self,
        items: Sequence[tuple[str, int, Any]],
        move: Callable[[SegmentConnection, list[tuple[str, int, Any]]], Sequence[Any]],
    ) -> list[Any]:
        """``move`` of the items on their node's connection, their grants split off; an
        item whose grant is malformed gets its error instead."""
        results: list[Any] = [None] * len(items)
        batch: list[tuple[str, int, Any]] = []
        where: list[int] = []
        data_key = ""
        for i, (segment_id, offset, buffer) in enumerate(items):
            try:
                granted, data_key = _split(segment_id)
            except PoolError as exc:
                results[i] = exc
                continue
            batch.append((granted, offset, buffer))
            where.append(i)
        if batch:
            done = move(self._connection(data_key), batch)  # one node, one tenant: one key
            for i, result in zip(where, done, strict=True):
                results[i] = result
        return results

    def write_many(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | None]:
        return self._many(items, SegmentConnection.write_many)

    def write_many_noted(
        self, items: Sequence[tuple[str, int, Any]], notes: Sequence[tuple[str, int]]
    ) -> tuple[list[KVPoolError | None], bool]:
        return self.write_many(items), False  # nodes ignore a tenant's tags

    def read_many_into(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | None]:
        return self._many(items, SegmentConnection.read_many_into)

    def read_many_checked(self, items: Sequence[tuple[str, int, Any]]) -> list[KVPoolError | int]:
        return self._many(items, SegmentConnection.read_many_checked)

    def ssd_read_into(self, key: str, buffer: Any) -> int:
        raise PoolError(f"{key}: a tenant's SSD reads take no grant yet (a miss)")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class TenantTransport:
    """Opens :class:`TenantDataPath`\\ s for the tenant of ``credential``."""

    name = "tenant"

    def __init__(
        self, timeout_s: float, credential: Credential, tls: ssl.SSLContext | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.tenant = credential.tenant
        self.tls = tls

    def connect(self, address: str) -> TenantDataPath:
        host, port = split_address(address)
        return TenantDataPath(host, port, self.tenant, self.timeout_s, self.tls)
