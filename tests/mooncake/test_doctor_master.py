"""``kvpool doctor`` against a real ``mooncake_master`` with a Mooncake mooncake.json.

The master runs in a private network namespace (kvpool.testing.mooncake), and so does
doctor, as an operator on that host would run it.  Its metrics port is not the default
9003: doctor finds it from the command line given, and names the RPC port without it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpool.ops.doctor import DoctorOptions
from kvpool.ops.doctor.checks import Check, Status
from kvpool.testing.mooncake import Namespace

RPC = "127.0.0.1:50051"
MASTER_CMD = (
    "mooncake_master --rpc_address=127.0.0.1 -rpc_port 50051 --metrics_port=9114"
    " --default_kv_lease_ttl=11s --eviction_high_watermark_ratio 0.9"
)


@pytest.fixture(scope="module")
def ns() -> Iterator[Namespace]:
    with Namespace() as ns:
        ns.new(
            "kvpool.testing.mooncake:MooncakeMaster",
            "--default_kv_lease_ttl=11s",
            metrics_port=9114,
        )
        yield ns


def doctor(ns: Namespace, config_path: Path, **options: object) -> dict[str, Check]:
    env = {"MOONCAKE_CONFIG_PATH": str(config_path)}
    checks = ns.run(
        "kvpool.ops.doctor:run_doctor",
        DoctorOptions(probe_keys=False, **options),
        env=env,  # type: ignore[arg-type]
    )
    return {c.name: c for c in checks}


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "127.0.0.1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": RPC,
                "global_segment_size": "64MB",
                "local_buffer_size": "16MB",
                "protocol": "tcp",
            }
        )
    )
    return path


def test_doctor_checks_a_mooncake_node_against_its_master(ns: Namespace, config: Path) -> None:
    checks = doctor(ns, config, master_cmd=MASTER_CMD)
    assert (
        checks["config.file"].status is Status.PASS
        and "a Mooncake config" in checks["config.file"].message
    )
    assert checks["config.master"].status is Status.PASS
    engine = checks["master.engine"]
    assert engine.status is Status.PASS and "127.0.0.1:9114" in engine.message, engine
    assert (
        checks["master.flags"].status is Status.PASS
        and "lease 11000 ms" in checks["master.flags"].message
    )
    assert checks["timeouts.lease"].status is Status.PASS
    assert checks["security.credentials"].status is Status.WARN
    failed = [c for c in checks.values() if c.status is Status.FAIL]
    assert failed == [], failed


def test_without_the_command_doctor_still_names_mooncakes_rpc_port(
    ns: Namespace, config: Path
) -> None:
    checks = doctor(ns, config)
    assert checks["master.reachable"].status is Status.PASS
    health = checks["master.health"]
    assert health.status is Status.FAIL, health
    assert "Mooncake master's RPC port" in health.message and "9003" in health.message
    assert "--metrics_port" in health.fix
    # no flags given: Mooncake's default lease (10 s) against the 10 s transfer timeout
    assert checks["timeouts.lease"].status is Status.FAIL
