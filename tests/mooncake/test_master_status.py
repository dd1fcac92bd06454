"""``kvpool status`` and ``kvpool doctor --master`` against a real ``mooncake_master``.

Everything Mooncake runs in a private network namespace (kvpool.testing.mooncake); the
commands run there too, as an operator on that host would run them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest

from kvpool.mooncake.master import MooncakeMasterFacts
from kvpool.ops.doctor.checks import Status
from kvpool.ops.doctor.checks_node import check_master
from kvpool.testing.mooncake import Namespace
from tests.mooncake.host import NamespacedEngine, mooncake_json
from tests.waiting import wait_until

SEGMENT = 18 << 20
OBJECT = 4 << 20
RPC = "127.0.0.1:50051"


@pytest.fixture(scope="module")
def ns() -> Iterator[Namespace]:
    """A master, and one client that contributes SEGMENT and has overfilled it: 6 puts
    into room for 4, so the master has evicted and refused allocations."""
    with Namespace() as ns:
        ns.new("kvpool.testing.mooncake:MooncakeMaster", "--eviction_ratio=0.25")
        engine = NamespacedEngine(
            ns,
            ns.new("tests.mooncake.host:open_engine", mooncake_json(RPC, SEGMENT)),
        )
        for i in range(6):  # Mooncake evicts in a background thread: a put may wait for room
            wait_until(
                lambda i=i: engine.batch_put_parts([f"status-{i}"], [[bytes(OBJECT)]]) == [None],
                timeout_s=20,
                interval_s=0.2,
                what=f"room for status-{i}",
            )
        yield ns


def kvpool(ns: Namespace, *argv: str) -> tuple[int, str, str]:
    done = ns.run(
        "subprocess:run",
        [sys.executable, "-m", "kvpool", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, done.stdout, done.stderr


@pytest.mark.parametrize("address", [RPC, "127.0.0.1:9003"])  # RPC port or metrics port
def test_status_reads_the_8_1_facts_from_a_mooncake_master(ns: Namespace, address: str) -> None:
    facts = ns.run("kvpool.ops.status:fetch_any", address)
    assert isinstance(facts, MooncakeMasterFacts)
    assert facts.metrics_address == "127.0.0.1:9003" and facts.role == "leader"
    assert 1 <= facts.keys <= 4  # what survived the evictions
    assert facts.active_clients == 1
    assert facts.capacity_bytes == SEGMENT
    assert 0 < facts.allocated_bytes <= SEGMENT
    assert facts.evictions >= 1 and facts.evicted_keys >= 2
    assert facts.alloc_failures >= 1
    assert list(facts.segments.values()) == [(facts.allocated_bytes, SEGMENT)]


def test_kvpool_status_prints_them(ns: Namespace) -> None:
    rc, out, err = kvpool(ns, "status", "--master", RPC)
    assert rc == 0, err
    assert "Mooncake master 127.0.0.1:9003" in out and "active clients" in out
    assert "allocation failures" in out and "master_*" in out
    rc, out, err = kvpool(ns, "status", "--master", RPC, "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert data["engine"] == "mooncake" and data["capacity_bytes"] == SEGMENT


def test_doctor_recognises_a_mooncake_master(ns: Namespace) -> None:
    facts = ns.run("kvpool.ops.doctor.probes:probe_master", RPC)
    assert facts.mooncake is not None and facts.mooncake.active_clients == 1
    checks = {c.name: c for c in check_master(facts)}
    assert checks["master.reachable"].status is Status.PASS
    assert checks["master.engine"].status is Status.PASS
    assert "Mooncake master" in checks["master.engine"].message
    assert "master_key_count" in checks["master.engine"].message  # the §8.1 check there
    assert checks["master.metrics"].status is Status.PASS
    assert checks["master.alloc_failures"].status is Status.WARN
    assert "default_kv_lease_ttl" in checks["master.alloc_failures"].fix
    _, out, _ = kvpool(ns, "doctor", "--master", RPC)
    assert "a Mooncake master answers" in out, out


def test_kvpool_node_pointed_at_a_mooncake_master_says_so_and_stops(
    ns: Namespace, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("node") / "kvpool.json"
    path.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": RPC}))
    rc, _, err = kvpool(ns, "node", "--config", str(path))  # retried forever before
    assert rc == 2, err
    assert "looks like a Mooncake master" in err and "127.0.0.1:9003" in err
