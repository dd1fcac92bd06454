"""Doctor on Mooncake's own terms: its mooncake.json keys, its master's flags and defaults,
its RDMA devices, and what protects a pool without credentials.  Pure parts are driven
with values; the gathering runs on real files, with nothing listening at the master."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from kvpool.config.master import MasterConfig, parse_duration_ms
from kvpool.errors import ConfigError
from kvpool.mooncake.doctor import config_findings
from kvpool.mooncake.master_flags import MOONCAKE_MASTER_DEFAULTS, parse_master_command
from kvpool.mooncake.settings import parse_mooncake_config
from kvpool.ops.doctor import DoctorOptions, run_doctor
from kvpool.ops.doctor.checks import Check, Status, as_checks
from kvpool.ops.doctor.probes import rdma_devices


# ------------------------------------------------------------- the master's flags
@pytest.mark.parametrize(
    ("text", "ms"),
    [
        (11000, 11000),
        ("11000", 11000),
        ("11s", 11000),
        ("500ms", 500),
        ("2m", 120000),
        ("1h", 3600000),
        ("1.5s", 1500),
    ],
)
def test_lease_durations_read_as_mooncake_reads_them(text: object, ms: int) -> None:
    assert parse_duration_ms(text, "--default_kv_lease_ttl") == ms


@pytest.mark.parametrize("text", ["11x", "", "-1s", "0", True])
def test_a_bad_duration_names_the_flag(text: object) -> None:
    with pytest.raises(ConfigError, match="--default_kv_lease_ttl"):
        parse_duration_ms(text, "--default_kv_lease_ttl")


def test_mooncake_master_flags_in_its_own_spellings() -> None:
    command = parse_master_command(
        [
            "/venv/lib/python3.12/site-packages/mooncake/mooncake_master",
            "--rpc_address=127.0.0.1",
            "--rpc_port=50052",
            "-metrics_port",
            "9004",
            "-default_kv_lease_ttl=11s",
            "--client_ttl",
            "120",
            "--enable_http_metadata_server",
            "--eviction_ratio=0.1",
        ]
    )
    assert command.engine == "mooncake" and command.metrics_port == 9004
    c = command.config
    assert (c.host, c.port, c.default_kv_lease_ttl, c.client_ttl) == (
        "127.0.0.1",
        50052,
        11000,
        120,
    )
    assert c.eviction_ratio == 0.1
    assert ("enable_http_metadata_server", "true") in command.other


def test_mooncake_master_defaults_differ_from_kvpools() -> None:
    command = parse_master_command(["mooncake_master", "-port", "50051"], engine="mooncake")
    c = command.config
    assert (c.default_kv_lease_ttl, c.client_ttl, c.eviction_ratio) == (10_000, 10, 0.05)
    assert c.port == 50051 and command.metrics_port == 9003
    assert MOONCAKE_MASTER_DEFAULTS["default_kv_lease_ttl"] == 10_000


def test_rpc_port_zero_means_port_and_rpc_port_wins_otherwise() -> None:
    both = parse_master_command(["--port=1111", "--rpc_port=2222"])
    assert both.engine == "mooncake" and both.config.port == 2222
    zero = parse_master_command(["--rpc_port=0", "--port=1111"])
    assert zero.config.port == 1111


def test_the_guides_line_stays_kvpools_unless_mooncake_answered() -> None:
    guide = ["mooncake_master", "--port", "50088", "--default_kv_lease_ttl", "11000"]
    assert parse_master_command(guide).engine == "kvpool"
    assert parse_master_command(guide).config.client_ttl == MasterConfig().client_ttl
    assert parse_master_command(guide, engine="mooncake").config.client_ttl == 10


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["kvpool", "master", "--rpc_port", "50051"], "--rpc_port: a mooncake_master flag"),
        (["mooncake_master", "--rpc_port=1", "--segment_size=4GB"], "--segment_size"),
        (["mooncake_master", "--metrics_port=9003", "--no_such_flag=1"], "--no_such_flag"),
        (["mooncake_master", "--rpc_port=1", "--default_kv_lease_ttl=soon"], "lease_ttl"),
    ],
)
def test_a_bad_flag_is_named(argv: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        parse_master_command(argv)


def test_kvpool_master_takes_a_lease_as_a_duration_too() -> None:
    assert MasterConfig.from_argv(["master", "-default_kv_lease_ttl", "12s"]).lease_ttl_ms == 12000


# ------------------------------------------------------------- a Mooncake config
GUIDE_RDMA = {
    "local_hostname": "127.0.0.1",
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "127.0.0.1:50051",
    "global_segment_size": "3GB",
    "local_buffer_size": "1GB",
    "protocol": "rdma",
    "device_name": "ibp8s0f0",
}


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def test_a_missing_rdma_device_fails_naming_it_and_the_fix() -> None:
    config = parse_mooncake_config(GUIDE_RDMA)
    check = by_name(as_checks(config_findings("x", config, ("mlx5_0", "mlx5_1"))))[
        "config.device_name"
    ]
    assert check.status is Status.FAIL
    assert "ibp8s0f0" in check.message and "mlx5_0" in check.message
    assert "mlx5_0" in check.fix and "/sys/class/infiniband" in check.fix


def test_no_rdma_stack_at_all_fails_with_the_way_out() -> None:
    config = parse_mooncake_config(GUIDE_RDMA)
    for devices in (None, ()):
        check = by_name(as_checks(config_findings("x", config, devices)))["config.device_name"]
        assert check.status is Status.FAIL and "no RDMA device" in check.message
        assert '"protocol": "tcp"' in check.fix


def test_present_devices_pass_and_tcp_needs_none() -> None:
    two = parse_mooncake_config({**GUIDE_RDMA, "device_name": "mlx5_0,mlx5_1"})
    check = by_name(as_checks(config_findings("x", two, ("mlx5_0", "mlx5_1"))))[
        "config.device_name"
    ]
    assert check.status is Status.PASS
    tcp = parse_mooncake_config({**GUIDE_RDMA, "protocol": "tcp"})
    assert (
        by_name(as_checks(config_findings("x", tcp, None)))["config.device_name"].status
        is Status.PASS
    )


def test_the_device_listing_is_read_from_sysfs(tmp_path: Path) -> None:
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    assert rdma_devices(str(tmp_path)) == ("mlx5_0", "mlx5_1")
    assert rdma_devices(str(tmp_path / "absent")) is None


def _unused_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def doctor(tmp_path: Path, config: dict[str, object], **options: object) -> dict[str, Check]:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(config))
    env = {"MOONCAKE_CONFIG_PATH": str(path)}
    return by_name(run_doctor(DoctorOptions(probe_keys=False, **options), env=env))  # type: ignore[arg-type]


def test_a_vllm_ascend_style_config_is_checked_as_mooncakes(tmp_path: Path) -> None:
    master = f"127.0.0.1:{_unused_port()}"  # nothing listens: the master's checks fail alone
    config = {**GUIDE_RDMA, "master_server_address": master, "protocol": "tcp"}
    checks = doctor(tmp_path, config)
    assert checks["config.file"].status is Status.PASS, checks["config.file"]
    assert "a Mooncake config" in checks["config.file"].message
    assert "P2PHANDSHAKE" in checks["config.file"].message
    assert checks["config.master"].status is Status.PASS
    assert checks["config.local_hostname"].status is Status.PASS
    assert checks["security.credentials"].status is Status.WARN
    assert "network isolation" in checks["security.credentials"].message
    # Mooncake's default lease (10 s) is not longer than the default transfer timeout (10 s)
    lease = checks["timeouts.lease"]
    assert lease.status is Status.FAIL and "10000 ms" in lease.message, lease
    assert "mooncake_master's defaults" in checks["master.flags"].message


def test_the_lease_rule_reads_mooncakes_flags(tmp_path: Path) -> None:
    master = f"127.0.0.1:{_unused_port()}"
    config = {**GUIDE_RDMA, "master_server_address": master, "protocol": "tcp"}
    cmd = "mooncake_master -port 50051 --default_kv_lease_ttl=11s --metrics_port=9004"
    checks = doctor(tmp_path, config, master_cmd=cmd)
    assert checks["master.flags"].status is Status.PASS, checks["master.flags"]
    assert "client_ttl 10 s" in checks["master.flags"].message  # Mooncake's default
    assert checks["timeouts.lease"].status is Status.PASS, checks["timeouts.lease"]


def test_a_bad_mooncake_key_is_still_refused_by_name(tmp_path: Path) -> None:
    checks = doctor(tmp_path, {**GUIDE_RDMA, "local_buffer_sise": "1GB"})
    assert checks["config.file"].status is Status.FAIL
    assert "local_buffer_sise" in checks["config.file"].message


def test_a_script_starting_the_wheels_binary_by_its_path(tmp_path: Path) -> None:
    script = tmp_path / "master.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\n"
        "exec /venv/lib/python3.12/site-packages/mooncake/mooncake_master \\\n"
        "  --rpc_port=50051 --default_kv_lease_ttl=11s\n"
    )
    master = f"127.0.0.1:{_unused_port()}"
    config = {**GUIDE_RDMA, "master_server_address": master, "protocol": "tcp"}
    checks = doctor(tmp_path, config, master_cmd=str(script))
    assert checks["master.flags"].status is Status.PASS, checks["master.flags"]
    assert "lease 11000 ms" in checks["master.flags"].message
