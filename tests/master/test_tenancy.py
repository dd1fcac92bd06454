"""Tenants on a real master and node (processes on 127.0.0.1): each tenant's keys in its
own namespace, operator actions refused to tenants, quotas with eviction inside the
tenant, per-tenant series on /metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.client.client import Client
from kvpool.datapath.data_ops import read, ssd_read_into, write
from kvpool.datapath.segment_client import SegmentConnection
from kvpool.errors import AuthError, ObjectNotFound, QuotaExceeded, StaleWrite
from kvpool.net import http_get, split_address
from kvpool.protocol import messages as m
from kvpool.security.credentials import Credential
from kvpool.security.peer import PeerSettings
from tests.master.auth_pool import SECRET, SecuredPool, secured_pool

CLUSTER = Credential.parse(SECRET, "k")
RED = CLUSTER.tenant_credential("red")
BLUE = CLUSTER.tenant_credential("blue")
QUOTA = 3000  # tenant "small": three 1000-byte objects


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredPool]:
    with secured_pool(tmp_path_factory.mktemp("tenants"), "--tenant_quota", f"small={QUOTA}") as p:
        yield p


def _client(pool: SecuredPool, credential: str) -> Client:
    return Client(pool.master.address, credential=credential, allow_shm=False, timeout_s=5)


def _put(c: Client, key: str, size: int = 1000) -> m.Placement:
    """A put's metadata: reserve, then make visible (the bytes are not the point here)."""
    placement = c.call(m.PutStart(c.client_id, key, size))
    assert isinstance(placement, m.Placement)
    c.call(m.PutEnd(c.client_id, key, 0))
    return placement


def test_a_tenant_credential_is_a_client_of_its_tenant_only() -> None:
    red = Credential.parse(RED, "k")
    assert red.is_tenant and red.tenant == "red" and not red.is_cluster
    assert red.tenant_key_of("red") == CLUSTER.tenant_key_of("red")
    with pytest.raises(AuthError, match="cannot act for tenant 'blue'"):
        red.tenant_key_of("blue")
    with pytest.raises(AuthError, match="cannot act as node"):
        red.node_key_of("node-a")
    with pytest.raises(AuthError, match="operator token"):
        red.operator_token()
    from kvpool.errors import ConfigError

    with pytest.raises(ConfigError, match="kvpool-tenant:<tenant>:<64 hex digits>"):
        Credential.parse("kvpool-tenant:red:abc", "KVPOOL_SECRET")
    with pytest.raises(ConfigError, match="not a tenant name"):
        CLUSTER.tenant_credential("a/b")


def test_the_same_key_from_two_tenants_is_two_objects(pool: SecuredPool) -> None:
    with _client(pool, RED) as red, _client(pool, BLUE) as blue, _client(pool, SECRET) as op:
        placed = _put(red, "shared-prefix")
        assert placed.placed and placed.key == "shared-prefix"  # given back as sent
        assert red.exists("shared-prefix")
        # blue does not see it: exists, batch_exists, prefix lookup, get
        assert not blue.exists("shared-prefix")
        assert blue.batch_exists(["shared-prefix", "x"]) == [False, False]
        assert blue.prefix_lookup(["shared-prefix"]) == 0
        got = blue.call(m.Get("b#1", "shared-prefix"))
        assert isinstance(got, m.Placement) and not got.placed
        # blue's own object of the same name is another object, in another place
        mine = _put(blue, "shared-prefix")
        assert mine.placed and (mine.segment_id, mine.offset) != (placed.segment_id, placed.offset)
        # the operator sees both, under the names the master stores them by
        assert op.batch_exists(["@red/shared-prefix", "@blue/shared-prefix"]) == [True, True]
        assert not op.exists("shared-prefix")


def test_a_tenant_cannot_name_another_tenants_object(pool: SecuredPool) -> None:
    with _client(pool, RED) as red, _client(pool, BLUE) as blue, _client(pool, SECRET) as op:
        _put(red, "red-only")
        # a key spelled as the stored name of red's object is blue's own key
        assert not blue.exists("@red/red-only")
        assert not blue.remove("@red/red-only")
        assert not blue.remove("red-only")
        # an overwrite attempt writes blue's own object; red's stays as it was
        _put(blue, "red-only", 500)
        assert red.exists("red-only")
        assert op.exists("@red/red-only") and op.exists("@blue/red-only")
        # releasing or revoking with red's ids acts on blue's own namespace only
        blue.call(m.ReleaseOwner(red.client_id))
        red.call(m.PutStart(red.client_id, "red-pending", 100))
        with pytest.raises(StaleWrite, match="no pending write of @blue/red-pending"):
            blue.call(m.PutRevoke(red.client_id, "red-pending"))
        red.call(m.PutEnd(red.client_id, "red-pending", 0))  # red's write was untouched
        assert red.exists("red-pending")
        # red removes its own
        assert red.remove("red-only")
        assert not red.exists("red-only") and blue.exists("red-only")


def test_operator_actions_are_refused_to_a_tenant_and_its_link_stays_open(
    pool: SecuredPool,
) -> None:
    with _client(pool, RED) as red:
        for request in (
            m.SetQuota("red", 1 << 30),
            m.ReportFailure("seg-anything", "a tenant trying to drop a node"),
            m.Register("node-evil"),
        ):
            with pytest.raises(AuthError, match="may not send"):
                red.call(request)
        with pytest.raises(AuthError, match="operator action needs the cluster secret"):
            red.call(m.SetQuota("blue", 0))
        # the pool at a glance is the operator's: a tenant sees its own usage only
        assert set(red.stats()) == {
            "tenant", "bytes", "objects", "quota_bytes", "hits", "misses", "evictions"
        }  # fmt: skip
        assert red.stats()["tenant"] == "red"
        assert not red.exists("still-served")  # the same connection is served on
    with _client(pool, SECRET) as op:
        assert pool.node_id in [c["client_id"] for c in op.stats()["clients"]]
        with Client(pool.master.address, credential=RED, timeout_s=5) as red:
            status = http_get(
                f"http://{pool.master.address}/api/status",
                5,
                headers={"Authorization": f"Bearer {RED}"},
            ).status
            assert status == 401  # the HTTP endpoints take the operator's token only


def test_a_quota_evicts_inside_the_tenant_first_then_refuses(pool: SecuredPool) -> None:
    small = CLUSTER.tenant_credential("small")
    with _client(pool, small) as s, _client(pool, RED) as red, _client(pool, SECRET) as op:
        _put(red, "red-keeps")
        for i in range(3):
            _put(s, f"s{i}")
        s.call(m.Get("s#1", "s0"))  # s0 read: s1 is now the least recently used
        s.call(m.Release("s#1", ["s0"]))
        _put(s, "s3")  # over quota by 1000: s1 goes, nobody else's object
        assert s.batch_exists(["s0", "s1", "s2", "s3"]) == [True, False, True, True]
        assert red.exists("red-keeps")
        # everything of its own leased: nothing evictable, the put is refused
        for key in ("s0", "s2", "s3"):
            s.call(m.Get("s#2", key))
        with pytest.raises(QuotaExceeded, match="tenant small holds 3000 bytes of its 3000"):
            s.call(m.PutStart(s.client_id, "s4", 1000))
        s.call(m.ReleaseOwner("s#2"))
        # the operator raises the quota at run time: the put fits without evicting
        assert op.call(m.SetQuota("small", 2 * QUOTA)) == m.Count(3000)
        _put(s, "s4")
        assert s.batch_exists(["s0", "s2", "s3", "s4"]) == [True] * 4
        op.call(m.SetQuota("small", QUOTA))


def test_a_put_no_eviction_could_fit_evicts_nothing(pool: SecuredPool) -> None:
    # a put larger than all the tenant holds could free is refused before anything goes
    with _client(pool, CLUSTER.tenant_credential("tiny")) as t, _client(pool, SECRET) as op:
        op.call(m.SetQuota("tiny", 2000))
        _put(t, "t0", 1500)
        with pytest.raises(QuotaExceeded):
            t.call(m.PutStart(t.client_id, "t1", 2500))
        assert t.exists("t0")


def test_per_tenant_series_on_metrics(pool: SecuredPool) -> None:
    with _client(pool, CLUSTER.tenant_credential("green")) as green:
        _put(green, "g0", 700)
        green.call(m.Get("g#1", "g0"))
        green.call(m.Get("g#1", "g-missing"))
    token = CLUSTER.operator_token()
    body = http_get(
        f"http://{pool.master.address}/metrics", 5, headers={"Authorization": f"Bearer {token}"}
    ).body.decode()
    lines = set(body.splitlines())
    for line in (
        'kvpool_tenant_bytes{tenant="green"} 700.0',
        'kvpool_tenant_objects{tenant="green"} 1.0',
        'kvpool_tenant_hits_total{tenant="green"} 1.0',
        'kvpool_tenant_misses_total{tenant="green"} 1.0',
        'kvpool_tenant_evictions_total{tenant="green"} 0.0',
        f'kvpool_tenant_quota_bytes{{tenant="small"}} {float(QUOTA)}',
    ):
        assert line in lines, line
    assert 'kvpool_tenant_evictions_total{tenant="small"}' in body
    # keys the operator wrote under a name no tenant proved make no series
    with _client(pool, SECRET) as op:
        _put(op, "@nobody/k")
    again = http_get(
        f"http://{pool.master.address}/metrics", 5, headers={"Authorization": f"Bearer {token}"}
    ).body.decode()
    assert 'tenant="nobody"' not in again


def test_a_bad_tenant_quota_flag_is_one_line() -> None:
    import subprocess
    import sys

    argv = ["master", "--port", "0", "--segment_size", "1MiB", "--tenant_quota", "teamA"]
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0
    assert "--tenant_quota: 'teamA' is not NAME=SIZE" in done.stderr
    assert "Traceback" not in done.stderr


def test_tenants_store_and_read_bytes_and_share_none(pool: SecuredPool) -> None:
    with _client(pool, RED) as red, _client(pool, BLUE) as blue:
        red.put("prompt-kv", b"red's KV" * 1000)
        assert red.get("prompt-kv") == b"red's KV" * 1000
        with pytest.raises(ObjectNotFound):
            blue.get("prompt-kv")
        blue.put("prompt-kv", b"blue's KV" * 10)
        assert red.get("prompt-kv") == b"red's KV" * 1000
        assert blue.get("prompt-kv") == b"blue's KV" * 10
        keys = [f"b{i}" for i in range(5)]
        red.batch_put(keys, [bytes([i]) * 300 for i in range(5)])
        assert red.batch_get(keys) == [bytes([i]) * 300 for i in range(5)]
        assert blue.batch_get(keys) == [None] * 5


def _granted(pool: SecuredPool, credential: str, key: str, value: bytes) -> m.Placement:
    """``key`` stored by the tenant of ``credential``, and a read placement of it (with
    its grant) as the master gave it to that tenant."""
    with _client(pool, credential) as c:
        c.put(key, value)
        placement = c.call(m.Get("raw#1", key))
    assert isinstance(placement, m.Placement) and placement.placed
    assert placement.shm_name == "" and placement.segment_id.count("#") == 2
    return placement


def test_a_tenants_data_port_requests_need_the_masters_grant(pool: SecuredPool) -> None:
    from kvpool.datapath.segment_client import SegmentConnection
    from kvpool.net import split_address

    red_placement = _granted(pool, RED, "red-secret", b"R" * 4096)
    blue_placement = _granted(pool, BLUE, "blue-own", b"B" * 4096)
    host, port = split_address(red_placement.data_address)
    segment, red_grant, red_key = red_placement.segment_id.split("#")
    _, blue_grant, blue_key = blue_placement.segment_id.split("#")
    red_data = Credential(tenant="red", data_key=bytes.fromhex(red_key))
    blue_data = Credential(tenant="blue", data_key=bytes.fromhex(blue_key))
    offset, size = red_placement.offset, red_placement.size
    with SegmentConnection(
        host, port, PeerSettings(5, credential=red_data, client_id="red")
    ) as conn:
        # with its grant: exactly its range
        assert read(conn, f"{segment}#{red_grant}", offset, size) == b"R" * 4096
        # the grant with its last character changed (to a different one, always)
        tampered = red_grant[:-1] + ("1" if red_grant.endswith("0") else "0")
        refusals = (
            (f"{segment}", offset, size, "without a grant"),  # a raw read, no grant
            (f"{segment}#{red_grant}", offset + size, size, "outside its grant"),
            (f"{segment}#{red_grant}", 0, 16 << 20, "outside its grant"),
            (f"{segment}#{blue_grant}", blue_placement.offset, 64, "did not make"),
            (f"{segment}#{tampered}", offset, size, "did not make"),
        )
        for segment_id, at, length, why in refusals:
            with pytest.raises(AuthError, match=why):
                read(conn, segment_id, at, length)
        # a read grant writes nothing (the payload is drained, the link goes on)
        with pytest.raises(AuthError, match="outside its grant"):
            write(conn, f"{segment}#{red_grant}", offset, b"X" * size)
        with pytest.raises(AuthError, match="not open to a tenant"):
            conn.info(segment)
    # blue, with its own data key, cannot use red's grant either
    with (
        SegmentConnection(
            host, port, PeerSettings(5, credential=blue_data, client_id="blue")
        ) as conn,
        pytest.raises(AuthError, match="did not make"),
    ):
        read(conn, f"{segment}#{red_grant}", offset, size)
    # a tenant's data key is that tenant's: claiming another tenant with it fails
    forged = Credential(tenant="red", data_key=bytes.fromhex(blue_key))
    with (
        SegmentConnection(host, port, PeerSettings(5, credential=forged, client_id="red")) as conn,
        pytest.raises(AuthError, match="did not prove"),
    ):
        read(conn, f"{segment}#{red_grant}", offset, size)
    # and a tenant's own credential is no key to a data port at all
    with (
        SegmentConnection(
            host, port, PeerSettings(5, credential=Credential.parse(RED, "k"))
        ) as conn,
        pytest.raises(AuthError, match="cannot act as node"),
    ):
        read(conn, segment, offset, size)
    with _client(pool, RED) as red:  # red's object is as it was
        assert red.get("red-secret") == b"R" * 4096


def test_a_tenants_objects_on_the_ssd_tier_read_back_with_their_grant(tmp_path: Path) -> None:
    # 1 MiB of node memory: most of red's 40 objects go to the node's SSD tier, and red
    # reads them there by key, with the master's grant for exactly that key.
    with (
        secured_pool(
            tmp_path,
            "--enable_offload=true",
            node_size="1MiB",
            enable_ssd_offload=True,
            ssd_offload_path=str(tmp_path / "ssd"),
            ssd_offload_limit="16MiB",
        ) as pool,
        _client(pool, RED) as red,
        _client(pool, BLUE) as blue,
    ):
        values = {f"s{i:02d}": bytes([i]) * (64 * 1024) for i in range(40)}
        for key, value in values.items():
            red.put(key, value)
        reply = red.call(m.BatchGet("tiers", list(values)))
        assert isinstance(reply, m.Placements)
        red.call(m.ReleaseOwner("tiers"))
        on_ssd = [p for p in reply.items if p.placed and p.tier == "ssd"]
        assert len(on_ssd) > 20, "1 MiB of memory holds at most 16 of them"
        assert all(p.segment_id.count("#") == 2 for p in on_ssd)  # each with its grant
        assert red.batch_get(list(values)) == list(values.values())
        assert [red.get(key) for key in values] == list(values.values())
        assert blue.batch_get(list(values)) == [None] * len(values)  # red's, not blue's
        # on the data port: the grant is for one key and one tenant
        p = on_ssd[0]
        host, port = split_address(p.data_address)
        _, grant, data_key = p.segment_id.split("#")
        red_data = Credential(tenant="red", data_key=bytes.fromhex(data_key))
        with SegmentConnection(
            host, port, PeerSettings(5, credential=red_data, client_id="red")
        ) as conn:
            buf = bytearray(p.size)
            ssd_read_into(conn, f"@red/{p.key}#{grant}", buf)
            assert bytes(buf) == values[p.key]
            other = next(q.key for q in on_ssd[1:])
            for key, why in (
                (f"@red/{other}#{grant}", "did not make"),  # another key, this grant
                (f"@red/{other}", "without a grant"),
                (f"@blue/{p.key}#{grant}", "did not make"),
            ):
                with pytest.raises(AuthError, match=why):
                    ssd_read_into(conn, key, bytearray(p.size))
