"""Two HA masters on a real etcd, a node, and clients in this process: the leader dies,
is frozen, or stops, and the pool goes on with everything the node holds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvpool import Client, NotLeader, StaleWrite, TransferError
from kvpool.client.leader_link import LeaderLink
from kvpool.config.masters import parse_masters
from kvpool.datapath.data_ops import DataOp, OpResult, WriteOp
from kvpool.datapath.transport import DataPath, transport_named
from kvpool.ha.campaign import ClusterKeys
from kvpool.ha.etcd import Etcd, parse_endpoints
from kvpool.protocol import messages as m
from kvpool.testing.etcd import EtcdCluster
from kvpool.testing.processes import PoolProcess, node_config, start_master, start_node
from kvpool.testing.slow_relay import SlowRelay
from tests.waiting import wait_until

TTL_S = 2


def ha_master(etcd: EtcdCluster, *flags: str) -> PoolProcess:
    return start_master(
        "--segment_size", "0", "--enable_ha", "--etcd_endpoints", etcd.endpoints,
        "--ha_lease_ttl", str(TTL_S), *flags,
    )  # fmt: skip


def who(address: str) -> m.LeaderInfo:
    with Client(address) as client:
        reply = client.link.call(m.WhoLeads())
    assert isinstance(reply, m.LeaderInfo)
    return reply


def leader_of(masters: list[PoolProcess]) -> tuple[PoolProcess, PoolProcess]:
    """(leader, standby), once one leads."""
    wait_until(lambda: any(who(p.address).role == "leader" for p in masters), 15)
    first, second = masters
    return (first, second) if who(first.address).role == "leader" else (second, first)


@pytest.fixture
def pool(etcd: EtcdCluster, tmp_path: Path) -> Iterator[tuple[list[PoolProcess], str]]:
    masters = [ha_master(etcd), ha_master(etcd)]
    spec = ",".join(p.address for p in masters)
    try:
        node = start_node(node_config(tmp_path, spec, "32MiB"))
    except RuntimeError as exc:  # what the masters said is what explains it
        for p in masters:
            p.stop()
        logs = "\n".join(f"master {p.address}:\n" + "\n".join(list(p.lines)[-20:]) for p in masters)
        raise RuntimeError(f"{exc}\n{logs}") from None
    try:
        # the node registered with the leader, and the leader recorded it in etcd
        keys = Etcd(parse_endpoints(etcd.endpoints))
        wait_until(lambda: keys.get_prefix(ClusterKeys("kvpool").prefix + "nodes/"), 15)
        yield masters, spec
    finally:
        node.stop()
        for p in masters:
            p.stop()


def test_one_leads_the_other_refuses_and_names_it(
    pool: tuple[list[PoolProcess], str],
) -> None:
    masters, _ = pool
    leader, standby = leader_of(masters)
    seen = who(standby.address)
    assert (seen.role, seen.leader) == ("standby", leader.address)
    assert seen.epoch == who(leader.address).epoch > 0
    with Client(standby.address) as direct, pytest.raises(NotLeader, match=leader.address):
        direct.exists("k")


def test_a_killed_leader_is_replaced_and_nothing_the_node_holds_is_lost(
    pool: tuple[list[PoolProcess], str],
) -> None:
    masters, spec = pool
    leader, standby = leader_of(masters)
    with Client(spec) as client:
        values = {f"k{i}": os.urandom(4096 + i) for i in range(40)}
        for key, value in values.items():
            client.put(key, value)
        before = who(leader.address).epoch
        leader.kill()  # SIGKILL: no resignation, the lease runs out
        client.put("after", b"x" * 100)  # waits for the standby to lead, then succeeds
        assert isinstance(client.link, LeaderLink) and client.link.failovers == 1
        now = who(standby.address)
        assert (now.role, now.leader) == ("leader", standby.address)
        assert now.epoch > before
        for key, value in values.items():
            assert client.get(key) == value  # re-announced by the node to the new leader
        assert client.get("after") == b"x" * 100


def test_a_stopped_leader_hands_over_at_once(pool: tuple[list[PoolProcess], str]) -> None:
    masters, spec = pool
    leader, standby = leader_of(masters)
    assert leader.stop() == 0
    started = time.monotonic()
    wait_until(lambda: who(standby.address).role == "leader", 10)
    # a resignation ends the lease: no wait for its TTL (the standby polls every 0.2 s)
    assert time.monotonic() - started < TTL_S
    with Client(spec) as client:
        client.put("k", b"v")
        assert client.get("k") == b"v"


def test_a_frozen_leader_wakes_up_refusing_and_leaves(
    pool: tuple[list[PoolProcess], str],
) -> None:
    """Split brain: a leader that cannot renew (here frozen by SIGSTOP, as a long GC
    pause or a partition would) is replaced; when it runs again it serves nothing and
    exits, and a client that has seen the new epoch never goes back to it."""
    masters, spec = pool
    old, new = leader_of(masters)
    old_epoch = who(old.address).epoch
    os.kill(old.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: who(new.address).role == "leader", 15)
        with Client(spec) as client:
            client.put("k", b"new")
            link = client.link
            assert isinstance(link, LeaderLink) and link.epoch > old_epoch
    finally:
        os.kill(old.pid, signal.SIGCONT)
    with Client(old.address) as direct, pytest.raises((NotLeader, TransferError)):
        # refused (its lease ended while it was frozen), or it has left already
        direct.put("k", b"old")
    assert old.proc.wait(15) == 3
    assert old.wait_for_line("stopped leading", 1)
    with Client(spec) as client:
        assert client.get("k") == b"new"


def test_a_link_never_uses_a_leader_older_than_one_it_has_seen(
    pool: tuple[list[PoolProcess], str],
) -> None:
    masters, spec = pool
    leader, _ = leader_of(masters)
    link = LeaderLink(parse_masters(spec, key="test"), failover_s=1.0)
    assert isinstance(link.call(m.Exists("k")), m.Bools)
    link.close()
    fenced = LeaderLink(parse_masters(spec, key="test"), failover_s=1.0)
    fenced.epoch = who(leader.address).epoch + 1  # as if a later leader had answered it
    with pytest.raises(TransferError, match="no master"):
        fenced.call(m.Exists("k"))
    fenced.close()


def test_masters_on_an_etcd_that_answers_slowly_elect_one_that_serves(
    etcd: EtcdCluster, tmp_path: Path
) -> None:
    # every etcd reply 300 ms late (a slow disk's fsync): a master is elected, keeps its
    # lease, and a node and a client work through it
    host, port = etcd.endpoints.split(",")[0].rsplit(":", 1)
    with SlowRelay((host, int(port)), 0.3) as relay:
        flags = ("--segment_size", "0", "--enable_ha", "--etcd_endpoints", relay.endpoint,
                 "--ha_lease_ttl", str(TTL_S))  # fmt: skip
        masters = [start_master(*flags), start_master(*flags)]
        try:
            leader, _ = leader_of(masters)
            epoch = who(leader.address).epoch
            spec = ",".join(p.address for p in masters)
            node = start_node(node_config(tmp_path, spec, "32MiB"))
            try:
                with Client(spec) as client:
                    client.put("k", b"v" * 1000)
                    assert client.get("k") == b"v" * 1000
                time.sleep(2 * TTL_S)  # two lease lengths: renewals kept up
                assert who(leader.address).role == "leader"
                assert who(leader.address).epoch == epoch
                assert all(p.proc.poll() is None for p in masters)
            finally:
                node.stop()
        finally:
            for p in masters:
                p.stop()


class AfterAWrite:
    """TCP, except that once a write has reached the node ``then`` runs (once): what
    happens between a put's start and its end, made certain."""

    def __init__(self, then: Callable[[], None]) -> None:
        self.then: Callable[[], None] | None = then
        self.inner = transport_named("tcp")

    def connect(self, address: str) -> DataPath:
        return _PathThen(self, self.inner.connect(address))


class _PathThen:
    def __init__(self, transport: AfterAWrite, path: DataPath) -> None:
        self.transport, self.path = transport, path

    def run(self, ops: Sequence[DataOp]) -> list[OpResult]:
        done = self.path.run(ops)
        if self.transport.then is not None and any(isinstance(op, WriteOp) for op in ops):
            then, self.transport.then = self.transport.then, None
            then()
        return done

    def close(self) -> None:
        self.path.close()


def kill_the_leader(masters: list[PoolProcess]) -> Callable[[], None]:
    """SIGKILL the leading master and wait until the other leads."""

    def kill() -> None:
        leader, standby = leader_of(masters)
        epoch = who(leader.address).epoch
        os.kill(leader.proc.pid, signal.SIGKILL)
        leader.proc.wait(10)
        wait_until(lambda: who(standby.address).epoch > epoch, 20, what="the other leads")

    return kill


@pytest.mark.parametrize("batch", [False, True], ids=["put", "batch_put"])
def test_a_put_whose_leader_died_between_its_start_and_end_is_put_again(
    pool: tuple[list[PoolProcess], str], batch: bool
) -> None:
    masters, spec = pool
    value = b"w" * 4096
    leader, _ = leader_of(masters)
    epoch = who(leader.address).epoch
    with Client(spec, transport=AfterAWrite(kill_the_leader(masters))) as client:
        if batch:
            assert client.batch_put(["a", "b"], [value, value]) == [None, None]
        else:
            client.put("a", value)  # no StaleWrite: a failover is a delay
        assert isinstance(client.link, LeaderLink)
        assert client.link.epoch > epoch  # it did span a failover
    with Client(spec) as reader:
        assert reader.get("a") == value
        if batch:
            assert reader.get("b") == value


def test_a_reservation_gone_under_the_same_leader_is_still_refused(
    pool: tuple[list[PoolProcess], str],
) -> None:
    _, spec = pool
    revoke: list[Callable[[], None]] = []
    with Client(spec, transport=AfterAWrite(lambda: revoke[0]())) as client:
        revoke.append(lambda: client.call(m.PutRevoke(client.client_id, "late")))
        with pytest.raises(StaleWrite):
            client.put("late", b"x" * 4096)
        assert not client.exists("late")
