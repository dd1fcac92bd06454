"""Replicas across hosts: objects put in two copies (one per node host) under load from
three client processes, then one node SIGKILLed.  Every acknowledged put is read back,
bytes equal; in one copy, the same kill loses the dead node's objects (the baseline)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvpool.testing.agent import Agent, Ref
from kvpool.testing.netns import Topology
from tests.multihost.client_side import Op
from tests.multihost.pool import CLIENT_TIMEOUT_S, REPO, Cluster, cluster_env, start_cluster

SIZE = 64 << 10


def _client(cluster: Cluster, agent: Agent, copies: int) -> Ref:
    return agent.new(
        "tests.multihost.client_side:open_client", cluster.master_address, CLIENT_TIMEOUT_S, copies
    )


def _run(topology: Topology, tmp_path: Path, copies: int) -> dict[str, Any]:
    """Seed, load from three processes, SIGKILL node1, read every acknowledged put."""
    cluster = start_cluster(topology, tmp_path)
    env = {"PYTHONPATH": str(REPO), **cluster_env(tmp_path)}
    seeder = topology.agent("client", env=env)
    agents = [seeder]
    try:
        client = _client(cluster, seeder, copies)
        keys = [f"seed-{i}" for i in range(32)]
        for key in keys:
            assert seeder.run("tests.multihost.client_side:put", client, key, SIZE).outcome == "ok"
        on_node1 = [
            k
            for k in keys
            if seeder.run("tests.multihost.client_side:owner", client, k)
            == cluster.node_addresses["node1"]
        ]
        loads = []
        for i in range(3):
            agent = topology.agent("client", env=env)
            agents.append(agent)
            traffic = agent.new(
                "tests.multihost.client_side:Traffic",
                _client(cluster, agent, copies), keys, SIZE, 0.02, 2000, f"p{i}",
            )  # fmt: skip
            loads.append((agent, traffic))
        time.sleep(1.0)
        t_kill = time.monotonic()
        cluster.nodes["node1"].proc.kill()
        cluster.nodes["node1"].proc.wait(10)
        time.sleep(3.0)
        ops: list[Op] = [op for agent, ref in loads for op in agent.call(ref, "stop")]
        acked = sorted({*keys, *(op.key for op in ops if op.op == "put" and op.outcome == "ok")})
        outcomes = [
            seeder.run("tests.multihost.client_side:get", client, k, SIZE).outcome for k in acked
        ]
        after = [op for op in ops if op.started >= t_kill]
        return {
            "seeded_on_killed_node": len(on_node1),
            "acked_puts": len(acked),
            "acked_lost": sum(o == "miss" for o in outcomes),
            "wrong_bytes_reads": sum(o == "wrong" for o in outcomes)
            + sum(op.outcome == "wrong" for op in ops),
            "errors_after_kill": sum(op.outcome.startswith("error") for op in after),
            "misses_after_kill": sum(op.outcome == "miss" for op in after),
            "slowest_op_s": round(max(op.seconds for op in ops), 2),
        }
    finally:
        for agent in agents:
            agent.close()


@pytest.mark.timeout(150)
def test_a_node_killed_under_load_loses_no_put_made_in_two_copies(
    topology: Topology, tmp_path: Path, record: Any
) -> None:
    result = _run(topology, tmp_path, copies=2)
    record("replicas: node SIGKILLed, 2 copies, 3 clients", **result)
    assert result["seeded_on_killed_node"] > 0  # reads of those had to fall back
    assert result["acked_lost"] == 0 and result["wrong_bytes_reads"] == 0, result
    assert result["misses_after_kill"] == 0, result  # a read falls back, never misses


@pytest.mark.timeout(150)
def test_the_same_kill_in_one_copy_loses_the_dead_nodes_objects(
    topology: Topology, tmp_path: Path, record: Any
) -> None:
    result = _run(topology, tmp_path, copies=1)
    record("replicas: node SIGKILLed, 1 copy (baseline), 3 clients", **result)
    assert result["wrong_bytes_reads"] == 0, result
    assert result["acked_lost"] >= result["seeded_on_killed_node"] > 0, result
