"""``kvpool up --engine mooncake``: the plan (pure), the one-line errors, and the wheel's
real ``mooncake_master`` started, checked and stopped by ``kvpool up --no-vllm`` inside a
private network namespace."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
from rich.console import Console

from kvpool.cli import build_parser
from kvpool.config.node import node_engine
from kvpool.errors import ConfigError
from kvpool.mooncake.settings import parse_mooncake_config
from kvpool.mooncake.up import GUIDE_FLAGS
from kvpool.mooncake.wheel import master_binary
from kvpool.net import http_get
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.doctor.checks import Status
from kvpool.ops.up.lifecycle import STATE_FILE, run
from kvpool.ops.up.options import UpOptions, options_from_args
from kvpool.ops.up.plan import make_plan, planned_ports, ready_text
from kvpool.ops.up.supervisor import Supervisor
from kvpool.testing import lifetime
from tests.ops.up.helpers import REPO, gone, metric, ns_http, unshared
from tests.waiting import wait_until


def mooncake_opts(tmp_path: Path, **kw: object) -> UpOptions:
    given: dict[str, object] = {"segment_size": 64 << 20, "python": "py", "cpus": (0, 1), **kw}
    return UpOptions(
        state_dir=tmp_path,
        engine="mooncake",
        mooncake_master="/opt/mooncake/mooncake_master",
        **given,  # type: ignore[arg-type]
    )


def kv_config(argv: tuple[str, ...]) -> dict[str, object]:
    config: dict[str, object] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_the_master_is_the_wheels_mooncake_master_with_the_guides_flags(tmp_path: Path) -> None:
    plan = make_plan(mooncake_opts(tmp_path, master_port=50088, metrics_port=9003))
    master = plan.by_role("master")[0]
    assert master.argv[0] == "/opt/mooncake/mooncake_master"
    assert set(master.argv[1:]) == {
        "--rpc_address=127.0.0.1",
        "--rpc_port=50088",
        "--metrics_host=127.0.0.1",
        "--metrics_port=9003",
        *GUIDE_FLAGS,
    }
    assert "--default_kv_lease_ttl=11000" in master.argv and "--client_ttl=120" in master.argv
    # its only HTTP is the metrics port; the supervisor's launcher runs under Python
    assert master.health_url == "http://127.0.0.1:9003/health"
    assert master.launcher == "py"
    assert [[p.name for p in s] for s in plan.stages] == [
        ["master"],
        ["prefill-0", "decode-0"],
        ["proxy"],
    ]
    assert tmp_path / "ssd" not in plan.dirs  # Mooncake's master keeps no SSD tier here
    flags = [u.flag for u in planned_ports(plan.options)]
    assert flags[:2] == ["--master-port", "--metrics-port"]


def test_p_and_d_read_a_mooncake_config_and_run_the_store_on_mooncake(tmp_path: Path) -> None:
    plan = make_plan(mooncake_opts(tmp_path, master_port=50088))
    data = json.loads(plan.files[plan.node_config_path])
    assert node_engine(data) == "mooncake"
    node = parse_mooncake_config(data)
    assert node.metadata_server == "P2PHANDSHAKE"
    assert node.master_server_address == "127.0.0.1:50088"
    assert node.global_segment_size == 64 << 20 and node.local_buffer_size == 64 << 20
    assert (node.local_hostname, node.protocol) == ("127.0.0.1", "tcp")
    for spec in plan.by_role("prefill") + plan.by_role("decode"):
        assert spec.env["KVPOOL_CONFIG_PATH"] == str(plan.node_config_path)
        assert spec.env["MOONCAKE_CONFIG_PATH"] == str(plan.node_config_path)
        children = kv_config(spec.argv)["kv_connector_extra_config"]["connectors"]  # type: ignore[index]
        assert [c["kv_connector"] for c in children] == [
            "KVPoolTransferConnector",
            "KVPoolStoreConnector",
        ]
        assert children[1]["kv_connector_extra_config"]["backend"] == "mooncake"
    # kvpool's engine keeps its own master and node config
    kvpool_plan = make_plan(UpOptions(state_dir=tmp_path, python="py"))
    assert node_engine(json.loads(kvpool_plan.files[kvpool_plan.node_config_path])) == "kvpool"
    assert kvpool_plan.by_role("master")[0].argv[1:4] == ("-m", "kvpool", "master")


def test_doctor_passes_the_planned_pair_on_the_mooncake_config(tmp_path: Path) -> None:
    plan = make_plan(mooncake_opts(tmp_path))
    plan.node_config_path.write_text(plan.files[plan.node_config_path])
    p, d = plan.by_role("prefill")[0], plan.by_role("decode")[0]
    options = DoctorOptions(
        prefill_config=json.dumps(kv_config(p.argv)),
        decode_config=json.dumps(kv_config(d.argv)),
        probe_keys=False,
    )
    env = {"KVPOOL_CONFIG_PATH": str(plan.node_config_path)}
    checks = [c for c in run_doctor(options, env=env) if c.name.startswith(("connector", "config"))]
    report = format_text(checks)
    assert checks and [c for c in checks if c.status is Status.FAIL] == [], report


def test_ready_text_gives_mooncakes_metrics(tmp_path: Path) -> None:
    plan = make_plan(mooncake_opts(tmp_path, master_port=50088, metrics_port=9003))
    lines = dict(ready_text(plan))
    assert "RPC 127.0.0.1:50088" in lines["master"]
    assert lines["metrics"] == (
        'curl -s http://127.0.0.1:9003/metrics | grep -E "master_key_count|master_active_clients"'
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"metrics_port": 50088, "master_port": 50088}, "--metrics-port and --master-port"),
        ({"segment_size": 8 << 20}, "--segment-size: Mooncake refuses a segment under 16MiB"),
    ],
)
def test_bad_mooncake_options_name_the_flag(
    tmp_path: Path, kw: dict[str, int], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_plan(mooncake_opts(tmp_path, **kw))


def test_engine_flag(tmp_path: Path) -> None:
    args = build_parser().parse_args(["up", "--engine", "mooncake", "--metrics-port", "0"])
    opts = options_from_args(args, {}, (0,), "py")
    assert opts.engine == "mooncake" and opts.metrics_port == 0
    assert options_from_args(build_parser().parse_args(["up"]), {}, (0,), "py").engine == "kvpool"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--engine", "redis"])
    with pytest.raises(ConfigError, match="--engine: 'redis'"):
        UpOptions(state_dir=tmp_path, engine="redis")


def test_a_missing_wheel_is_one_line_with_the_install_command(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as missing:
        master_binary(lambda name: None)
    text = str(missing.value)
    assert "\n" not in text and "pip install 'kvpool[mooncake]'" in text
    empty = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    with pytest.raises(ConfigError, match="mooncake_master is missing from the Mooncake wheel"):
        master_binary(lambda name: empty)
    assert Path(master_binary()).name == "mooncake_master"  # the installed wheel


def test_a_busy_metrics_port_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = io.StringIO()
        with pytest.raises(ConfigError) as taken:
            run(
                UpOptions(
                    state_dir=tmp_path / "state",
                    engine="mooncake",
                    no_vllm=True,
                    master_port=0,
                    metrics_port=port,
                ),
                console=Console(file=out),
            )
    text = str(taken.value)
    assert "\n" not in text and f"--metrics-port: 127.0.0.1:{port} is already in use" in text
    assert "master" not in out.getvalue()  # nothing was started


def test_the_launcher_execs_a_program_that_is_no_python(tmp_path: Path) -> None:
    spec = make_plan(mooncake_opts(tmp_path)).by_role("master")[0]
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\necho started\nexec sleep 300\n")
    sleeper.chmod(0o755)
    spec = type(spec)(**{**spec.__dict__, "argv": (str(sleeper),), "launcher": sys.executable})
    sup = Supervisor(base_env=dict(os.environ), term_timeout_s=5)
    running = sup.start(spec)
    try:
        wait_until(lambda: "started" in spec.log_path.read_text(), 10, what="the program ran")
    finally:
        outcome = sup.stop(running)
    assert outcome == "stopped" and gone(running.pid)


def test_up_no_vllm_runs_mooncake_master_in_a_namespace_and_stops_it(tmp_path: Path) -> None:
    """The real wheel's master, as ``kvpool up --engine mooncake --no-vllm`` starts it,
    under ``unshare -n``: healthy, its metrics answer, SIGTERM stops it by PID."""
    state = tmp_path / "state"
    argv = [sys.executable, "-m", "kvpool", "up", "--engine", "mooncake", "--no-vllm"]
    argv += ["--state-dir", str(state), "--master-port", "0", "--metrics-port", "0"]
    up = lifetime.popen(
        unshared(argv),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
    )
    try:

        def ready() -> dict[str, object] | None:
            assert up.poll() is None, up.communicate(timeout=10)[0]
            try:
                info = json.loads((state / STATE_FILE).read_text())
            except (OSError, ValueError):
                return None
            return info if info.get("status") == "ready" else None

        info = wait_until(ready, 60, interval_s=0.2, what="kvpool up --engine mooncake ready")
        master = info["processes"]["master"]  # type: ignore[index]
        assert Path(f"/proc/{master['pid']}/exe").resolve().name == "mooncake_master"
        # it runs in the namespace: the test's own network has nothing on its port
        assert http_get(f"{info['master']}/health", 1.0).status is None
        status, text = ns_http(up.pid, f"{info['master']}/metrics")
        assert status == 200 and "master_key_count" in text, text
        assert metric(text, "master_key_count") == 0
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate(timeout=30)
    assert up.returncode == 0, out
    assert "listen on every interface" in out and "kvpool up: ready" in out
    assert "  master     stopped" in out, out
    assert gone(master["pid"]) and not (state / STATE_FILE).exists()
