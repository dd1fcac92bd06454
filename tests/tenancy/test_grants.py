"""The data port's tenant check is chosen when a connection is admitted: a segment server
given no ``tenants`` admits no tenant at all, and its plain connections never meet it."""

from __future__ import annotations

import time

import pytest

from kvpool.datapath.data_ops import read, write
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.datapath.segment_server import SegmentServer
from kvpool.errors import AuthError
from kvpool.security.credentials import Credential, make_grant, tenant_data_key
from kvpool.security.peer import PeerSettings
from kvpool.storage.segment import Segment
from kvpool.tenancy.grants import tenant_check

SECRET = "3f9c1e7a5b2d4f6e8a0c1b3d5f7e9a2c4b6d8f0e1a3c5b7d9f2e4a6c8b0d1f3e"


def red_on_node_a(cluster: Credential) -> tuple[str, Credential]:
    """Tenant red's grant to write node-a/mem's first 100 bytes for a minute, and red's
    credential (its data key derived from node-a's key, as the master hands it out)."""
    node_key = cluster.node_key_of("node-a")
    until = time.time_ns() // 1_000_000 + 60_000
    grant = make_grant(node_key, "red", "node-a/mem", "w", 0, 100, until)
    return grant, Credential(tenant="red", data_key=tenant_data_key(node_key, "red"))


@pytest.mark.parametrize("with_tenants", [True, False])
def test_a_tenant_is_served_only_where_the_server_was_given_the_check(with_tenants: bool) -> None:
    cluster = Credential.parse(SECRET, "test")
    tenants = tenant_check if with_tenants else None
    with Segment.create(1 << 20) as segment:
        server = SegmentServer(
            timeout_s=5.0, credential=cluster, server_id="node-a", tenants=tenants
        )
        server.add_segment("node-a/mem", segment)
        server.start()
        try:
            host, port = server.address
            grant, red = red_on_node_a(cluster)
            peer = PeerSettings(5.0, credential=red, client_id="red")
            with SegmentConnection(host, port, peer) as conn:
                if with_tenants:
                    write(conn, f"node-a/mem#{grant}", 0, b"r" * 100)
                    assert segment.read(0, 100) == b"r" * 100
                else:
                    with pytest.raises(AuthError):
                        write(conn, f"node-a/mem#{grant}", 0, b"r" * 100)
            # the cluster secret's connection: the plain path, with or without the check
            with SegmentConnection(host, port, PeerSettings(5.0, credential=cluster)) as conn:
                assert read(conn, "node-a/mem", 0, 4) == (b"r" * 4 if with_tenants else b"\0" * 4)
        finally:
            server.close()
