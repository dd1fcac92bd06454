"""kvpool's own engine across hosts: a master host, two storage-node hosts, a client host.

Every bound below is derived from the configured timeouts (``tests/multihost/pool.py``)
with room to spare (2-3x): they say "nothing waits past its timeout", never "fast".
Each scenario records its time to detect and to recover (docs/multihost.md has the table).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterable
from typing import Any

import pytest

from kvpool.testing.netns import netem_missing
from tests.multihost.client_side import Op
from tests.multihost.pool import (
    CLIENT_TIMEOUT_S,
    CLIENT_TTL_S,
    HEARTBEAT_S,
    NODE_TIMEOUT_MS,
    Cluster,
)

pytestmark = pytest.mark.slow

SIZE = 64 << 10
#: no single operation may take longer than this (a dead peer is a timeout, not a hang)
OP_BOUND_S = 3 * CLIENT_TIMEOUT_S
NODE_TIMEOUT_S = NODE_TIMEOUT_MS / 1000


def all_hit(cluster: Cluster, keys: Iterable[str], size: int) -> bool:
    """Every one of ``keys`` is read whole from the client host."""
    return all(cluster.on_client("get", k, size).outcome == "hit" for k in keys)  # type: ignore[attr-defined]


def _wait(what: str, cond: Any, timeout_s: float, cluster: Cluster) -> float:
    """Poll ``cond`` (bounded) until truthy; the monotonic time it first was."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}: not in {timeout_s} s\n{cluster.logs()}"
        time.sleep(0.1)
    return time.monotonic()


def _put_keys(cluster: Cluster, prefix: str, n: int) -> dict[str, list[str]]:
    """Put ``n`` keys; which node's data address holds each."""
    by_node: dict[str, list[str]] = {}
    for i in range(n):
        key = f"{prefix}-{i}"
        op: Op = cluster.on_client("put", key, SIZE)  # type: ignore[assignment]
        assert op.outcome == "ok", op
        holder = cluster.on_client("owner", key)
        by_node.setdefault(str(holder), []).append(key)
    return by_node


def _bounded(ops: list[Op]) -> None:
    slow = [op for op in ops if op.seconds > OP_BOUND_S]
    assert not slow, f"operations past {OP_BOUND_S} s: {slow[:5]}"
    assert not [op for op in ops if op.outcome == "wrong"], "a read returned wrong bytes"


@pytest.mark.timeout(45)
def test_puts_and_gets_cross_hosts(cluster: Cluster) -> None:
    by_node = _put_keys(cluster, "across", 16)
    assert set(by_node) == set(cluster.node_addresses.values()), by_node  # both nodes hold some
    for keys in by_node.values():
        for key in keys:
            op: Op = cluster.on_client("get", key, SIZE)  # type: ignore[assignment]
            assert op.outcome == "hit", op
    # a second client, its own connections, reads the same bytes
    other = cluster.new_client()
    for key in by_node[cluster.node_addresses["node1"]][:3]:
        op = cluster.agent.run("tests.multihost.client_side:get", other, key, SIZE)
        assert op.outcome == "hit", op


@pytest.mark.timeout(75)
def test_node_link_cut_mid_traffic_then_restored(cluster: Cluster, record: Any) -> None:
    topo, cut_address = cluster.topology, cluster.node_addresses["node1"]
    other_address = cluster.node_addresses["node2"]
    by_node = _put_keys(cluster, "cut", 16)
    cut_keys = by_node[cut_address]
    traffic = cluster.agent.new(
        "tests.multihost.client_side:Traffic",
        cluster.client,
        sorted(cluster_keys(by_node)),
        SIZE,
        0.05,
    )
    time.sleep(1.0)
    t_cut = time.monotonic()
    topo.cut("node1")

    # the master drops the node: at once when a client's transfer to it fails, at the
    # latest when client_ttl passes without a heartbeat
    prober = cluster.new_client()
    t_dropped = _wait(
        "the master drops node1",
        lambda: cut_address not in cluster.agent.run("tests.multihost.client_side:nodes", prober),
        2 * CLIENT_TTL_S + OP_BOUND_S,
        cluster,
    )
    assert t_dropped - t_cut <= 2 * CLIENT_TTL_S
    time.sleep(2.0)  # traffic goes on against node2 alone
    during: list[Op] = cluster.agent.call(traffic, "since", t_cut)
    _bounded(during)
    cut_reads = [op for op in during if op.op == "get" and op.key in cut_keys]
    assert cut_reads and all(op.outcome in ("miss", "hit") for op in cut_reads), cut_reads
    first_miss = min(op.started + op.seconds for op in cut_reads if op.outcome == "miss")
    assert first_miss - t_cut <= OP_BOUND_S
    later_puts = [op for op in during if op.op == "put" and op.started > t_dropped]
    assert later_puts and all(op.outcome == "ok" for op in later_puts), later_puts
    for op in later_puts[:10]:
        assert cluster.on_client("owner", op.key) == other_address
    for key in by_node[other_address]:  # the other node's objects never stopped
        assert cluster.on_client("get", key, SIZE).outcome == "hit"  # type: ignore[attr-defined]

    t_restore = time.monotonic()
    topo.restore("node1")
    # it re-registers (the master answers its heartbeat "unknown"), re-announces what it
    # holds, and its old objects are read again, bytes equal
    reregister_bound = 3 * (NODE_TIMEOUT_S + HEARTBEAT_S)
    t_back = _wait(
        "node1 registers again",
        lambda: cut_address in cluster.agent.run("tests.multihost.client_side:nodes", prober),
        reregister_bound,
        cluster,
    )
    t_served = _wait(
        "node1's objects are read again",
        lambda: all_hit(cluster, cut_keys, SIZE),
        reregister_bound,
        cluster,
    )
    cluster.nodes["node1"].wait_for(r"registering again|re-announced", 1)
    ops: list[Op] = cluster.agent.call(traffic, "stop")
    _bounded(ops)
    record(
        "node link cut",
        read_miss_after_cut_s=round(first_miss - t_cut, 2),
        master_dropped_node_after_s=round(t_dropped - t_cut, 2),
        reregistered_after_restore_s=round(t_back - t_restore, 2),
        objects_served_again_after_restore_s=round(t_served - t_restore, 2),
        slowest_op_s=round(max(op.seconds for op in ops), 2),
        ops=len(ops),
    )


def cluster_keys(by_node: dict[str, list[str]]) -> list[str]:
    return [key for keys in by_node.values() for key in keys]


@pytest.mark.timeout(60)
def test_idle_node_cut_is_dropped_after_client_ttl(cluster: Cluster, record: Any) -> None:
    """With no client touching it, only the heartbeats tell: the master drops a silent
    node once ``client_ttl`` passed, not before."""
    cut_address = cluster.node_addresses["node1"]
    t_cut = time.monotonic()
    cluster.topology.cut("node1")
    t_dropped = _wait(
        "the master drops node1",
        lambda: cut_address not in cluster.on_client("nodes"),  # type: ignore[operator]
        2 * CLIENT_TTL_S,
        cluster,
    )
    # its last heartbeat may have come up to one interval before the cut
    assert t_dropped - t_cut >= CLIENT_TTL_S - HEARTBEAT_S - 0.5
    t_restore = time.monotonic()
    cluster.topology.restore("node1")
    t_back = _wait(
        "node1 registers again",
        lambda: cut_address in cluster.on_client("nodes"),  # type: ignore[operator]
        3 * (NODE_TIMEOUT_S + HEARTBEAT_S),
        cluster,
    )
    record(
        "idle node cut (heartbeats only)",
        master_dropped_node_after_s=round(t_dropped - t_cut, 2),
        reregistered_after_restore_s=round(t_back - t_restore, 2),
    )


@pytest.mark.timeout(75)
def test_master_host_cut_off_then_restored(cluster: Cluster, record: Any) -> None:
    """Clients fail fast while the master is unreachable (every call ends within its
    timeout), the nodes outlive the master's view of them, and the pool comes back."""
    keys = cluster_keys(_put_keys(cluster, "mcut", 8))
    traffic = cluster.agent.new(
        "tests.multihost.client_side:Traffic", cluster.client, keys, SIZE, 0.05
    )
    time.sleep(1.0)
    cluster.topology.cut("master")
    t_cut = time.monotonic()  # after the cut is in place: a call just before it may succeed
    # long enough for the master to expire both nodes (it hears no heartbeat)
    time.sleep(CLIENT_TTL_S + 2 * HEARTBEAT_S)
    # at least two calls made entirely while cut (each ends within its bound, so on a slow
    # host this waits at most two bounds more for the second)
    _wait(
        "two client calls made while the master is cut off",
        lambda: len(cluster.agent.call(traffic, "since", t_cut)) >= 2,
        2 * OP_BOUND_S,
        cluster,
    )
    during: list[Op] = cluster.agent.call(traffic, "since", t_cut)
    _bounded(during)
    assert all(op.outcome.startswith("error:") for op in during), during
    first_failure = min(op.started + op.seconds for op in during)
    assert first_failure - t_cut <= OP_BOUND_S

    t_restore = time.monotonic()
    cluster.topology.restore("master")
    bound = 3 * (CLIENT_TIMEOUT_S + NODE_TIMEOUT_S + HEARTBEAT_S)
    t_first_ok = _wait(
        "a client call succeeds again",
        lambda: cluster.on_client("put", f"after-{time.monotonic()}", SIZE).outcome == "ok",  # type: ignore[attr-defined]
        bound,
        cluster,
    )
    t_served = _wait(
        "the objects put before the cut are read again",
        lambda: all_hit(cluster, keys, SIZE),
        bound,
        cluster,
    )
    for node in cluster.nodes.values():  # the master forgot them: they registered again
        node.wait_for(r"registering again", 1)
    ops: list[Op] = cluster.agent.call(traffic, "stop")
    _bounded(ops)
    record(
        "master host cut",
        first_client_failure_after_cut_s=round(first_failure - t_cut, 2),
        client_calls_work_after_restore_s=round(t_first_ok - t_restore, 2),
        old_objects_read_after_restore_s=round(t_served - t_restore, 2),
        slowest_op_s=round(max(op.seconds for op in ops), 2),
        failed_ops_during_cut=sum(op.outcome.startswith("error:") for op in ops),
    )


# ------------------------------------------------------------------ a degraded link
BIG = 256 << 10  # several round trips' worth of packets per object


def _slower_never_wrong(cluster: Cluster, degrade: Any, record: Any, scenario: str) -> None:
    """Reads and puts through a degraded link to node1: every read is the right bytes or
    a miss, every operation ends within its bound, and the link healed, node1 serves."""
    by_node = _put_keys_sized(cluster, "slow", 12, BIG)
    slow_keys = set(by_node[cluster.node_addresses["node1"]])
    keys = cluster_keys(by_node)
    before = [cluster.on_client("get", k, BIG) for k in keys]
    degrade()
    t0 = time.monotonic()
    during: list[Op] = []
    while time.monotonic() - t0 < 8.0 and len(during) < 400:  # bounded in time and count
        for key in keys:
            during.append(cluster.on_client("get", key, BIG))  # type: ignore[arg-type]
        during.append(cluster.on_client("put", f"slow-new-{len(during)}", BIG))  # type: ignore[arg-type]
    _bounded(during)
    reads = [op for op in during if op.op == "get"]
    assert all(op.outcome in ("hit", "miss") for op in reads), {op.outcome for op in reads}
    assert any(op.outcome == "hit" for op in reads)
    t_heal = time.monotonic()
    cluster.topology.unimpair("node1")
    t_served = _wait(
        "node1's objects are read again",
        lambda: all_hit(cluster, slow_keys, BIG),
        3 * (NODE_TIMEOUT_S + HEARTBEAT_S),
        cluster,
    )

    def median(ops: list[Any]) -> float:
        times = sorted(op.seconds for op in ops) or [0.0]
        return round(times[len(times) // 2], 3)

    record(
        scenario,
        read_median_before_s=median([op for op in before if op.key in slow_keys]),
        read_median_degraded_s=median([op for op in reads if op.key in slow_keys]),
        read_median_other_node_s=median([op for op in reads if op.key not in slow_keys]),
        degraded_reads_hit=sum(op.outcome == "hit" for op in reads if op.key in slow_keys),
        degraded_reads_miss=sum(op.outcome == "miss" for op in reads if op.key in slow_keys),
        puts_failed=sum(op.op == "put" and op.outcome != "ok" for op in during),
        served_again_after_heal_s=round(t_served - t_heal, 2),
    )


def _put_keys_sized(cluster: Cluster, prefix: str, n: int, size: int) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {}
    for i in range(n):
        key = f"{prefix}-{i}"
        op: Op = cluster.on_client("put", key, size)  # type: ignore[assignment]
        assert op.outcome == "ok", op
        by_node.setdefault(str(cluster.on_client("owner", key)), []).append(key)
    return by_node


@pytest.mark.timeout(75)
def test_throttled_link_is_slower_never_wrong(cluster: Cluster, record: Any) -> None:
    """node1's link shaped to 4 Mbit/s with a 16 KiB queue (``tc tbf``): a 256 KiB read
    queues, and packets beyond the queue are dropped and sent again."""
    _slower_never_wrong(
        cluster,
        lambda: cluster.topology.throttle("node1", rate_kbit=4000, queue_bytes=16 << 10),
        record,
        "throttled link (tbf 4 Mbit/s, 16 KiB queue)",
    )


@pytest.fixture
def netem() -> None:
    """``tc netem`` is the kernel's: where it is missing the scenario is not run, and
    says so (a failure when KVPOOL_REQUIRE_NETEM=1, as on a CI kernel that has it)."""
    missing = netem_missing()
    if missing and os.environ.get("KVPOOL_REQUIRE_NETEM") == "1":
        pytest.fail(f"KVPOOL_REQUIRE_NETEM=1 but {missing}")
    if missing:
        pytest.skip(f"NOT RUN: {missing} (the tbf scenario still runs)")


@pytest.mark.timeout(75)
def test_lossy_delayed_link_is_slower_never_wrong(
    netem: None, cluster: Cluster, record: Any
) -> None:
    """node1's link loses 5 % of packets and delays each by 20 ms (``tc netem``)."""
    _slower_never_wrong(
        cluster,
        lambda: cluster.topology.impair("node1", delay_ms=20, loss_pct=5),
        record,
        "lossy link (netem 20 ms, 5 % loss)",
    )


@pytest.mark.timeout(90)
def test_client_partitioned_from_one_node(cluster: Cluster, record: Any) -> None:
    """An asymmetric partition: the client cannot reach node1, the master still can (its
    heartbeats go on).  Reads of node1's objects are misses within the timeout, never
    wrong bytes; the client's reports make the master drop node1, which registers again
    at its next heartbeat -- so puts may keep meeting it, each failure bounded -- and once
    the partition heals, node1's objects are read again."""
    topo, cut_address = cluster.topology, cluster.node_addresses["node1"]
    by_node = _put_keys(cluster, "part", 12)
    cut_keys = by_node[cut_address]
    traffic = cluster.agent.new(
        "tests.multihost.client_side:Traffic", cluster.client, cluster_keys(by_node), SIZE, 0.05
    )
    time.sleep(1.0)
    topo.partition("client", "node1")
    t_cut = time.monotonic()  # after both routes are in place
    time.sleep(3 * OP_BOUND_S)
    during: list[Op] = cluster.agent.call(traffic, "since", t_cut)
    _bounded(during)
    cut_reads = [op for op in during if op.op == "get" and op.key in cut_keys]
    first_miss = min(op.started + op.seconds for op in cut_reads if op.outcome == "miss")
    assert first_miss - t_cut <= OP_BOUND_S
    other_reads = [op for op in during if op.op == "get" and op.key not in cut_keys]
    assert other_reads and all(op.outcome == "hit" for op in other_reads[-5:]), other_reads
    puts = [op for op in during if op.op == "put"]
    assert sum(op.outcome == "ok" for op in puts) >= len(puts) // 2, puts  # most go to node2
    t_heal = time.monotonic()
    topo.heal("client", "node1")
    t_served = _wait(
        "node1's objects are read again",
        lambda: all_hit(cluster, cut_keys, SIZE),
        # node1 may have been dropped on the client's reports just before the heal: a
        # heartbeat to register again, one to re-announce, and reads that may still each
        # wait out a timeout until then
        3 * (NODE_TIMEOUT_S + 2 * HEARTBEAT_S) + CLIENT_TIMEOUT_S * len(cut_keys),
        cluster,
    )
    ops: list[Op] = cluster.agent.call(traffic, "stop")
    _bounded(ops)
    record(
        "client partitioned from one node (master reaches it)",
        read_miss_after_partition_s=round(first_miss - t_cut, 2),
        puts_ok_during=sum(op.outcome == "ok" for op in puts),
        puts_failed_during=sum(op.outcome != "ok" for op in puts),
        reads_missed_during=sum(op.outcome == "miss" for op in cut_reads),
        objects_served_again_after_heal_s=round(t_served - t_heal, 2),
        slowest_op_s=round(max(op.seconds for op in ops), 2),
    )


@pytest.mark.timeout(45)
def test_every_port_refuses_a_host_without_the_secret(cluster: Cluster) -> None:
    """From another host, no credential and a wrong secret get a refusal on the master's
    RPC and HTTP ports and on each node's data port; the secret's holder is served."""
    ports = list(cluster.node_addresses.values())
    wrong = secrets.token_hex(32)
    for credential in (None, wrong):
        outcomes = cluster.agent.run(
            "tests.multihost.client_side:refusals", cluster.master_address, ports, credential
        )
        assert len(outcomes) == 3 + len(ports), outcomes  # type: ignore[arg-type]
        assert set(outcomes.values()) == {"refused"}, (credential is None, outcomes)  # type: ignore[union-attr]
    op: Op = cluster.on_client("put", "after-refusals", SIZE)  # type: ignore[assignment]
    assert op.outcome == "ok", op
    op = cluster.on_client("get", "after-refusals", SIZE)  # type: ignore[assignment]
    assert op.outcome == "hit", op
