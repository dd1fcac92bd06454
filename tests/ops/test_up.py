"""``kvpool up`` without vLLM: the plan (pure), the supervisor (real, small processes) and
``kvpool up --no-vllm`` as a subprocess with a real master."""

from __future__ import annotations

import io
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from kvpool.cli import build_parser
from kvpool.config import MasterConfig, parse_node_config
from kvpool.errors import ConfigError
from kvpool.ops.checks import Status
from kvpool.ops.doctor import DoctorOptions, format_text, run_doctor
from kvpool.ops.kvconfig import parse_kv_transfer_config
from kvpool.ops.up import (
    CHAT_TEMPLATE,
    ProcessSpec,
    UpOptions,
    cpu_sets,
    kv_transfer_config,
    make_plan,
    ready_text,
)
from kvpool.ops.up_procs import StartupFailed, Supervisor
from kvpool.ops.up_run import (
    STATE_FILE,
    default_state_dir,
    options_from_args,
    resolve_ports,
    run_up,
)
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- the plan


def test_default_plan_is_master_then_both_instances_then_the_proxy(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0, 1), python="py"))
    assert [[p.name for p in stage] for stage in plan.stages] == [
        ["master"],
        ["prefill-0", "decode-0"],
        ["proxy"],
    ]
    urls = {p.name: p.health_url for p in plan.processes}
    assert urls == {
        "master": "http://127.0.0.1:50088/health",
        "prefill-0": "http://127.0.0.1:8100/health",
        "decode-0": "http://127.0.0.1:8200/health",
        "proxy": "http://127.0.0.1:8000/health",
    }
    assert plan.proxy_url == "http://127.0.0.1:8000"
    assert plan.build_model and plan.model_dir == tmp_path / "model" / "tiny-llama"
    assert all(p.log_path.parent == tmp_path / "logs" for p in plan.processes)


def test_vllm_instances_get_the_cpu_flags_and_environment(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0, 1), python="py"))
    p, d = plan.by_role("prefill")[0], plan.by_role("decode")[0]
    for spec, core in ((p, "0"), (d, "1")):
        argv = list(spec.argv)
        assert argv[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"]
        assert "--enforce-eager" in argv
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
        assert argv[argv.index("--model") + 1] == str(plan.model_dir)
        assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
        template = Path(argv[argv.index("--chat-template") + 1])
        assert plan.files[template] == CHAT_TEMPLATE
        assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == core
        assert spec.env["HF_HUB_OFFLINE"] == "1"
        assert spec.env["VLLM_NO_USAGE_STATS"] == "1"
        assert spec.env["KVPOOL_CONFIG_PATH"] == str(plan.node_config_path)
    # the node config the connectors read points at the plan's master
    node = parse_node_config(json.loads(plan.files[plan.node_config_path]))
    assert node.master_address == "127.0.0.1:50088"
    assert node.local_hostname == "127.0.0.1"


def test_the_connectors_are_the_seeds_multiconnector_with_recompute(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, cpus=(0,), python="py"))
    configs = {}
    for spec in plan.by_role("prefill") + plan.by_role("decode"):
        argv = list(spec.argv)
        configs[spec.role] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        config = configs[role]
        assert config["kv_connector"] == "MultiConnector"
        assert config["kv_role"] == kv_role
        assert config["kv_load_failure_policy"] == "recompute"  # top level, the seed's §8.3
        children = config["kv_connector_extra_config"]["connectors"]
        assert [c["kv_connector"] for c in children] == [
            "KVPoolTransferConnector",  # first: for a P/D request it claims the whole prompt
            "KVPoolStoreConnector",
        ]
        assert all(c["kv_role"] == kv_role for c in children)
        parsed = parse_kv_transfer_config(config)
        assert parsed.top.kind == "multi"
        assert [c.kind for c in parsed.children] == ["transfer", "store"]
    assert configs["prefill"]["kv_connector_extra_config"]["connectors"][0]["kv_port"] == "30000"
    assert configs["decode"]["kv_connector_extra_config"]["connectors"][0]["kv_port"] == "30100"
    store = configs["decode"]["kv_connector_extra_config"]["connectors"][1]
    assert store["kv_connector_extra_config"]["load_async"] is True


def test_kvpool_doctor_passes_the_planned_pair(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, python="py"))
    plan.node_config_path.write_text(plan.files[plan.node_config_path])
    options = DoctorOptions(
        prefill_config=json.dumps(kv_transfer_config("prefill", 30000, "127.0.0.1")),
        decode_config=json.dumps(kv_transfer_config("decode", 30100, "127.0.0.1")),
        probe_keys=False,
    )
    env = {"KVPOOL_CONFIG_PATH": str(plan.node_config_path)}  # as the plan gives vLLM
    checks = [c for c in run_doctor(options, env=env) if c.name.startswith("connector")]
    report = format_text(checks)
    assert checks and [c for c in checks if c.status is Status.FAIL] == [], report


def test_the_master_gets_a_memory_segment_and_an_ssd_tier(tmp_path: Path) -> None:
    plan = make_plan(
        UpOptions(state_dir=tmp_path, segment_size=512 << 20, ssd_limit=2 << 30, python="py")
    )
    master = plan.by_role("master")[0]
    assert master.argv[:4] == ("py", "-m", "kvpool", "master")
    config = MasterConfig.from_argv(master.argv[3:])
    assert config.port == 50088 and config.host == "127.0.0.1"
    assert config.segment_size == 512 << 20
    assert config.enable_offload
    assert config.ssd_offload_path == str(tmp_path / "ssd")
    assert config.ssd_offload_limit == 2 << 30
    assert (config.eviction_high_watermark_ratio, config.default_kv_lease_ttl) == (0.9, 11000)
    assert tmp_path / "ssd" in plan.dirs


def test_the_proxy_fronts_every_instance(tmp_path: Path) -> None:
    plan = make_plan(
        UpOptions(state_dir=tmp_path, decode_instances=2, policy="least_inflight", python="py")
    )
    proxy = plan.by_role("proxy")[0]
    args = build_parser().parse_args(list(proxy.argv[3:]))
    assert args.prefill == ["http://127.0.0.1:8100"]
    assert args.decode == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert (args.port, args.policy) == (8000, "least_inflight")


def test_several_decode_instances_get_their_own_ports_and_cores(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, decode_instances=2, cpus=(0, 1), python="py"))
    decodes = plan.by_role("decode")
    assert [d.name for d in decodes] == ["decode-0", "decode-1"]
    assert [d.url for d in decodes] == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    ports = []
    for d in decodes:
        config = json.loads(d.argv[list(d.argv).index("--kv-transfer-config") + 1])
        ports.append(config["kv_connector_extra_config"]["connectors"][0]["kv_port"])
    assert ports == ["30100", "30101"]
    cores = [p.env["VLLM_CPU_OMP_THREADS_BIND"] for p in plan.by_role("prefill") + decodes]
    # two cores, three instances: the prefill keeps a core of its own, the decodes share
    assert cores == ["0", "1", "1"]


def test_cpu_sets() -> None:
    assert cpu_sets(range(8), 2) == ["0-3", "4-7"]
    assert cpu_sets((0, 1), 2) == ["0", "1"]
    assert cpu_sets((0, 1), 3) == ["0", "1", "0"]
    assert cpu_sets((0, 1), 3, dedicated=1) == ["0", "1", "1"]
    assert cpu_sets((0, 1, 2), 5, dedicated=1) == ["0", "1", "2", "1", "2"]
    assert cpu_sets((0,), 2, dedicated=1) == ["0", "0"]  # nothing left to share: round robin
    assert cpu_sets((0, 2, 4, 6), 2) == ["0,2", "4,6"]
    assert cpu_sets((5,), 2) == ["5", "5"]


def test_a_real_model_is_used_as_given(tmp_path: Path) -> None:
    model = tmp_path / "my-model"
    plan = make_plan(UpOptions(state_dir=tmp_path, model=model, python="py"))
    assert not plan.build_model and plan.model_dir == model and plan.model_name == "my-model"
    argv = list(plan.by_role("decode")[0].argv)
    assert argv[argv.index("--dtype") + 1] == "auto"
    assert "--chat-template" not in argv  # a real model brings its own
    named = make_plan(
        UpOptions(state_dir=tmp_path, model=model, served_model_name="glm", dtype="bfloat16")
    )
    argv = list(named.by_role("prefill")[0].argv)
    assert argv[argv.index("--served-model-name") + 1] == "glm"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"


def test_no_vllm_is_the_master_alone(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, no_vllm=True, python="py"))
    assert [p.name for p in plan.processes] == ["master"]
    assert not plan.build_model and plan.proxy_url is None
    labels = dict(ready_text(plan))
    assert labels["metrics"] == (
        'curl -s http://127.0.0.1:50088/metrics | grep -E "kv_cache|connected"'
    )
    assert "completion" not in labels


def test_ready_text_curls_are_one_pasteable_line(tmp_path: Path) -> None:
    plan = make_plan(UpOptions(state_dir=tmp_path, proxy_port=9000, python="py"))
    labels = dict(ready_text(plan))
    for label, path, stream in (
        ("completion", "/v1/completions", False),
        ("streamed chat", "/v1/chat/completions", True),
    ):
        line = labels[label]
        assert "\n" not in line
        argv = shlex.split(line)
        assert argv[0] == "curl" and argv[2] == "http://127.0.0.1:9000" + path
        assert ("-sN" in argv) is stream
        body = json.loads(argv[argv.index("-d") + 1])
        assert body["model"] == "tiny-llama"
        assert body.get("stream", False) is stream


@pytest.mark.parametrize(
    ("kw", "flag"),
    [
        ({"master_port": 0}, "--master-port"),
        ({"proxy_port": 70000}, "--proxy-port"),
        ({"decode_instances": 0}, "--decode-instances"),
        ({"kv_cache_bytes": 1024}, "--kv-cache-bytes"),
        ({"segment_size": 0}, "--segment-size"),
        ({"decode_port": 8100}, "--decode-port"),  # clashes with the prefill instance
        ({"prefill_instances": 2, "decode_port": 8101}, "--decode-port"),
        ({"proxy_port": 50088}, "--proxy-port"),
    ],
)
def test_bad_options_name_the_flag(tmp_path: Path, kw: dict[str, int], flag: str) -> None:
    with pytest.raises(ConfigError, match=flag):
        make_plan(UpOptions(state_dir=tmp_path, **kw))  # type: ignore[arg-type]


def test_cli_flags_become_options(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "up", "--state-dir", str(tmp_path), "--master-port", "0", "--proxy_port", "9001",
            "--segment-size", "512MiB", "--ssd-limit=2GB", "--kv-cache-bytes", "32MiB",
            "--cpus", "0-1,3", "--decode-instances", "2",
            "--vllm-args", "--max-num-seqs 4 --trust-remote-code",
        ]
    )  # fmt: skip
    opts, zero = options_from_args(args, {}, (0,), "py")
    assert zero == {
        "master_port": True,
        "proxy_port": False,
        "prefill_port": False,
        "decode_port": False,
        "prefill_kv_port": False,
        "decode_kv_port": False,
    }
    assert (opts.segment_size, opts.ssd_limit, opts.kv_cache_bytes) == (
        512 << 20,
        2_000_000_000,
        32 << 20,
    )
    assert opts.cpus == (0, 1, 3) and opts.decode_instances == 2 and opts.proxy_port == 9001
    assert opts.state_dir == tmp_path
    relative = options_from_args(build_parser().parse_args(["up"]), {}, (0,), "py")[0]
    assert relative.state_dir == Path.cwd() / ".kvpool-state"
    assert opts.vllm_args == ("--max-num-seqs", "4", "--trust-remote-code")
    resolved = resolve_ports(opts, zero)
    assert resolved.master_port not in (0, 1) and resolved.proxy_port == 9001
    with socket.socket() as s:
        s.bind(("127.0.0.1", resolved.master_port))  # really free
    bad = build_parser().parse_args(["up", "--segment-size", "lots"])
    with pytest.raises(ConfigError, match="--segment-size"):
        options_from_args(bad, {}, (0,), "py")
    bad = build_parser().parse_args(["up", "--cpus", "one"])
    with pytest.raises(ConfigError, match="--cpus"):
        options_from_args(bad, {}, (0,), "py")


def test_default_state_dir() -> None:
    assert default_state_dir({"KVPOOL_STATE_DIR": "/s", "XDG_STATE_HOME": "/x"}) == Path("/s")
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/kvpool/up")
    assert default_state_dir({}) == Path(".kvpool-state")


# --------------------------------------------------------------------------- the supervisor

# A process that ignores SIGTERM and has a child (same process group) that ignores it too,
# as a stuck vLLM API server with its engine process would.
STUBBORN = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = subprocess.Popen([sys.executable, "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    print("CHILDPID", child.pid, flush=True)
    time.sleep(300)
    """
)


def spec(tmp_path: Path, name: str, code: str, *, stage: int = 0, health: str = "") -> ProcessSpec:
    return ProcessSpec(
        name=name,
        role=name,
        argv=(sys.executable, "-c", code),
        env={"PYTHONUNBUFFERED": "1"},
        health_url=health or "http://127.0.0.1:9/health",
        url="",
        log_path=tmp_path / f"{name}.log",
        stage=stage,
    )


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie not yet reaped by its (dead) parent counts as gone
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def child_pid(log: Path) -> int:
    wait_until(lambda: "CHILDPID " in log.read_text(errors="replace"))
    line = next(x for x in log.read_text().splitlines() if x.startswith("CHILDPID "))
    return int(line.split()[1])


@pytest.fixture
def sup() -> Iterator[Supervisor]:
    # a process that exits on SIGTERM gets ample time even on a loaded machine, so that
    # "stopped" never turns into "killed" by chance
    s = Supervisor(base_env=dict(os.environ), term_timeout_s=10.0, kill_timeout_s=10.0)
    try:
        yield s
    finally:
        s.stop_all()


def test_stop_escalates_to_sigkill_for_the_whole_group(tmp_path: Path, sup: Supervisor) -> None:
    running = sup.start(spec(tmp_path, "stubborn", STUBBORN))
    grandchild = child_pid(running.spec.log_path)
    sup.term_timeout_s = 1.0  # it will not stop on SIGTERM: no need to wait long
    stopped: list[tuple[str, str]] = []
    sup.stop_all(lambda r, how: stopped.append((r.spec.name, how)))
    assert stopped == [("stubborn", "killed (did not stop on SIGTERM)")]
    assert gone(running.pid) and gone(grandchild)


def test_stop_clears_what_a_dead_leader_left_in_its_group(tmp_path: Path, sup: Supervisor) -> None:
    parent = textwrap.dedent(
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print("CHILDPID", child.pid, flush=True)
        time.sleep(300)
        """
    )
    running = sup.start(spec(tmp_path, "server", parent))
    engine = child_pid(running.spec.log_path)
    os.kill(running.pid, signal.SIGKILL)  # the API server crashes, its engine lives on
    wait_until(lambda: running.proc.poll() is not None)
    assert [r.spec.name for r in sup.exited()] == ["server"] and sup.exited() == []
    assert not gone(engine)
    assert sup.stop(running) == "stopped"
    assert gone(engine)


def test_stop_goes_in_reverse_stage_order(tmp_path: Path, sup: Supervisor) -> None:
    sleeper = "import time; time.sleep(300)"
    for name, stage in (("master", 0), ("prefill", 1), ("decode", 1), ("proxy", 2)):
        sup.start(spec(tmp_path, name, sleeper, stage=stage))
    order: list[str] = []
    sup.stop_all(lambda r, how: order.append(f"{r.spec.name}:{how}"))
    assert order == ["proxy:stopped", "prefill:stopped", "decode:stopped", "master:stopped"]
    assert all(gone(pid) for pid in sup.pids().values())


def test_a_process_that_exits_while_starting_is_named_with_its_log(
    tmp_path: Path, sup: Supervisor
) -> None:
    running = sup.start(spec(tmp_path, "broken", "print('cannot bind port 1234'); exit(3)"))
    with pytest.raises(StartupFailed, match="broken: exited with exit status 3") as info:
        sup.wait_healthy([running], 30)
    assert "cannot bind port 1234" in info.value.log_path.read_text()


def test_a_process_that_never_gets_healthy_times_out(tmp_path: Path, sup: Supervisor) -> None:
    running = sup.start(spec(tmp_path, "silent", "import time; time.sleep(300)"))
    with pytest.raises(StartupFailed, match="silent: not healthy after 1 s"):
        sup.wait_healthy([running], 1.0)


def test_healthy_and_signal_during_start(tmp_path: Path, sup: Supervisor) -> None:
    web = tmp_path / "web"
    web.mkdir()
    (web / "health").write_text("ok")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = spec(
        tmp_path,
        "web",
        f"import http.server, functools; http.server.ThreadingHTTPServer(('127.0.0.1', {port}),"
        f" functools.partial(http.server.SimpleHTTPRequestHandler, directory={str(web)!r}))"
        ".serve_forever()",
        health=f"http://127.0.0.1:{port}/health",
    )
    seen: list[str] = []
    assert sup.wait_healthy([sup.start(server)], 30, on_healthy=lambda r: seen.append(r.spec.name))
    assert seen == ["web"]
    waiting = sup.start(spec(tmp_path, "waiting", "import time; time.sleep(300)"))
    assert not sup.wait_healthy([waiting], 30, should_stop=lambda: True)


PARENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from kvpool.ops.up import ProcessSpec
    from kvpool.ops.up_procs import Supervisor
    log = Path(sys.argv[1])
    s = Supervisor(base_env=dict(os.environ))
    s.start(ProcessSpec("kid", "kid", (sys.executable, "-c", "import time; time.sleep(300)"),
                        {}, "", "", log, 0))
    print(s.running[0].pid, flush=True)
    time.sleep(300)
    """
)


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "kid.log")],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert parent.stdout is not None
        kid = int(parent.stdout.readline())
        wait_until(lambda: "==> kvpool up" in (tmp_path / "kid.log").read_text())
        time.sleep(0.5)  # past the launcher's prctl
        assert not gone(kid)
    finally:
        parent.kill()
        parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
    wait_until(lambda: gone(kid), what="the child outlived its SIGKILLed supervisor")


def test_run_up_prints_the_failing_process_log_and_leaves_nothing(tmp_path: Path) -> None:
    fake_python = tmp_path / "fake-python"
    fake_python.write_text("#!/bin/sh\necho 'fatal: segment could not be mapped'\nexit 3\n")
    fake_python.chmod(0o755)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = io.StringIO()
    status = run_up(
        UpOptions(
            state_dir=tmp_path / "state", no_vllm=True, master_port=port, python=str(fake_python)
        ),
        start_timeout_s=30,
        console=Console(file=out, width=200),
    )
    text = out.getvalue()
    assert status == 1, text
    assert "master failed to start: exited with exit status 3 while starting" in text
    assert "fatal: segment could not be mapped" in text
    assert not (tmp_path / "state" / STATE_FILE).exists()


# --------------------------------------------------------------------------- kvpool up --no-vllm


def start_up(*flags: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvpool", "up", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        env={**os.environ, "COLUMNS": "200"},
    )


def read_state(state: Path, pid: int, timeout_s: float = 60.0) -> dict[str, object]:
    """``up.json`` once the ``kvpool up`` with this pid says it is ready."""
    path = state / STATE_FILE
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            data = json.loads(path.read_text())
            if data.get("status") == "ready" and data.get("pid") == pid:
                return data  # type: ignore[no-any-return]
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"kvpool up not ready in {timeout_s} s")


def test_up_no_vllm_serves_the_seeds_metrics_and_stops_clean(tmp_path: Path) -> None:
    state = tmp_path / "state"
    up = start_up("--no-vllm", "--state-dir", str(state), "--master-port", "0")
    try:
        info = read_state(state, up.pid)
        master = info["master"]
        assert isinstance(master, str)
        master_pid = info["processes"]["master"]["pid"]  # type: ignore[index]
        # the seed's §8.1 command, as written
        grep = subprocess.run(
            ["bash", "-c", f'curl -s {master}/metrics | grep -E "kv_cache|connected"'],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "kvpool_kv_cache_blocks_total 0.0" in grep
        assert "kvpool_connected_clients 1.0" in grep  # the master's own segment
        assert (state / "ssd").is_dir() and not (state / "model").exists()
        # the same state directory is refused while this one runs, and so is a taken port
        second = subprocess.run(
            [sys.executable, "-m", "kvpool", "up", "--no-vllm", "--state-dir", str(state)],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert second.returncode == 2 and "in use by another kvpool up" in second.stderr
        port = master.rsplit(":", 1)[1]
        third = subprocess.run(
            [sys.executable, "-m", "kvpool", "up", "--no-vllm", "--master-port", port,
             "--state-dir", str(tmp_path / "other")],
            capture_output=True, text=True, timeout=60, cwd=REPO,
        )  # fmt: skip
        assert third.returncode == 2 and "--master-port: 127.0.0.1:" in third.stderr
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate(timeout=10)
    assert up.returncode == 0, out
    assert "kvpool up: ready" in out and "master     stopped" in out
    assert gone(master_pid)
    assert not (state / STATE_FILE).exists()


def _run_no_vllm(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, object], int]:
    state = tmp_path / "state"
    up = start_up("--no-vllm", "--state-dir", str(state), "--master-port", "0")
    info = read_state(state, up.pid)
    master_pid = info["processes"]["master"]["pid"]  # type: ignore[index]
    assert isinstance(master_pid, int)
    return up, info, master_pid


def test_ctrl_c_stops_the_stack(tmp_path: Path) -> None:
    up, _, master_pid = _run_no_vllm(tmp_path)
    try:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate(timeout=10)
    assert up.returncode == 0, out
    assert "master     stopped" in out and gone(master_pid)


def test_a_dead_master_ends_the_stack(tmp_path: Path) -> None:
    up, _, master_pid = _run_no_vllm(tmp_path)
    try:
        os.kill(master_pid, signal.SIGKILL)
        out, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate(timeout=10)
    assert up.returncode == 1, out
    assert "master exited (signal SIGKILL)" in out
    assert "the master is gone; stopping the stack" in out


def test_a_killed_kvpool_up_takes_its_children_along(tmp_path: Path) -> None:
    up, _, master_pid = _run_no_vllm(tmp_path)
    up.kill()  # no chance to clean up: the children's parent-death signal must do it
    up.communicate(timeout=10)
    wait_until(lambda: gone(master_pid), 30, what="the master outlived a SIGKILLed kvpool up")
    # the up.json it left behind names a dead pid: the next kvpool up takes the directory
    again, _, again_master = _run_no_vllm(tmp_path)
    again.send_signal(signal.SIGTERM)
    out, _ = again.communicate(timeout=60)
    assert again.returncode == 0, out
    assert gone(again_master)


def test_without_vllm_installed_the_error_says_what_to_do(tmp_path: Path) -> None:
    # sys.modules["vllm"] = None makes the import system report vLLM as absent
    code = (
        "import sys; sys.modules['vllm'] = None; from kvpool.cli import main;"
        f" sys.exit(main(['up', '--state-dir', {str(tmp_path)!r}, '--master-port', '0']))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "vLLM is not installed" in done.stderr and "--no-vllm" in done.stderr
    assert not (tmp_path / "model").exists()  # refused before building anything
