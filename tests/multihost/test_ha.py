"""HA masters across hosts, deployed as docs/ha.md says: etcd on one host, a master on
each of two more, a node and clients elsewhere.  The leader is killed under load from
three client processes, or its link is cut; an etcd member of three is lost.  Measured:
the time without a leader, acknowledged puts lost, wrong bytes."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvpool.testing.agent import Agent, Ref
from kvpool.testing.etcd import EtcdMember
from kvpool.testing.netns import Topology
from tests.docs.blocks import doc_block
from tests.multihost.client_side import Op
from tests.multihost.pool import REPO, HostProcess, cluster_env, start_kvpool

HOSTS = ["etcd", "m1", "m2", "node1", "client"]
SIZE = 8192
CLIENT_TIMEOUT_S = 2.0
FAILOVER_BOUND_S = 20.0  # a client call's own bound across a failover (LeaderLink)
_COUNT = iter(range(1000))


@pytest.fixture
def topology(netns_prefix: str) -> Iterator[Topology]:
    with Topology(HOSTS, prefix=f"{netns_prefix}ha{next(_COUNT)}-") as topo:
        yield topo


@dataclass
class Pair:
    topology: Topology
    log_dir: Path
    masters: dict[str, HostProcess]  # host -> its master
    node: HostProcess
    agents: list[Agent] = field(default_factory=list)

    @property
    def values(self) -> dict[str, str]:
        """docs/ha.md's example values -> this run's."""
        t = self.topology
        return {
            "10.0.0.5": t.address("etcd"), "10.0.0.1": t.address("m1"),
            "10.0.0.2": t.address("m2"), "10.0.0.9": t.address("node1"),
            "/var/lib/kvpool-etcd": str(self.log_dir / "etcd-data"), "4GB": "64MiB",
        }  # fmt: skip

    @property
    def spec(self) -> str:
        t = self.topology
        return f"{t.address('m1')}:50088,{t.address('m2')}:50088"

    def client(self, agent: Agent) -> Ref:
        return agent.new("tests.multihost.client_side:open_client", self.spec, CLIENT_TIMEOUT_S)

    def leader(self) -> str:
        """The host whose master leads now (asked over its status port, from the client)."""
        out = subprocess.run(
            self.topology.command(
                "client", sys.executable, "-m", "kvpool", "status", "--master", self.spec, "--json"
            ),
            capture_output=True, text=True, timeout=30, cwd=REPO,
            env={**os.environ, **cluster_env(self.log_dir)},
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        leader = json.loads(out.stdout)["leadership"]["leader"]
        return next(h for h in ("m1", "m2") if leader.startswith(self.topology.address(h) + ":"))

    def logs(self) -> str:
        procs = [*self.masters.values(), self.node]
        return "\n".join(f"--- {p.host}\n{p.log()[-3000:]}" for p in procs)


def start_pair(topology: Topology, log_dir: Path, *, etcd: bool = True) -> Pair:
    """docs/ha.md's commands on their hosts: etcd, both masters, the node's config."""
    pair = Pair(topology, log_dir, {}, node=None)  # type: ignore[arg-type]
    if etcd:
        (command,) = doc_block("ha.etcd").commands(pair.values)
        with open(log_dir / "etcd.log", "ab") as log:
            topology.popen("etcd", shlex.split(command), stdout=log, stderr=subprocess.STDOUT)
    commands = doc_block("ha.masters").commands(pair.values)
    for host, command in zip(("m1", "m2"), commands, strict=True):
        argv = shlex.split(command)
        assert argv[0] == "kvpool"
        pair.masters[host] = start_kvpool(topology, host, argv[1:], log_dir)
    config = log_dir / "node1.json"
    config.write_text(doc_block("ha.node").text_for(pair.values))
    pair.node = start_kvpool(topology, "node1", ["node", "--config", str(config)], log_dir)
    for proc in pair.masters.values():  # one leads, and the node has registered with it
        proc.wait_for(r"leading epoch|campaigning", 30)
    deadline = time.monotonic() + 30
    while not any("registered (data" in p.log() for p in pair.masters.values()):
        assert time.monotonic() < deadline, pair.logs()
        time.sleep(0.1)
    return pair


def _traffic(pair: Pair, n: int, keys: list[str]) -> list[tuple[Agent, Ref]]:
    env = {"PYTHONPATH": str(REPO), **cluster_env(pair.log_dir)}
    out = []
    for i in range(n):
        agent = pair.topology.agent("client", env=env)
        pair.agents.append(agent)
        client = pair.client(agent)
        traffic = agent.new(
            "tests.multihost.client_side:Traffic", client, keys, SIZE, 0.02, 2000, f"p{i}"
        )
        out.append((agent, traffic))
    return out


def _seed(pair: Pair, n: int = 24) -> tuple[Agent, list[str]]:
    """A client process on the client host, and ``n`` keys it put."""
    agent = pair.topology.agent(
        "client", env={"PYTHONPATH": str(REPO), **cluster_env(pair.log_dir)}
    )
    pair.agents.append(agent)
    client = pair.client(agent)
    keys = [f"seed-{i}" for i in range(n)]
    for key in keys:
        assert agent.run("tests.multihost.client_side:put", client, key, SIZE).outcome == "ok"
    return agent, keys


def _check_after(pair: Pair, ops: list[Op], agent: Agent) -> dict[str, int]:
    """Every acknowledged put read back through the new leader: lost and wrong counts."""
    client = pair.client(agent)
    acked = sorted({op.key for op in ops if op.op == "put" and op.outcome == "ok"})
    outcomes = [
        agent.run("tests.multihost.client_side:get", client, k, SIZE).outcome for k in acked
    ]
    return {
        "acked_puts": len(acked),
        "acked_lost": sum(o == "miss" for o in outcomes),
        "wrong_bytes_reads": sum(o == "wrong" for o in outcomes)
        + sum(op.outcome == "wrong" for op in ops),
        "other": sum(o not in ("hit", "miss", "wrong") for o in outcomes),
    }


def _unavailable(ops: list[Op], t_fault: float) -> float:
    """From the fault to the first operation that succeeded and started after it."""
    after = [
        op.started + op.seconds
        for op in ops
        if op.started >= t_fault and op.outcome in ("ok", "hit")
    ]
    assert after, "no operation succeeded after the fault"
    return min(after) - t_fault


@pytest.mark.timeout(120)
def test_the_leader_killed_under_load_from_three_clients(
    topology: Topology, tmp_path: Path, record: Any
) -> None:
    pair = start_pair(topology, tmp_path)
    seed_agent, keys = _seed(pair)
    # the docs' status command, on the client host, names the leader
    (status,) = doc_block("ha.status").commands(pair.values)
    shown = subprocess.run(
        topology.command("client", sys.executable, "-m", *shlex.split(status)),
        capture_output=True, text=True, timeout=30, cwd=REPO,
        env={**os.environ, **cluster_env(tmp_path), "COLUMNS": "200"},
    )  # fmt: skip
    old = pair.leader()
    assert shown.returncode == 0 and "leader  epoch" in shown.stdout, shown.stdout + shown.stderr
    (doctor,) = doc_block("ha.doctor").commands(pair.values)
    checked = subprocess.run(
        topology.command("client", sys.executable, "-m", *shlex.split(doctor), "--json"),
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**os.environ, **cluster_env(tmp_path)},
    )  # fmt: skip
    report = {c["name"]: c for c in json.loads(checked.stdout)["checks"]}
    leads = report["master.leader"]
    assert leads["status"] == "PASS", leads
    other = next(h for h in ("m1", "m2") if h != old)
    assert leads["message"].startswith(topology.address(old) + ":"), leads
    assert topology.address(other) in leads["message"]  # the standby
    assert report["master.reachable"]["status"] == "PASS"
    loads = _traffic(pair, 3, keys)
    time.sleep(1.0)
    t_kill = time.monotonic()
    pair.masters[old].proc.kill()
    time.sleep(6.0)  # the lease runs out (3 s), the other leads, the node re-announces
    ops = [op for agent, ref in loads for op in agent.call(ref, "stop")]
    new = pair.leader()
    assert new != old
    result = _check_after(pair, ops, seed_agent)
    failed = [op for op in ops if op.outcome.startswith("error")]
    assert result["acked_lost"] == 0 and result["wrong_bytes_reads"] == 0, result
    assert not failed, failed[:5]  # a failover is a delay to a client, not an error
    assert max(op.seconds for op in ops) < FAILOVER_BOUND_S
    record(
        "HA: leader SIGKILLed, 3 clients",
        no_leader_s=round(_unavailable(ops, t_kill), 2),
        slowest_op_s=round(max(op.seconds for op in ops), 2),
        ops=len(ops),
        **result,
    )


@pytest.mark.timeout(120)
def test_a_leader_cut_off_steps_down_and_the_other_takes_over(
    topology: Topology, tmp_path: Path, record: Any
) -> None:
    pair = start_pair(topology, tmp_path)
    agent, keys = _seed(pair)
    ((loader, traffic),) = _traffic(pair, 1, keys)
    time.sleep(1.0)
    old = pair.leader()
    t_cut = time.monotonic()
    topology.cut(old)  # its cable: etcd, the node and the clients are all out of reach
    # it cannot renew, so it stops leading before its lease could end, and leaves
    assert pair.masters[old].proc.wait(15) == 3
    t_down = time.monotonic()
    pair.masters[old].wait_for("stopped leading", 1)
    time.sleep(4.0)
    ops: list[Op] = loader.call(traffic, "stop")
    assert pair.leader() != old
    topology.restore(old)
    result = _check_after(pair, ops, agent)
    assert result["acked_lost"] == 0 and result["wrong_bytes_reads"] == 0, result
    assert not [op for op in ops if op.outcome.startswith("error")]
    record(
        "HA: leader's link cut",
        stepped_down_after_s=round(t_down - t_cut, 2),
        no_leader_s=round(_unavailable(ops, t_cut), 2),
        ops=len(ops),
        **result,
    )


@pytest.mark.timeout(120)
def test_losing_one_etcd_member_of_three_changes_nothing(
    topology: Topology, tmp_path: Path, record: Any
) -> None:
    etcd_host = topology.address("etcd")
    ports = [(2379 + 10 * i, 2380 + 10 * i) for i in range(3)]
    initial = ",".join(f"e{i}=http://{etcd_host}:{p}" for i, (_, p) in enumerate(ports))
    members = [
        EtcdMember(
            f"e{i}", tmp_path / f"e{i}", host=etcd_host, client_port=c, peer_port=p,
            initial_cluster=initial, prefix=topology.command("etcd"),
        ).start()
        for i, (c, p) in enumerate(ports)
    ]  # fmt: skip
    try:
        endpoints = ",".join(m.endpoint for m in members)
        masters = {}
        for host in ("m1", "m2"):
            masters[host] = start_kvpool(
                topology, host,
                ["master", "--host", topology.address(host), "--segment_size", "0",
                 "--enable_ha", "--etcd_endpoints", endpoints],
                tmp_path,
            )  # fmt: skip
        pair = start_pair_with(topology, tmp_path, masters)
        agent, keys = _seed(pair)
        ((loader, traffic),) = _traffic(pair, 1, keys)
        time.sleep(1.0)
        before = pair.leader()
        t_lost = time.monotonic()
        members[0].kill()  # the first endpoint every master and client tries
        time.sleep(5.0)
        ops: list[Op] = loader.call(traffic, "stop")
        assert pair.leader() == before  # the same leader: its lease lived on the others
        assert all(p.proc.poll() is None for p in masters.values())
        result = _check_after(pair, ops, agent)
        assert result["acked_lost"] == 0 and result["wrong_bytes_reads"] == 0, result
        assert not [op for op in ops if op.outcome.startswith("error")]
        record(
            "HA: one etcd member of three lost",
            slowest_op_after_s=round(
                max((op.seconds for op in ops if op.started >= t_lost), default=0), 2
            ),
            ops=len(ops),
            **result,
        )
    finally:
        for member in members:
            member.close()


def start_pair_with(topology: Topology, log_dir: Path, masters: dict[str, HostProcess]) -> Pair:
    """A node (docs/ha.md's config) on masters started elsewhere."""
    pair = Pair(topology, log_dir, masters, node=None)  # type: ignore[arg-type]
    config = log_dir / "node1.json"
    config.write_text(doc_block("ha.node").text_for(pair.values))
    pair.node = start_kvpool(topology, "node1", ["node", "--config", str(config)], log_dir)
    deadline = time.monotonic() + 30
    while not any("registered (data" in p.log() for p in masters.values()):
        assert time.monotonic() < deadline, pair.logs()
        time.sleep(0.1)
    return pair
