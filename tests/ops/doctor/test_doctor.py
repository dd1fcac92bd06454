"""``kvpool doctor`` end to end: real files, real sockets, a stand-in master on 127.0.0.1,
and the real command in a subprocess."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvpool.ops.doctor import DoctorOptions, exit_code, format_text, run_doctor
from kvpool.ops.doctor.checks import Check, Status
from tests.ops.helpers import (
    GQA_MODEL,
    GUIDE_P,
    MLA_MODEL,
    StandInMaster,
    children,
    free_port_range,
    free_ports,
    guide_d,
    guide_p,
    guideify,
)

GUIDE_MASTER_CMD = (
    "mooncake_master --port 50088 --eviction_high_watermark_ratio 0.9 --eviction_ratio 0.1"
    " --default_kv_lease_ttl 11000 --enable_offload=true --client_ttl=120"
)


def serve(config: dict[str, Any], flags: str = "") -> str:
    return f"vllm serve /workspace/GLM-5.2-w8a8 {flags} --kv-transfer-config '{json.dumps(config)}'"


class Cluster:
    """A correct guide-style node on this host: config file, SSD dir, MLA model, free ports."""

    def __init__(self, tmp: Path, master: StandInMaster) -> None:
        self.tmp = tmp
        self.master = master
        self.ssd = tmp / "nvme"
        self.ssd.mkdir()
        self.model = tmp / "model"
        self.model.mkdir()
        (self.model / "config.json").write_text(json.dumps(MLA_MODEL))
        self.node: dict[str, Any] = {
            "local_hostname": "127.0.0.1",
            "metadata_server": master.address,
            "protocol": "tcp",
            "enable_ssd_offload": True,
            "ssd_offload_path": str(self.ssd),
            "ssd_offload_limit": "1MB",
        }
        self.config_path = tmp / "mooncake.json"
        self.write_node()
        self.env = {
            "KVPOOL_CONFIG_PATH": str(self.config_path),
            "KVPOOL_CONNECT_TIMEOUT_MS": "16000",  # ≥ 500 ms × 32 decode ranks
        }
        # A gap of 200 between P and D: each has 32 ranks, so their port ranges are disjoint.
        base = free_port_range(232)
        self.p, self.d = guide_p(), guide_d()
        children(self.p)[0]["kv_port"] = str(base)
        children(self.d)[0]["kv_port"] = str(base + 200)
        children(self.d)[1]["kv_connector_extra_config"]["consumer_is_to_put"] = True

    def write_node(self) -> None:
        self.config_path.write_text(json.dumps(self.node))

    def options(self, **changes: Any) -> DoctorOptions:
        values: dict[str, Any] = {
            "prefill_config": serve(self.p, "-tp 8 -dp 4"),
            "decode_config": serve(self.d, "-tp 4 -dp 8"),
            "model": str(self.model),
            "master": self.master.address,
            "master_cmd": GUIDE_MASTER_CMD,
            "probe_keys": False,
        }
        values.update(changes)
        return DoctorOptions(**values)

    def run(self, **changes: Any) -> dict[str, Check]:
        checks = run_doctor(self.options(**changes), env=self.env)
        return {c.name: c for c in checks}


@pytest.fixture
def cluster(tmp_path: Path, master: StandInMaster) -> Cluster:
    return Cluster(tmp_path, master)


def statuses(checks: dict[str, Check], status: Status) -> list[str]:
    return [name for name, c in checks.items() if c.status is status]


def test_a_fully_correct_guide_style_node_passes_every_check(cluster: Cluster) -> None:
    checks = run_doctor(cluster.options(probe_keys=True), env=cluster.env)
    report = format_text(checks)
    assert exit_code(checks) == 0, report
    by_name = {c.name: c for c in checks}
    assert statuses(by_name, Status.FAIL) == [], report
    assert statuses(by_name, Status.WARN) == [], report
    assert statuses(by_name, Status.SKIP) == ["keys.cross_node"], report
    for name in (
        "config.file",
        "config.local_hostname",
        "config.master",
        "master.reachable",
        "master.health",
        "master.metrics",
        "master.flags",
        "env.pythonhashseed",
        "env.vllm_version",
        "keys.agreement",
        "connector.roles[prefill]",
        "connector.roles[decode]",
        "connector.failure_policy[prefill]",
        "connector.failure_policy[decode]",
        "connector.kv_port[pair]",
        "connector.peer_topology[prefill]",
        "connector.peer_topology[decode]",
        "connector.consumer_is_to_put[decode]",
        "ssd.offload",
        "timeouts.lease",
        "timeouts.connect",
        "ports.free[prefill kv_port]",
    ):
        assert by_name[name].status is Status.PASS, name
    # D pulls from P's kv_port and listens on none of its own: nothing to check there
    assert "ports.free[decode kv_port]" not in by_name


def test_config_file_pointing_at_a_dead_master(cluster: Cluster) -> None:
    [port] = free_ports(1)
    cluster.node["metadata_server"] = f"127.0.0.1:{port}"
    cluster.write_node()
    checks = cluster.run(master=None)
    assert checks["master.reachable"].status is Status.FAIL
    assert str(port) in checks["master.reachable"].message


def test_config_file_pointing_elsewhere_than_the_given_master(cluster: Cluster) -> None:
    cluster.node["metadata_server"] = "127.0.0.1:1"
    cluster.write_node()
    assert cluster.run()["config.master"].status is Status.FAIL


def test_config_variable_naming_a_missing_file(cluster: Cluster) -> None:
    cluster.env = {"MOONCAKE_CONFIG_PATH": str(cluster.tmp / "missing.json")}
    check = cluster.run()["config.file"]
    assert check.status is Status.FAIL and "MOONCAKE_CONFIG_PATH" in check.message


def test_rdma_protocol_on_this_machine_is_a_config_failure(cluster: Cluster) -> None:
    cluster.node["protocol"] = "rdma"
    cluster.write_node()
    check = cluster.run()["config.file"]
    assert check.status is Status.FAIL and '"protocol": "tcp"' in check.message


def test_ssd_limit_beyond_the_disk(cluster: Cluster) -> None:
    del cluster.node["ssd_offload_limit"]  # the production guide's 2 TiB default
    cluster.write_node()
    cluster.env["KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES"] = "1PB"
    check = cluster.run()["ssd.offload"]
    assert check.status is Status.FAIL
    assert "export KVPOOL_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES=" in check.fix


def test_ssd_path_missing(cluster: Cluster) -> None:
    cluster.node["ssd_offload_path"] = str(cluster.tmp / "no-nvme-here")
    cluster.write_node()
    assert cluster.run()["ssd.offload"].status is Status.FAIL


def test_consumer_is_to_put_on_a_gqa_model(cluster: Cluster) -> None:
    (cluster.model / "config.json").write_text(json.dumps(GQA_MODEL))
    assert cluster.run()["connector.consumer_is_to_put[decode]"].status is Status.FAIL


def test_a_taken_kv_port_before_start_and_a_held_one_when_live(cluster: Cluster) -> None:
    port = int(children(cluster.p)[0]["kv_port"])
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert cluster.run()["ports.free[prefill kv_port]"].status is Status.FAIL
        live = cluster.run(live=True, prefill_host="127.0.0.1")
        assert live["ports.free[prefill kv_port]"].status is Status.PASS
        assert live["ports.prefill_reachable"].status is Status.PASS
        # a running D listens on no kv_port: --live on D used to FAIL "nothing listens"
        assert "ports.free[decode kv_port]" not in live


def test_prefill_port_unreachable_from_decode(cluster: Cluster) -> None:
    checks = cluster.run(prefill_host="127.0.0.1")
    assert checks["ports.prefill_reachable"].status is Status.FAIL


def test_master_flags_out_of_range(cluster: Cluster) -> None:
    checks = cluster.run(
        master_cmd=GUIDE_MASTER_CMD.replace("--eviction_ratio 0.1", "--eviction_ratio 3")
    )
    assert checks["master.flags"].status is Status.FAIL


def test_lease_shorter_than_the_transfer_timeout(cluster: Cluster) -> None:
    cluster.env["ASCEND_TRANSFER_TIMEOUT"] = "20000"
    assert cluster.run()["timeouts.lease"].status is Status.FAIL


def test_unreadable_inputs_are_reported_not_raised(cluster: Cluster) -> None:
    checks = cluster.run(prefill_config="{not json", model=str(cluster.tmp / "nope"))
    assert checks["input.prefill-config"].status is Status.FAIL
    assert checks["input.model"].status is Status.FAIL
    checks = cluster.run(prefill_config="vllm serve /m --port 1")
    assert "kv-transfer-config" in checks["input.prefill-config"].message


def test_the_guides_own_prefill_command_through_the_real_cli(tmp_path: Path) -> None:
    """Exit status and JSON of the real command, fed the guide's config with its classes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPOOL_", "MOONCAKE_"))}
    env.pop("PYTHONHASHSEED", None)
    config = guideify(GUIDE_P)
    children(config)[0]["kv_load_failure_policy"] = config.pop("kv_load_failure_policy")
    command = serve(config)
    argv = [
        sys.executable,
        "-m",
        "kvpool",
        "doctor",
        "--json",
        "--no-key-probe",
        "--vllm-cmd",
        command,
    ]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    by_name = {c["name"]: c for c in report["checks"]}
    assert report["ok"] is False
    assert by_name["config.file"]["status"] == "FAIL"
    assert by_name["env.pythonhashseed"]["status"] == "FAIL"
    assert by_name["connector.failure_policy[prefill]"]["status"] == "FAIL"
    assert by_name["connector.classes[prefill]"]["status"] == "WARN"
    assert "KVPoolTransferConnector" in by_name["connector.classes[prefill]"]["fix"]
    env["PYTHONHASHSEED"] = "0"
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    by_name = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert by_name["env.pythonhashseed"]["status"] == "PASS"


def test_the_real_cli_passes_a_correct_node_with_exit_status_zero(cluster: Cluster) -> None:
    env = {**os.environ, **cluster.env}
    p_file = cluster.tmp / "p.json"
    p_file.write_text(json.dumps(cluster.p))
    argv = [
        sys.executable, "-m", "kvpool", "doctor",
        "--prefill-config", str(p_file),
        "--decode-config", serve(cluster.d, "-tp 4 -dp 8"),
        "--model", str(cluster.model),
        "--master", cluster.master.address,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1].startswith("0 failed")
    assert all(line.split()[0] in {"PASS", "WARN", "SKIP"} for line in lines[:-1])


def test_timeouts_are_the_transfer_connectors_own_values(cluster: Cluster) -> None:
    # The connector's extra config wins over the environment, so doctor must judge it.
    children(cluster.p)[0]["kv_connector_extra_config"]["connect_timeout_ms"] = 2000
    checks = cluster.run()
    assert checks["timeouts.connect"].status is Status.WARN
    assert "2000 ms" in checks["timeouts.connect"].message
    assert checks["connector.settings[prefill]"].status is Status.PASS


def test_an_extra_config_typo_is_caught_before_vllm_starts(cluster: Cluster) -> None:
    children(cluster.d)[1]["kv_connector_extra_config"]["load_asyncc"] = True
    check = cluster.run()["connector.settings[decode]"]
    assert check.status is Status.FAIL and "load_asyncc" in check.message


def test_a_running_master_reporting_its_flags_is_judged_without_master_cmd(
    tmp_path: Path,
) -> None:
    status = {
        "config": {"eviction_high_watermark_ratio": 0.9, "default_kv_lease_ttl": 5000},
        "clients": [{"address": "127.0.0.1:40000"}],
    }
    with StandInMaster(status=status) as running:
        cluster = Cluster(tmp_path, running)
        checks = cluster.run(master_cmd=None)
        assert checks["master.flags"].status is Status.PASS
        assert checks["timeouts.lease"].status is Status.FAIL  # 5000 ms ≤ 10000 ms
        live = cluster.run(master_cmd=None, live=True)
        assert live["master.registered"].status is Status.PASS
        running.status = {"config": {"eviction_ratio": 3}}
        bad = cluster.run(master_cmd=None)["master.flags"]
        assert bad.status is Status.FAIL and "running master reports" in bad.message
