"""kvpool's own engine across hosts: a master host, two storage-node hosts, a client host.

Every bound below is derived from the configured timeouts (``tests/multihost/pool.py``)
with room to spare (2-3x): they say "nothing waits past its timeout", never "fast".
Each scenario records its time to detect and to recover (docs/multihost.md has the table).
"""

from __future__ import annotations

import time
from typing import Any

from tests.multihost.client_side import Op
from tests.multihost.pool import CLIENT_TIMEOUT_S, CLIENT_TTL_S, HEARTBEAT_S, Cluster

SIZE = 64 << 10
#: no single operation may take longer than this (a dead peer is a timeout, not a hang)
OP_BOUND_S = 3 * CLIENT_TIMEOUT_S


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
