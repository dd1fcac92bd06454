"""Mooncake's own HA under kvpool's tools: two ``mooncake_master --enable_ha`` on one etcd,
the store connector's Mooncake pool following the leader through ``etcd://``, the leader
SIGKILLed.

Everything runs in a private network namespace (kvpool.testing.mooncake): etcd on its
127.0.0.1, both masters, the engine, and ``kvpool status`` / ``kvpool doctor`` as an
operator there would run them (the commands of docs/ha.md's "Mooncake's own HA").  What
Mooncake loses is asserted, not hidden: with its op-log off (the default) the new leader
starts with no metadata, so an object put before the failover is a miss afterwards —
never wrong bytes — and the client puts and reads again once it re-mounted its segment.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpool.config.node import node_engine
from kvpool.engines.base import MISS
from kvpool.errors import ConfigError
from kvpool.mooncake.doctor import leadership_finding
from kvpool.mooncake.ha import (
    MasterHealth,
    MooncakeHA,
    ask_master,
    cluster_id,
    describe,
    master_view_key,
    read_master_view,
)
from kvpool.mooncake.settings import parse_mooncake_config
from kvpool.ops.doctor import DoctorOptions
from kvpool.testing.mooncake import Namespace
from tests.docs.blocks import doc_block
from tests.mooncake.host import NamespacedEngine, mooncake_json
from tests.waiting import wait_until

SEGMENT = 32 << 20
OBJECT = 1 << 20
A, B = "127.0.0.1:50051", "127.0.0.1:50052"  # the masters' RPC addresses
A_METRICS, B_METRICS = "127.0.0.1:9003", "127.0.0.1:9004"
FAILOVER_BOUND_S = 40.0  # Mooncake: lease TTL 5 s + the new leader's warmup 5 s, and slack


# ------------------------------------------------------------------------- pure parts
def test_a_mooncake_config_takes_mooncakes_ha_master_address() -> None:
    data = mooncake_json("etcd://10.0.0.5:2379;10.0.0.6:2379", 0)
    assert node_engine(data) == "mooncake"
    # handed to Mooncake's client unchanged: it reads the leader from etcd and follows it
    assert parse_mooncake_config(data).master_server_address == data["master_server_address"]
    with pytest.raises(ConfigError, match="MC_STORE_CLUSTER_ID"):
        parse_mooncake_config({**data, "master_server_address": "etcd://10.0.0.5:2379/c1"})
    with pytest.raises(ConfigError, match="enable_ha"):
        parse_mooncake_config({**data, "master_server_address": "redis://10.0.0.5:6379"})
    with pytest.raises(ConfigError, match="not host:port"):
        parse_mooncake_config({**data, "master_server_address": "etcd://10.0.0.5"})


def test_the_leader_line_says_when_mooncake_does_not_know_its_standbys() -> None:
    from_etcd = MooncakeHA("etcd://e:2379", A, 7, "serving", standbys_known=False)
    assert describe(from_etcd).startswith(f"{A} leads (Mooncake view 7, serving)")
    assert "Mooncake keeps only its leader in etcd" in describe(from_etcd)
    named = MooncakeHA("m", B, 9, "serving", standbys=(A_METRICS,), down=("x:9005",))
    assert f"standbys: {A_METRICS}; not answering: x:9005" in describe(named)
    assert master_view_key("mooncake_cluster") == "mooncake-store/mooncake_cluster/master_view"
    # doctor: a leader still in its warmup does not serve yet
    assert leadership_finding(named).status == "PASS"
    warming = leadership_finding(MooncakeHA("m", B, 9, "leader_warmup"))
    assert warming.status == "WARN" and "one lease TTL" in warming.message


# ---------------------------------------------------------------------- in the namespace
def leader_now(etcd: str) -> tuple[str, int, bool] | None:
    """(leader's RPC address, view version, serving) from etcd and the leader's /health."""
    view = read_master_view([etcd], cluster_id({}), 1.0)
    if view is None:
        return None
    metrics = {A: A_METRICS, B: B_METRICS}[view.leader]
    return view.leader, view.view_version, ask_master(metrics, 1.0).service_ready


# --------------------------------------------------------------------------- the pool
@dataclass
class Pool:
    ns: Namespace
    etcd: str  # host:port
    masters: dict[str, subprocess.Popen[bytes]]  # RPC address -> its mooncake_master
    engine: NamespacedEngine
    lookups: NamespacedEngine  # the store connector's scheduler half: no segment of its own
    log_dir: Path

    def kvpool(self, *argv: str) -> tuple[int, str, str]:
        done = self.ns.run(
            "subprocess:run",
            [sys.executable, "-m", "kvpool", *argv],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "COLUMNS": "250"},
        )
        return done.returncode, done.stdout, done.stderr

    def status_json(self, master: str) -> dict:
        rc, out, err = self.kvpool("status", "--master", master, "--json")
        assert rc == 0, err
        return json.loads(out)

    def doctor(self, master: str) -> dict:
        checks = self.ns.run(
            "kvpool.ops.doctor:run_doctor", DoctorOptions(master=master, probe_keys=False)
        )
        return {c.name: c for c in checks}

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


def _health(ns: Namespace, metrics: str) -> MasterHealth:
    return ns.run("kvpool.mooncake.ha:ask_master", metrics, 1.0)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    """docs/ha.md's commands in the namespace: etcd, master A (leading and serving before
    B starts, so which one leads is known), master B (standby); and kvpool's Mooncake
    engine with docs/ha.md's mooncake.json, whose master address is ``etcd://``."""
    log_dir = tmp_path_factory.mktemp("mooncake-ha")
    etcd_cmd, *master_cmds = doc_block("ha.mooncake-up").commands(
        {"/tmp/mooncake-etcd": str(log_dir / "etcd-data")}
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with Namespace() as ns:

        def start(command: str, name: str) -> subprocess.Popen[bytes]:
            with open(log_dir / f"{name}.log", "ab") as log:
                return ns.popen(shlex.split(command), stdout=log, stderr=subprocess.STDOUT, env=env)

        start(etcd_cmd, "etcd")
        etcd = "127.0.0.1:2379"
        wait_until(
            lambda: (
                ns.run("kvpool.testing.mooncake:http_json", f"http://{etcd}/health", None, 1)[0]
                == 200
            ),
            timeout_s=30,
            interval_s=0.1,
            what="etcd answers",
        )
        masters = {A: start(master_cmds[0], "master-a")}
        wait_until(
            lambda: _health(ns, A_METRICS).service_ready,
            timeout_s=FAILOVER_BOUND_S,
            interval_s=0.2,
            what="master A leads and serves",
        )
        masters[B] = start(master_cmds[1], "master-b")
        wait_until(
            lambda: _health(ns, B_METRICS).role == "standby",
            timeout_s=30,
            interval_s=0.2,
            what="master B stands by",
        )
        config = json.loads(
            doc_block("ha.mooncake-node").text_for(
                {"10.0.0.9": "127.0.0.1", "4GB": "32MB", "512MB": "16MB"}
            )
        )
        # opened as vLLM's store connector opens it ("backend": "mooncake",
        # MOONCAKE_CONFIG_PATH naming docs/ha.md's file): the connector follows the leader
        engine = NamespacedEngine(
            ns,
            ns.new("tests.mooncake.host:open_store_pool", config, str(log_dir / "mooncake.json")),
        )
        lookups = NamespacedEngine(
            ns,
            ns.new(
                "tests.mooncake.host:open_store_pool",
                config,
                str(log_dir / "mooncake.json"),
                lookups=True,
            ),
        )
        yield Pool(ns, etcd, masters, engine, lookups, log_dir)
        lookups.close()
        engine.close()


def _payload(tag: int) -> bytes:
    return bytes((tag + i) % 251 for i in range(OBJECT))


def _get(engine: NamespacedEngine, key: str) -> tuple[int, bytes]:
    out = bytearray(OBJECT)
    (got,) = engine.batch_get_parts([key], [[out]])
    return got, bytes(out)


@pytest.mark.timeout(240)
def test_kvpool_follows_mooncakes_leader_across_a_failover(pool: Pool) -> None:
    ns, engine = pool.ns, pool.engine
    etcd_spec, masters_spec = f"etcd://{pool.etcd}", f"{A_METRICS},{B_METRICS}"

    # before: A leads; the engine put through it; status and doctor say so
    assert engine.batch_put_parts(["before"], [[_payload(1)]]) == [None]
    assert _get(engine, "before") == (OBJECT, _payload(1))
    assert engine.health()["leader"] == A
    assert pool.lookups.batch_exists(["before"]) == [True]
    shown = pool.status_json(etcd_spec)
    assert shown["leader"] == A and shown["standbys_known"] is False, shown
    assert shown["facts"]["metrics_address"] == A_METRICS  # 9003 beside A is A's
    assert shown["facts"]["keys"] == 1 and shown["facts"]["active_clients"] == 1
    first_view = shown["view_version"]
    shown = pool.status_json(masters_spec)
    assert (shown["leader"], shown["standbys"], shown["down"]) == (A, [B_METRICS], []), shown
    checks = pool.doctor(masters_spec)
    assert checks["master.leader"].status.value == "PASS", checks["master.leader"]
    assert checks["master.leader"].message.startswith(f"{A} leads"), checks["master.leader"]
    assert B_METRICS in checks["master.leader"].message
    assert checks["master.engine"].status.value == "PASS"

    # the leader is SIGKILLed: B leads once A's lease (5 s) ran out, serves one TTL later
    pool.masters[A].kill()  # SIGKILL, by its PID
    killed = time.monotonic()
    wait_until(
        lambda: (ns.run(f"{__name__}:leader_now", pool.etcd) or ("", 0, False))[0] == B,
        timeout_s=FAILOVER_BOUND_S,
        interval_s=0.1,
        what="B leads in etcd",
    )
    no_leader_s = time.monotonic() - killed
    wait_until(
        lambda: (ns.run(f"{__name__}:leader_now", pool.etcd) or ("", 0, False))[2],
        timeout_s=FAILOVER_BOUND_S,
        interval_s=0.1,
        what="B serves",
    )
    serving_s = time.monotonic() - killed
    # the client follows by itself; its first puts meet a pool with no segment until it
    # has re-mounted its own on B (-200: no handle), so they are retried, bounded
    wait_until(
        lambda: engine.batch_put_parts(["after"], [[_payload(2)]]) == [None],
        timeout_s=FAILOVER_BOUND_S,
        interval_s=0.2,
        what="a put through the new leader" + pool.logs(),
    )
    works_s = time.monotonic() - killed
    print(
        f"\nMooncake failover: no leader {no_leader_s:.1f} s, serving after {serving_s:.1f} s,"
        f" client puts again after {works_s:.1f} s"
    )
    assert _get(engine, "after") == (OBJECT, _payload(2))
    # what Mooncake lost: the metadata of everything put before (op-log off) — a miss,
    # never wrong bytes
    assert _get(engine, "before")[0] == MISS
    assert engine.batch_exists(["before", "after"]) == [False, True]
    # the scheduler half's client followed too: it sees what the new leader holds
    wait_until(
        lambda: pool.lookups.batch_exists(["before", "after"]) == [False, True],
        timeout_s=FAILOVER_BOUND_S,
        interval_s=0.2,
        what="the lookups client follows the new leader" + pool.logs(),
    )
    assert engine.health()["leader"] == B

    # status and doctor name the new leader (a larger view) and the dead master
    (status,) = doc_block("ha.mooncake-status").commands()
    rc, out, err = pool.kvpool(*shlex.split(status)[1:])
    assert rc == 0, err
    assert f"Mooncake HA: {B} leads (Mooncake view" in out and "keeps only its leader" in out, out
    shown = pool.status_json(etcd_spec)
    assert shown["leader"] == B and shown["view_version"] > first_view, shown
    assert shown["facts"] is None  # 9003 beside B was A's: not mistaken for B's
    (status,) = doc_block("ha.mooncake-masters").commands()
    rc, out, err = pool.kvpool(*shlex.split(status)[1:])
    assert rc == 0, err
    assert f"standbys: none (a failover has nowhere to go); not answering: {A_METRICS}" in out
    assert "Mooncake master 127.0.0.1:9004" in out, out  # B's own §8.1 facts
    rc, out, err = pool.kvpool(*shlex.split(status)[1:], "--json")
    assert rc == 0, err
    shown = json.loads(out)
    assert (shown["leader"], shown["standbys"], shown["down"]) == (B, [], [A_METRICS]), shown
    assert shown["facts"]["keys"] == 1  # "after" alone: "before" went with A
    checks = pool.doctor(etcd_spec)
    assert checks["master.leader"].status.value == "PASS", checks["master.leader"]
    assert checks["master.leader"].message.startswith(f"{B} leads"), checks["master.leader"]
    assert checks["master.reachable"].status.value == "PASS"
